"""Everything a run needs before its first step, built in the order that fails fastest.

Rewards and datasets are resolved first (a typo in `--reward_funcs` or `--dataset` is an error
in a second, before any model loads); then the model, template, policy, reference model and
the prompt loader.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmgrpo.config import TrainConfig
from mmgrpo.data.pipeline import cycle, make_prompt_loader
from mmgrpo.data.registry import mix_datasets
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.models.loading import load_model, load_processor
from mmgrpo.models.tiny import resolve_model_path
from mmgrpo.policy import Policy
from mmgrpo.rewards import compute_rewards, get_reward, reward_name
from mmgrpo.templates import get_template


def dataset_of(sample_id: str) -> str:
    """"shapes-color/train/12" -> "shapes-color" (dataset names may contain "/")."""
    return sample_id.rsplit("/", 2)[0]


@dataclass
class RewardSet:
    """The run's reward functions and weights, called as one: (per_func [F, N], total [N]).

    routes: for a mixture whose datasets name different default rewards, which rewards apply
    to which dataset's samples; the others are skipped (NaN) for that sample, so a colour
    question is never scored by IoU.
    """

    names: list[str]
    funcs: list
    weights: list[float]
    on_error: str = "raise"
    routes: dict[str, list[str]] | None = None  # dataset name -> reward specs
    specs: list[str] | None = None  # as named in --reward_funcs / the registry

    def __call__(self, completions: list[str], columns: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.routes:
            return compute_rewards(self.funcs, self.weights, completions, columns, on_error=self.on_error)
        datasets = [dataset_of(sample_id) for sample_id in columns["sample_id"]]
        per_func = torch.full((len(self.funcs), len(completions)), float("nan"))
        for f, (spec, func) in enumerate(zip(self.specs, self.funcs)):
            rows = [i for i, d in enumerate(datasets) if spec in self.routes.get(d, self.specs)]
            if rows:
                sub_columns = {key: [values[i] for i in rows] for key, values in columns.items()}
                values, _ = compute_rewards([func], [1.0], [completions[i] for i in rows], sub_columns, on_error=self.on_error)
                per_func[f, rows] = values[0]
        total = torch.nansum(per_func * torch.tensor(self.weights)[:, None], dim=0)
        return per_func, total


def build_rewards(cfg: TrainConfig, dataset) -> RewardSet:
    """--reward_funcs for every sample, or else each dataset's own defaults (routed per sample)."""
    routes = None
    if cfg.algo.reward_funcs:
        names = cfg.algo.reward_funcs
    else:
        sources = getattr(dataset, "sources", [dataset])
        routes = {source.name: list(source.reward_funcs) for source in sources}
        names = list(dict.fromkeys(name for source in sources for name in source.reward_funcs))
        if len({tuple(r) for r in routes.values()}) <= 1:
            routes = None  # every sample gets the same rewards
    if not names:
        raise ConfigError(
            f"no reward functions: dataset {getattr(dataset, 'name', '')} names none; pass --reward_funcs "
            "(e.g. --reward_funcs vqa_accuracy format)."
        )
    weights = cfg.algo.reward_weights or [1.0] * len(names)
    funcs = [get_reward(name) for name in names]
    return RewardSet([reward_name(f) for f in funcs], funcs, list(weights), cfg.algo.reward_errors, routes, list(names))


class PromptEncoder:
    """Runs in DataLoader workers: decoded sample -> template inputs, length checked."""

    def __init__(self, template, max_prompt_length: int):
        self.template = template
        self.max_prompt_length = max_prompt_length

    def __call__(self, loaded):
        encoded = self.template.encode_prompt(loaded)
        length = encoded.prompt_ids.shape[-1]
        if length > self.max_prompt_length:
            raise DataError(
                f"sample {loaded.id}: prompt is {length} tokens (media included), over --max_prompt_length "
                f"{self.max_prompt_length}. Raise it, or lower --max_pixels / --video_nframes."
            )
        return encoded


@dataclass
class Run:
    cfg: TrainConfig
    dataset: object
    rewards: RewardSet
    model: torch.nn.Module
    processor: object
    template: object
    policy: Policy
    ref_model: torch.nn.Module | None
    device: torch.device
    step: int = 0
    nonfinite_steps: int = 0
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object = None
    _loader: object = field(default=None, repr=False)

    def total_steps(self, prompts_per_step: int) -> int:
        if self.cfg.max_steps > 0:
            return self.cfg.max_steps
        return max(1, math.floor(len(self.dataset) * self.cfg.num_train_epochs / prompts_per_step))

    def prompt_batches(self, prompts_per_step: int):
        """An endless stream of lists of (Sample, PromptInputs), reshuffled each epoch."""
        loader = make_prompt_loader(
            self.dataset,
            batch_size=prompts_per_step,
            encode_fn=PromptEncoder(self.template, self.cfg.data.max_prompt_length),
            seed=self.cfg.seed,
            num_workers=self.cfg.data.dataloader_num_workers,
            media_kwargs=self.media_options(),
        )
        return cycle(loader)

    def media_options(self) -> dict:
        return {"fps": self.cfg.model.video_fps, "nframes": self.cfg.model.video_nframes}

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.processor.save_pretrained(path)


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build_run(cfg: TrainConfig) -> Run:
    dataset = mix_datasets(cfg.data.dataset, split=cfg.data.split, seed=cfg.seed, extra_files=cfg.data.dataset_registry)
    rewards = build_rewards(cfg, dataset)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    device = pick_device()
    path = resolve_model_path(cfg.model.model)
    processor = load_processor(path)
    template = get_template(
        cfg.model.model_type, processor, max_pixels=cfg.model.max_pixels, min_pixels=cfg.model.min_pixels,
        video_fps=cfg.model.video_fps, video_nframes=cfg.model.video_nframes,
    )
    model = load_model(path).to(device)
    model.train()
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if cfg.algo.beta > 0:
        # A frozen copy of the starting weights, in the compute dtype: it never trains.
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.bf16:
            ref_model.to(torch.bfloat16)
    policy = Policy(model, template, shared_prefix=cfg.model.shared_prefix)
    return Run(cfg, dataset, rewards, model, processor, template, policy, ref_model, device)
