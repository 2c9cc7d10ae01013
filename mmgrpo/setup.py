"""Everything a GRPO run is built from, decided once, in the order that fails fastest.

    run = build_run(cfg)      # -> Run: data, rewards, template, model, reference, strategy,
                              #    policy, rollout engine, optimizer, schedule, evaluator

Rewards and datasets resolve first (a typo in `--reward_funcs` or `--dataset` is an error in a
second, before any model loads); then the template (plugins, model type, processor), the checks
that need only a weightless model, the model, its reference, the strategy's sharding and
optimizer, and the policy and rollout engine built on those. Nothing in a `Run` is replaced
afterwards; what changes while training is in `TrainState`.
"""

from __future__ import annotations

import copy
import json
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from mmgrpo.config import TrainConfig
from mmgrpo.data.pipeline import cycle, make_prompt_loader, media_options
from mmgrpo.data.registry import mix_datasets
from mmgrpo.data.schema import dataset_of
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.eval.in_training import TrainingEval
from mmgrpo.forward.policy import Policy
from mmgrpo.fusion.attach import bypassed, check_fusion_model, fusion_for_training, fusion_of
from mmgrpo.lora import apply_train_type, check_trainable, save_pretrained
from mmgrpo.models.loading import RUN_INFO_FILE, load_model, load_template, model_skeleton
from mmgrpo.optim import make_optimizer, make_scheduler
from mmgrpo.parallel import Strategy, build_strategy
from mmgrpo.rewards import compute_rewards, get_reward, reward_name
from mmgrpo.rewards.model_rewards import build_model_rewards
from mmgrpo.rewards.options import bind_options, parse_reward_kwargs
from mmgrpo.rollout import RolloutEngine, build_rollout_engine
from mmgrpo.rollout.base import SamplingParams
from mmgrpo.rollout.sampling import sampling_params
from mmgrpo.runlog import console
from mmgrpo.train_state import restore_weights


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
    timeout: float | None = None  # --reward_timeout: seconds per reward call

    def __call__(self, completions: list[str], columns: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.routes:
            return compute_rewards(self.funcs, self.weights, completions, columns, on_error=self.on_error, timeout=self.timeout)
        datasets = [dataset_of(sample_id) for sample_id in columns["sample_id"]]
        per_func = torch.full((len(self.funcs), len(completions)), float("nan"))
        for f, (spec, func) in enumerate(zip(self.specs, self.funcs)):
            rows = [i for i, d in enumerate(datasets) if spec in self.routes.get(d, self.specs)]
            if rows:
                sub_columns = {key: [values[i] for i in rows] for key, values in columns.items()}
                values, _ = compute_rewards([func], [1.0], [completions[i] for i in rows], sub_columns, on_error=self.on_error,
                                            timeout=self.timeout)
                per_func[f, rows] = values[0]
        total = torch.nansum(per_func * torch.tensor(self.weights)[:, None], dim=0)
        return per_func, total

    def stats(self) -> dict[str, float]:
        """Counters of the last call from rewards that keep them (the judge's judge/unparsed)."""
        return {key: value for func in self.funcs if hasattr(func, "stats") for key, value in func.stats().items()}


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
    funcs = bound_rewards(cfg, names)
    specs = list(names)
    # reward models and the judge (mmgrpo/rewards/model_rewards.py): after the functions, for every sample
    for model_reward in build_model_rewards(cfg):
        funcs.append(model_reward)
        specs.append(model_reward.reward_name)
        for route in (routes or {}).values():
            route.append(model_reward.reward_name)
    weights = cfg.algo.reward_weights or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(
            f"--reward_weights has {len(weights)} values for {len(funcs)} rewards ({', '.join(specs)}); "
            "give one per reward: --reward_funcs, then --reward_model(s), then the judge."
        )
    return RewardSet([reward_name(f) for f in funcs], funcs, list(weights), cfg.algo.reward_errors, routes, specs,
                     cfg.algo.reward_timeout)


def bound_rewards(cfg: TrainConfig, names: list[str]) -> list:
    """Each reward with its --reward_kwargs options bound (and the run's max_completion_length where it takes it)."""
    options = parse_reward_kwargs(cfg.algo.reward_kwargs)
    stray = sorted(set(options) - set(names))
    if stray:
        raise ConfigError(f"--reward_kwargs names {', '.join(stray)}, not among the run's rewards ({', '.join(names)}).")
    run_defaults = {"max_completion_length": cfg.rollout.max_completion_length}
    return [bind_options(get_reward(name), name, options.get(name, {}), run_defaults) for name in names]


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


@dataclass(frozen=True)
class ModelRun:
    """A model in training with what evaluating and saving it takes (`TrainingEval` needs no more):
    an SFT run is this alone (mmgrpo/sft.py), a GRPO run (`Run`) adds its data, rewards and optimizer."""

    cfg: object  # TrainConfig or SFTConfig
    processor: object
    template: object
    model: torch.nn.Module  # the HF model (LoRA: with its adapters injected)
    peft_model: object  # LoRA: the PeftModel around `model` (it saves the adapter); else None
    strategy: Strategy  # one process, FSDP2 or ZeRO-3
    rollout: RolloutEngine

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    @property
    def bf16(self) -> bool:
        """--bf16 where the device supports it."""
        return self.strategy.bf16

    def media_options(self) -> dict:
        return media_options(self.template, self.cfg.model)

    def save(self, path: Path) -> None:
        """An HF folder that from_pretrained loads (LoRA: the adapter). Every rank calls it; rank 0 writes."""
        save_checkpoint(path, self.model, self.peft_model, self.processor, self.template, self.strategy)


@dataclass(frozen=True)
class Run(ModelRun):
    """What a GRPO run is built from (`build_run`); nothing here is replaced while training."""

    dataset: object
    rewards: RewardSet
    policy: Policy  # log-probs under the policy and its reference
    optimizer: torch.optim.Optimizer
    scheduler: object
    evaluator: TrainingEval
    prompts_per_step: int
    total_steps: int

    def prompt_batches(self):
        """An endless stream of lists of (Sample, PromptInputs), reshuffled each epoch."""
        return prompt_stream(self.cfg, self.dataset, self.template, self.prompts_per_step, self.strategy)

    def sampling(self, prompts: list, seed: int | None = None) -> SamplingParams:
        """The rollout options for these (Sample, PromptInputs): each prompt's budget is its
        dataset's `max_completion_length` (registry) or --max_completion_length."""
        samples = [sample for sample, _ in prompts]
        return sampling_params(self.cfg, seed, samples, self.dataset.completion_caps)


@dataclass
class TrainState:
    """What changes while a run trains."""

    step: int = 0  # optimizer steps taken
    nonfinite_steps: int = 0  # steps skipped for a NaN/inf loss or gradient norm


def prompt_stream(cfg, dataset, template, batch_size: int, strategy: Strategy):
    """Batches of (Sample, PromptInputs) forever, reshuffled each epoch, each rank its own share."""
    loader = make_prompt_loader(
        dataset,
        batch_size=batch_size,
        encode_fn=PromptEncoder(template, cfg.data.max_prompt_length),
        seed=cfg.seed,
        num_workers=cfg.data.dataloader_num_workers,
        media_kwargs=media_options(template, cfg.model),
        rank=strategy.rank,
        world_size=strategy.world_size,
    )
    return cycle(loader)


def total_steps(cfg, dataset_rows: int, prompts_per_step: int, world_size: int) -> int:
    """--max_steps, or the steps of --num_train_epochs over this rank's share of the prompts."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    rows_per_rank = dataset_rows // world_size  # each rank reads its own share
    return max(1, math.floor(rows_per_rank * cfg.num_train_epochs / prompts_per_step))


def save_checkpoint(path: Path, model, peft_model, processor, template, strategy: Strategy) -> None:
    """An HF folder that from_pretrained loads (LoRA: the adapter) with the processor and the model
    type (`mmgrpo.json`, so `mmgrpo eval` needs no --model_type). Every rank calls it; rank 0 writes."""
    # full weights gathered from the shards (LoRA: the adapters only)
    state_dict = strategy.full_state_dict(model, trainable_only=peft_model is not None)
    if strategy.is_main:
        save_pretrained(model, peft_model, path, state_dict)
        processor.save_pretrained(path)
        (Path(path) / RUN_INFO_FILE).write_text(json.dumps({"model_type": template.name}) + "\n")
    strategy.barrier()


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


def model_context(model_path) -> int | None:
    """The longest sequence the model's positions cover (max_position_embeddings in config.json), if it says."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
        return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    except (OSError, ValueError, KeyError, TypeError):  # a plugin family's config: nothing to check against
        return None


def check_completion_budgets(cfg: TrainConfig, dataset, context: int | None) -> None:
    """ConfigError where a completion budget cannot work: a dataset's own `max_completion_length`
    above --max_completion_length (the run's longest: it sizes vLLM's max_model_len and the dr_grpo
    normaliser), or a budget that leaves no room for a prompt in the model's context."""
    longest = cfg.rollout.max_completion_length
    for source in getattr(dataset, "sources", [dataset]):
        cap, where = source.max_completion_length, f"dataset {source.name!r} ({source.source_file})"
        if cap is None:
            continue
        if context is not None and cap >= context:
            raise ConfigError(
                f"{where}: max_completion_length {cap} exceeds the model's context of {context} tokens "
                "(max_position_embeddings in its config.json), with no room for the prompt; lower it in the registry entry"
            )
        if cap > longest:
            raise ConfigError(
                f"{where}: max_completion_length {cap} is above --max_completion_length {longest}, the run's "
                f"longest completion; raise --max_completion_length to at least {cap} (a dataset's own budget "
                "only shortens it)"
            )
    if context is not None and longest >= context:
        raise ConfigError(
            f"--max_completion_length {longest} leaves no room for a prompt in the model's context of {context} tokens "
            "(max_position_embeddings in its config.json); lower it"
        )


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


def template_options(model_cfg) -> dict:
    """The template options the model flags give (`load_template`'s keywords)."""
    return dict(
        template_plugin=model_cfg.template_plugin, min_pixels=model_cfg.min_pixels, max_pixels=model_cfg.max_pixels,
        video_fps=model_cfg.video_fps, video_nframes=model_cfg.video_nframes,
        **({"use_audio_in_video": True} if model_cfg.use_audio_in_video else {}),  # qwen2.5-omni's option
    )


def load_trainable_model(cfg, path: str, template, strategy: Strategy, seed: int):
    """The model to train (train mode, checkpointing, frozen parts, LoRA, fusion modules) on the
    strategy's load device, with its LoRA wrapper (or None). LoRA targets, --freeze_*,
    --fusion_layers and the per-component rates are checked on a weightless skeleton first, so a
    typo fails before the weights load."""
    skeleton = model_skeleton(path, template)
    check_trainable(cfg.model, skeleton, template.components)
    check_fusion_model(cfg.model, cfg.optim, skeleton, template, path)
    model = load_model(path, template=template).to(strategy.load_device)  # with a checkpoint's fusion modules
    model.train()
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, peft_model = apply_train_type(model, template.components, cfg.model, seed=seed)
    fusion_for_training(model, template, cfg.model, seed=seed)  # --fusion_module (mmgrpo/fusion/)
    return model, peft_model


def reference_scope(model, peft_model):
    """How the policy's own forward becomes the reference's, where no copy is kept (None: a copy is
    needed): LoRA disables its adapters, fresh fusion modules are bypassed (their gates add 0 at the
    start), both together for LoRA with fusion modules."""
    fusion = fusion_of(model)
    if fusion is not None and fusion.trained:  # modules trained before this run: the start is not the base
        return None
    if peft_model is None and fusion is None:
        return None

    @contextmanager
    def scope():
        with (peft_model.disable_adapter() if peft_model is not None else nullcontext()), bypassed(model):
            yield

    return scope


def build_run(cfg: TrainConfig, resume_from: Path | None = None) -> Run:
    """resume_from: a checkpoint whose weights the policy takes (mmgrpo/resume.py); the reference
    is still the starting --model."""
    cfg.validate()
    evaluator = TrainingEval(cfg)  # --eval_dataset and --eval_metrics checked before any model loads
    dataset = mix_datasets(cfg.data.dataset, split=cfg.data.split, seed=cfg.seed, extra_files=cfg.data.dataset_registry)
    rewards = build_rewards(cfg, dataset)
    path, processor, template = load_template(cfg.model.model, cfg.model.model_type, **template_options(cfg.model))
    check_modalities(dataset, template)  # audio for a vision-only family: an error before loading
    check_completion_budgets(cfg, dataset, model_context(path))
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    strategy = build_strategy(cfg)  # process group up (torchrun), device and precision picked
    model, peft_model = load_trainable_model(cfg, path, template, strategy, cfg.seed)
    if cfg.rollout.use_vllm and fusion_of(model) is not None:
        raise ConfigError(
            f"--model {cfg.model.model} holds fusion modules and --use_vllm runs the model's stock architecture "
            "without them: drop --use_vllm (the in-process engines run the modules)."
        )
    # LoRA / fresh fusion modules: the reference is the base, the policy with its adapters or modules off
    without_training = reference_scope(model, peft_model) if cfg.model.train_type != "full" else None
    ref_model = None
    if cfg.algo.beta > 0 and without_training is None:
        ref_model = reference_copy(model, bf16=strategy.bf16, share_frozen=not strategy.sharded)
    if resume_from is not None:  # after the reference copy, before sharding
        restore_weights(model, resume_from, peft_model=peft_model, template=template)
    prompts_per_step = cfg.optim.per_device_train_batch_size * cfg.optim.gradient_accumulation_steps // cfg.rollout.num_generations
    steps = total_steps(cfg, len(dataset), prompts_per_step, strategy.world_size)
    # FSDP2 / ZeRO-3 shard, then the optimizer (parameter groups by component with --vit_lr ...)
    prepared = strategy.prepare(model, ref_model, make_optimizer(cfg.optim, model, template.components))
    policy = Policy(
        model, template, shared_prefix=cfg.model.shared_prefix, call=prepared.call,
        ref_model=ref_model, ref_call=prepared.ref_call, disable_adapters=without_training,
    )
    if cfg.model.shared_prefix and not policy.shared_prefix and strategy.is_main:
        console.print(f"[yellow]group-shared prefix off ({policy.naive_reason}): prompts run once per completion")
    rollout = build_rollout_engine(
        policy, strategy, prepared, gather_for_generation=cfg.dist.gather_for_generation,
        asynchronous=cfg.rollout.async_generate, peft_model=peft_model,
        vllm=(cfg, str(path)) if cfg.rollout.use_vllm else None,  # --use_vllm: vLLM loads `path` itself, then syncs
        max_turns=cfg.rollout.max_turns, tools=cfg.rollout.tools, tool_timeout=cfg.rollout.tool_timeout,
    )
    return Run(
        cfg=cfg, dataset=dataset, rewards=rewards, processor=processor, template=template, model=model,
        peft_model=peft_model, strategy=strategy, policy=policy, rollout=rollout, optimizer=prepared.optimizer,
        scheduler=make_scheduler(cfg.optim, prepared.optimizer, steps), evaluator=evaluator,
        prompts_per_step=prompts_per_step, total_steps=steps,
    )
