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

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from mmgrpo.config import SFTConfig, TrainConfig
from mmgrpo.config.checks import parse_modality_weights
from mmgrpo.data.catalog import mix_datasets
from mmgrpo.data.prompt_batches import media_options, prompt_stream
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.eval.in_training import TrainingEval
from mmgrpo.forward.policy import Policy
from mmgrpo.fusion.attach import bypassed, fusion_of
from mmgrpo.grpo.losses import LossConfig
from mmgrpo.models.loading import load_template, template_options
from mmgrpo.models.saving import save_model_folder
from mmgrpo.models.train_type import load_teacher, load_trainable_model, reference_copy, teacher_checkpoint
from mmgrpo.parallel import Strategy, build_strategy
from mmgrpo.rewards.reward_set import RewardSet, build_rewards, judge_vllm_options
from mmgrpo.rollout import RolloutEngine, build_rollout_engine, prefills_once
from mmgrpo.rollout.base import SamplingParams, sampling_params
from mmgrpo.rollout.vllm_engine import build_vllm_engine
from mmgrpo.runstate.disk_space import checkpoint_bytes, checkpoints_kept, warn_if_short
from mmgrpo.runstate.runlog import console
from mmgrpo.training.optim import make_optimizer, make_scheduler
from mmgrpo.training.resume import restore_weights
from mmgrpo.training.startup_checks import loss_config


def startup_summary(cfg, model: torch.nn.Module, template, dataset, strategy: Strategy, prompts_per_step: int,
                    steps: int) -> str:
    """What the run is about to do, in four lines: the model, the data, the batch and the machine
    (counted before sharding, so FSDP2 and ZeRO-3 report whole-model figures)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sources = getattr(dataset, "sources", None)
    data = (" + ".join(f"{source.name}:{source.split} {weight:.2f}" for source, weight in zip(sources, dataset.weights))
            if sources else f"{getattr(dataset, 'name', cfg.data.dataset[0])}:{getattr(dataset, 'split', cfg.data.split)}")
    G = cfg.rollout.num_generations
    devices = f"{strategy.world_size} x {strategy.device.type}" + (f" ({cfg.dist.strategy})" if strategy.world_size > 1 else "")
    return "\n".join([
        f"model   {cfg.model.model}: {template.name}, {type(model).__name__}, {total / 1e6:,.1f}M parameters, "
        f"{trainable / 1e6:,.1f}M trainable ({cfg.model.train_type})",
        f"data    {data}: {len(dataset):,} prompts",
        f"batch   {prompts_per_step} prompts x G={G} = {prompts_per_step * G} completions a step (per process), "
        f"{steps} step{'s' if steps != 1 else ''}, up to {cfg.rollout.max_completion_length} new tokens",
        f"device  {devices}, {precision_note(strategy.precision, cfg.bf16)}, {cfg.model.attn_implementation} attention, "
        f"rollouts on {'vLLM (' + cfg.rollout.vllm_mode + ')' if cfg.rollout.use_vllm else 'transformers'}",
    ])


def precision_note(precision: str, bf16_asked: bool) -> str:
    """What the forwards compute in and, for float32, why: asked, or no GPU with bfloat16 here."""
    if precision != "fp32":
        return "bf16 autocast" if precision == "bf16" else "fp16 autocast with dynamic loss scaling"
    if bf16_asked is False and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "float32 (--bf16 false)"
    if torch.cuda.is_available():
        return "float32 (this GPU has no bfloat16; --fp16 trains in float16 with loss scaling)"
    return "float32 (no GPU here; --bf16 turns on CPU bfloat16 autocast)"


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
    def compute_dtype(self) -> torch.dtype | None:
        """The forwards' autocast dtype (--bf16 where the device supports it, --fp16); None: float32."""
        return self.strategy.compute_dtype

    def media_options(self) -> dict:
        return media_options(self.template, self.cfg.model)

    def save(self, path: Path) -> None:
        """An HF folder that from_pretrained loads (LoRA: the adapter), with the processor and the model
        type (`mmgrpo.json`). Every rank calls it (the weights are gathered from the shards); rank 0 writes."""
        state_dict = self.strategy.full_state_dict(self.model, trainable_only=self.peft_model is not None)
        if self.strategy.is_main:
            save_model_folder(path, self.model, self.peft_model, self.processor, self.template, state_dict)
        self.strategy.barrier()

    def evaluate(self, evaluator: TrainingEval, step: int, state, final: bool = False) -> dict[str, float]:
        """`evaluator.maybe_evaluate` on this model, its rollout engine, and `save` for checkpoint-best."""
        return evaluator.maybe_evaluate(
            step, state, final, model=self.model, rollout=self.rollout, template=self.template,
            strategy=self.strategy, media_kwargs=self.media_options(), save=self.save,
        )


