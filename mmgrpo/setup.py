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
from mmgrpo.lora import apply_train_type, check_trainable, model_skeleton, save_pretrained
from mmgrpo.models.loading import load_model, load_processor
from mmgrpo.models.tiny import resolve_model_path
from mmgrpo.parallel import build_strategy
from mmgrpo.policy import Policy
from mmgrpo.rewards import compute_rewards, get_reward, reward_name
from mmgrpo.rollout.shared_prefix import SharedPrefixRollout
from mmgrpo.templates import get_template, load_template_plugin


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
    strategy: object = None  # mmgrpo.parallel.Strategy: one process, FSDP2 or ZeRO-3
    peft_model: object = None  # LoRA: the PeftModel around `model` (it saves the adapter)
    _loader: object = field(default=None, repr=False)

    def total_steps(self, prompts_per_step: int) -> int:
        if self.cfg.max_steps > 0:
            return self.cfg.max_steps
        rows_per_rank = len(self.dataset) // self.strategy.world_size  # each rank reads its own share
        return max(1, math.floor(rows_per_rank * self.cfg.num_train_epochs / prompts_per_step))

    def prompt_batches(self, prompts_per_step: int):
        """An endless stream of lists of (Sample, PromptInputs), reshuffled each epoch."""
        loader = make_prompt_loader(
            self.dataset,
            batch_size=prompts_per_step,
            encode_fn=PromptEncoder(self.template, self.cfg.data.max_prompt_length),
            seed=self.cfg.seed,
            num_workers=self.cfg.data.dataloader_num_workers,
            media_kwargs=self.media_options(),
            rank=self.strategy.rank,
            world_size=self.strategy.world_size,
        )
        return cycle(loader)

    def media_options(self) -> dict:
        model = self.cfg.model
        return media_options(self.template, model.video_fps, model.video_nframes, model.use_audio_in_video)

    def save(self, path: Path) -> None:
        """An HF folder that from_pretrained loads (LoRA: the adapter). Every rank calls it; rank 0 writes."""
        # full weights gathered from the shards (LoRA: the adapters only)
        state_dict = self.strategy.full_state_dict(self.policy, trainable_only=self.peft_model is not None)
        if self.strategy.is_main:
            save_pretrained(self.model, self.peft_model, path, state_dict)
            self.processor.save_pretrained(path)
        self.strategy.barrier()


def check_modalities(dataset, template) -> None:
    """DataError if a dataset's first row has a medium the template's family does not take.

    One row per dataset (of a mixture) is read, not the whole dataset: a later odd row still
    fails when it is encoded, with its sample id named.
    """
    taken = set(template.modalities)
    for source in getattr(dataset, "sources", [dataset]):
        if not len(source):
            continue
        sample = source[0]
        for kind in ("image", "video", "audio"):
            if getattr(sample, kind + "s") and kind not in taken:
                raise DataError(
                    f"dataset {source.name!r} has {kind} input (sample {sample.id}), but --model_type "
                    f"{template.name!r} takes only {', '.join(sorted(taken)) or 'text'}; pick a model family "
                    f"that takes {kind} (docs/models.md), or drop this dataset"
                )


def keep_pixel_limits(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """Write --min_pixels/--max_pixels into the image processor, so checkpoints (and `mmgrpo eval`
    of them) resize images exactly as training did."""
    image_processor = getattr(processor, "image_processor", None)
    size = getattr(image_processor, "size", None)
    if not isinstance(size, dict) or "shortest_edge" not in size:
        return  # a family without pixel budgets (the template rejects the flags itself)
    image_processor.size = {
        **size,
        "shortest_edge": min_pixels or size["shortest_edge"],
        "longest_edge": max_pixels or size["longest_edge"],
    }


def media_options(template, video_fps, video_nframes, use_audio_in_video: bool) -> dict:
    """`Sample.load_media` options for training and evaluation alike: video frame sampling and,
    with use_audio_in_video, each video's sound track at the audio tower's rate."""
    options = {"fps": video_fps, "nframes": video_nframes}
    if use_audio_in_video:
        options.update(audio_in_video=True, sampling_rate=template.sampling_rate or 16000)
    return options


def reference_copy(model: torch.nn.Module, *, bf16: bool, share_frozen: bool) -> torch.nn.Module:
    """The frozen copy of the starting weights that the KL term compares with, in the compute dtype.

    Weights that do not train (`--freeze_vit`, `--freeze_aligner`, `--freeze_llm`) stay equal to
    the starting ones, so the copy holds the policy's own tensors for them instead of a second
    copy: a frozen 675M-parameter Qwen2-VL-7B vision tower is 2.7 GB less in fp32. Not under
    --bf16 (the copy is cast, the policy keeps fp32) nor under FSDP2 / ZeRO-3, which shard each
    model on its own.
    """
    shared = {id(p): p for p in model.parameters() if not p.requires_grad} if share_frozen and not bf16 else {}
    ref_model = copy.deepcopy(model, memo=dict(shared)).eval().requires_grad_(False)
    return ref_model.to(torch.bfloat16) if bf16 else ref_model


def build_run(cfg: TrainConfig) -> Run:
    dataset = mix_datasets(cfg.data.dataset, split=cfg.data.split, seed=cfg.seed, extra_files=cfg.data.dataset_registry)
    rewards = build_rewards(cfg, dataset)
    for spec in cfg.model.template_plugin:  # registers templates for --model_type; a bad file fails before any model loads
        load_template_plugin(spec)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    strategy = build_strategy(cfg)  # flags checked, process group up (torchrun), device picked
    device = strategy.device
    path = resolve_model_path(cfg.model.model)
    processor = load_processor(path)
    keep_pixel_limits(processor, cfg.model.min_pixels, cfg.model.max_pixels)
    template = get_template(
        cfg.model.model_type, processor, max_pixels=cfg.model.max_pixels, min_pixels=cfg.model.min_pixels,
        video_fps=cfg.model.video_fps, video_nframes=cfg.model.video_nframes,
        **({"use_audio_in_video": True} if cfg.model.use_audio_in_video else {}),  # qwen2.5-omni's option
    )
    check_modalities(dataset, template)  # audio for a vision-only family: an error before loading
    check_trainable(cfg.model, model_skeleton(path), template.components)  # LoRA targets, --freeze_*: before loading
    model = load_model(path).to(strategy.load_device)
    model.train()
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, peft_model = apply_train_type(model, template.components, cfg.model, seed=cfg.seed)
    ref_model = None  # with LoRA the reference is the base: the policy with its adapters disabled
    if cfg.algo.beta > 0 and cfg.model.train_type == "full":
        ref_model = reference_copy(model, bf16=cfg.bf16, share_frozen=cfg.dist.parallel == "none")
    # Sharded models (FSDP2 / ZeRO-3) gather weights inside each layer call, so every rank must make
    # the same calls. Their log-prob forwards share the prefix (always two forwards per call). Their
    # rollouts share it where the weights are gathered once for the whole rollout and the decode steps
    # are lean (no module call after the prefill, so a rank may stop early); else HF generate, synced.
    sharded = cfg.dist.parallel != "none"
    shared_rollout = not sharded or (cfg.dist.gather_for_generation and SharedPrefixRollout.lean_applies(model))
    policy = Policy(model, template, shared_prefix=cfg.model.shared_prefix, shared_rollout=shared_rollout)
    policy.ref_model = ref_model
    policy.disable_adapters = peft_model.disable_adapter if peft_model is not None else None
    return Run(cfg, dataset, rewards, model, processor, template, policy, ref_model, device,
               strategy=strategy, peft_model=peft_model)