@dataclass(frozen=True)
class Run(ModelRun):
    """What a GRPO run is built from (`build_run`); nothing here is replaced while training."""

    dataset: object
    rewards: RewardSet
    policy: Policy  # log-probs under the policy and its reference
    optimizer: torch.optim.Optimizer
    scheduler: object
    evaluator: TrainingEval
    loss_config: LossConfig  # the loss options, checked once
    modality_weights: dict[str, float]  # --modality_weights, parsed once
    prompts_per_step: int
    total_steps: int

    def prompt_batches(self):
        """An endless stream of lists of (Sample, PromptInputs), reshuffled each epoch."""
        return prompt_stream(self.cfg.data, self.cfg.model, self.dataset, self.template, self.prompts_per_step,
                             self.strategy, seed=self.cfg.seed)

    def sampling(self, prompts: list, seed: int | None = None) -> SamplingParams:
        """The rollout options for these (Sample, PromptInputs): each prompt's budget is its
        dataset's `max_completion_length` (registry) or --max_completion_length."""
        samples = [sample for sample, _ in prompts]
        return sampling_params(self.cfg.rollout, seed, samples, self.dataset.completion_caps)


def total_steps(cfg, dataset_rows: int, prompts_per_step: int, world_size: int) -> int:
    """--max_steps, or the steps of --num_train_epochs over this rank's share of the prompts."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    rows_per_rank = dataset_rows // world_size  # each rank reads its own share
    return max(1, math.floor(rows_per_rank * cfg.num_train_epochs / prompts_per_step))


def training_eval(cfg: TrainConfig | SFTConfig) -> TrainingEval:
    """The evaluations during training --eval_* ask for, their datasets and metrics resolved now.
    GRPO: the run's completion budget, and its rewards for an eval dataset that names none; SFT
    (no rewards): its own budget."""
    if isinstance(cfg, TrainConfig):
        budget, fallback_metrics = cfg.rollout.max_completion_length, cfg.algo.reward_funcs
    else:
        budget, fallback_metrics = cfg.max_completion_length, []
    return TrainingEval(cfg.eval, cfg.output_dir, budget, fallback_metrics=fallback_metrics,
                        dataset_registry=cfg.data.dataset_registry, system_prompt=cfg.data.system,
                        media_root=cfg.data.media_root)


def check_modalities(dataset, template) -> None:
    """DataError if a dataset's first row has a medium the template's family does not take, or, for a
    family whose forward takes images or videos in a batch but not both (`separate_media_batches`),
    if the datasets' first rows hold both.

    One row per dataset (of a mixture) is read, not the whole dataset: a later odd row still
    fails when it is encoded (or, images beside videos, when its batch is collated), with its sample id named.
    """
    taken = set(template.modalities)
    first_with = {}  # "image" / "video" -> (dataset name, sample id) of a first row that has it
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
            if getattr(sample, kind + "s"):
                first_with.setdefault(kind, (source.name, sample.id))
    if template.separate_media_batches and "image" in first_with and "video" in first_with:
        (image_set, image_id), (video_set, video_id) = first_with["image"], first_with["video"]
        raise DataError(
            f"dataset {image_set!r} has images (sample {image_id}) and {video_set!r} has videos (sample {video_id}), but "
            f"--model_type {template.name!r} takes images or videos in one batch, not both (its forward fills every image "
            "token from the images) and mmgrpo has no per-modality batching: train the image and the video datasets "
            "in separate runs"
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


def vllm_engine_factory(cfg: TrainConfig, model_path: str):
    """--use_vllm: (template, strategy) -> the vLLM engine that loads `model_path`, with the run's options."""
    return partial(build_vllm_engine, cfg.rollout, model_path, max_prompt_length=cfg.data.max_prompt_length,
                   seed=cfg.seed, output_dir=cfg.output_dir)


def build_run(cfg: TrainConfig, resume_from: Path | None = None) -> Run:
    """The run of a checked config (`check_train_flags`, mmgrpo/training/startup_checks.py, which
    `engine.train` calls first).
    resume_from: a checkpoint whose weights the policy takes (mmgrpo/training/resume.py); the
    reference is still the starting --model."""
    evaluator = training_eval(cfg)  # --eval_dataset and --eval_metrics checked before any model loads
    dataset = mix_datasets(cfg.data.dataset, split=cfg.data.split, seed=cfg.seed, extra_files=cfg.data.dataset_registry,
                           media_root=cfg.data.media_root, system_prompt=cfg.data.system)
    judge_vllm = judge_vllm_options(cfg.algo, cfg.rollout, cfg.data.max_prompt_length, cfg.seed)
    rewards = build_rewards(cfg.algo, dataset, cfg.rollout.max_completion_length, judge_vllm)
    path, processor, template = load_template(cfg.model.model, cfg.model.model_type, **template_options(cfg.model))
    check_modalities(dataset, template)  # audio for a vision-only family: an error before loading
    check_completion_budgets(cfg, dataset, model_context(path))
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    strategy = build_strategy(cfg.dist, cfg.optim, cfg.precision)  # process group up (torchrun), device and precision picked
    model, peft_model = load_trainable_model(cfg.model, cfg.optim, path, template, strategy, cfg.seed)
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
    steps = total_steps(cfg, len(dataset), prompts_per_step, strategy.data_world)
    if strategy.is_main:  # a disk too small for the checkpoints the run keeps: said now, not at the first save
        kept = checkpoints_kept(steps, cfg.save_steps, cfg.save_total_limit, keeps_best=bool(cfg.eval.eval_dataset))
        warn_if_short(cfg.output_dir, checkpoint_bytes(model, trainable_only=peft_model is not None), kept)
    if strategy.is_main:
        console.print(startup_summary(cfg, model, template, dataset, strategy, prompts_per_step, steps), soft_wrap=True,
                      highlight=False, markup=False, emoji=False)  # "shapes-color:train:" is no emoji
    # FSDP2 / ZeRO-3 shard, then the optimizer (parameter groups by component with --vit_lr ...)
    teacher = teacher_server = None  # --teacher_model in the trainer, or on its rollout server (--teacher_server_port)
    if cfg.algo.teacher_server_port is not None:
        from mmgrpo.rollout.vllm_engine import build_teacher_client

        teacher_path, _ = teacher_checkpoint(cfg.algo.teacher_model, cfg.model, template)
        teacher_server = build_teacher_client(cfg.algo, cfg.rollout, teacher_path, template, strategy)
    elif cfg.algo.teacher_model:
        teacher = load_teacher(cfg.algo.teacher_model, cfg.model, template, bf16=strategy.bf16, device=strategy.load_device)
    prepared = strategy.prepare(model, ref_model, make_optimizer(cfg.optim, model, template.components), teacher)
    policy = Policy(
        model, template, shared_prefix=cfg.model.shared_prefix, call=prepared.call,
        ref_model=ref_model, ref_call=prepared.ref_call, disable_adapters=without_training,
        per_row_routing=cfg.algo.routing_replay == "rollout" or cfg.algo.router_aux_loss_coef > 0, teacher_model=teacher,
        teacher_call=prepared.teacher_call, teacher_server=teacher_server, sequence_group=strategy.sequence_group,
    )
    if strategy.sequence_group is not None:  # heads the group cannot split: named before the first step
        from mmgrpo.forward.sequence_parallel import check_heads

        check_heads(model, template, strategy.sequence_size)
    if cfg.model.shared_prefix and not policy.shared_prefix and strategy.is_main:
        where = ("in the log-prob forwards (the rollout prefills each prompt once)"
                 if prefills_once(policy, strategy, cfg.dist.gather_for_generation) else "prompts run once per completion")
        console.print(f"[yellow]group-shared prefix off ({policy.naive_reason}): {where}")
    rollout = build_rollout_engine(
        policy, strategy, prepared, gather_for_generation=cfg.dist.gather_for_generation,
        asynchronous=cfg.rollout.staleness_bound > 0, peft_model=peft_model,
        vllm=vllm_engine_factory(cfg, str(path)) if cfg.rollout.use_vllm else None,  # vLLM loads `path` itself, then syncs
        max_turns=cfg.rollout.max_turns, tools=cfg.rollout.tools, tool_timeout=cfg.rollout.tool_timeout,
    )
    return Run(
        cfg=cfg, dataset=dataset, rewards=rewards, processor=processor, template=template, model=model,
        peft_model=peft_model, strategy=strategy, policy=policy, rollout=rollout, optimizer=prepared.optimizer,
        scheduler=make_scheduler(cfg.optim, prepared.optimizer, steps), evaluator=evaluator,
        loss_config=loss_config(cfg.algo, cfg.rollout), modality_weights=parse_modality_weights(cfg.algo.modality_weights),
        prompts_per_step=prompts_per_step, total_steps=steps,
    )
