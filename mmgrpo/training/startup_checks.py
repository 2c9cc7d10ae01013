"""Every flag of `mmgrpo train` and `mmgrpo sft`, checked once before anything is built.

    check_train_flags(cfg)   # engine.train's first line
    check_sft_flags(cfg)     # sft.sft's first line

Each runs the config's own checks (`TrainConfig.validate`: each flag against the domain declared
beside it, then the rules between flags; mmgrpo/config/) and the checks that need a part, which
config/ cannot import: the names the parts' registries resolve (loss type, advantage estimator,
tools, fusion modules, the learning-rate schedule), vLLM installed, the launched world size against
--parallel, a --deepspeed JSON, and, when resuming, the checkpoint's flags. Each raises a ConfigError
that names the flag and says what to give instead.

>>> from mmgrpo.config import TrainConfig
>>> cfg = TrainConfig.from_args(["--model", "tiny:qwen2-vl", "--num_generations", "4", "--loss_type", "cispo"])
>>> check_train_flags(cfg)
>>> cfg.model.model_type, loss_config(cfg.algo, cfg.rollout).loss_type
('qwen2-vl', 'cispo')
"""

from __future__ import annotations

from mmgrpo.config import (
    AlgoConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)
from mmgrpo.config.domains import OneOf
from mmgrpo.errors import ConfigError
from mmgrpo.forward.routing_replay import router_problem
from mmgrpo.fusion.attach import check_fusion_flags
from mmgrpo.grpo import get_advantage
from mmgrpo.grpo.importance import IS_MODES
from mmgrpo.grpo.losses import LossConfig
from mmgrpo.models.loading import check_attention
from mmgrpo.models.tiny import built_model_family
from mmgrpo.parallel import validate_parallel
from mmgrpo.parallel.launch import bf16_by_default, env_world_size
from mmgrpo.tools import get_tool
from mmgrpo.training.optim import scheduler_kwargs
from mmgrpo.training.resume_flags import check_resume_flags


def check_train_flags(cfg: TrainConfig) -> None:
    """`mmgrpo train`'s flags: a resumed run's refused changes first, then the parts shared with SFT and
    the launch (--parallel, --deepspeed, the world size), then each flag's domain and the rules between
    flags, then the names and options the GRPO parts resolve. Fills --model_type from a tiny:/random:
    --model name first (`fill_model_type`)."""
    fill_model_type(cfg.model)
    fill_precision(cfg)
    check_resume_flags(cfg)  # resuming: a changed flag the run must keep is named first
    check_common_parts(cfg.model, cfg.optim)
    validate_parallel(cfg.dist, cfg.model, cfg.optim, cfg.rollout.num_generations)
    if cfg.dist.strategy == "zero3":
        from mmgrpo.parallel.zero3 import deepspeed_config

        deepspeed_config(cfg.dist, cfg.optim, env_world_size(), precision=cfg.precision)  # a contradicting JSON is an error now
    cfg.validate()
    get_advantage(cfg.algo.advantage_estimator)  # a ConfigError listing the registered ones
    problem = OneOf(*IS_MODES).problem("vllm_importance_sampling_mode", cfg.algo.vllm_importance_sampling_mode)
    if problem:
        raise ConfigError(problem)
    loss_config(cfg.algo, cfg.rollout)  # --loss_type, --importance_sampling_level, --delta: checked by the loss's own config
    if cfg.rollout.use_vllm:  # vLLM installed, flags that fit
        from mmgrpo.rollout.vllm_engine import validate_vllm

        validate_vllm(cfg.rollout, cfg.data.max_prompt_length)
    for spec in cfg.rollout.tools:  # a tool's typo fails now
        get_tool(spec)
    check_generic_boxes(cfg.model, cfg.algo, cfg.data, cfg.eval)
    check_routing_flags(cfg.model, cfg.algo, cfg.rollout)
    check_sequence_parallel(cfg)
    if cfg.save_in_background and env_world_size() > 1:
        raise ConfigError("--save_in_background is for one process: under torchrun every rank saves in the foreground; drop the flag.")


def check_sequence_parallel(cfg: TrainConfig) -> None:
    """--sequence_parallel_size N > 1: what the split forwards do not take yet, each named."""
    size = cfg.dist.sequence_parallel_size
    if size == 1:
        return
    refused = [(cfg.rollout.use_vllm, "--use_vllm (the group's rollout is generated in process and shared)"),
               (cfg.rollout.staleness_bound > 0, "--max_staleness (asynchronous rollouts)"),
               (cfg.algo.routing_replay == "rollout" or cfg.algo.router_aux_loss_coef > 0,
                "--routing_replay rollout / --router_aux_loss_coef (routes are recorded per whole row)"),
               (cfg.model.train_type == "fusion" or bool(cfg.model.fusion_module), "fusion modules (--fusion_module)")]
    for on, what in refused:
        if on:
            raise ConfigError(f"--sequence_parallel_size {size} does not run with {what} yet: drop one of them.")


def check_routing_flags(model_cfg: ModelConfig, algo_cfg: AlgoConfig, rollout_cfg: RolloutConfig) -> None:
    """--routing_replay and --router_aux_loss_coef need a mixture-of-experts model (read from its config,
    where it can be read before loading), and routing replay the HF rollout engine, which records routes."""
    flags = [name for name, on in (("--routing_replay rollout", algo_cfg.routing_replay == "rollout"),
                                   ("--router_aux_loss_coef", algo_cfg.router_aux_loss_coef > 0)) if on]
    if not flags:
        return
    text = moe_text_config(model_cfg.model)
    if text is not None and not routed_experts(text):
        raise ConfigError(f"{' and '.join(flags)}: {model_cfg.model} is a dense model (its config has no num_experts): "
                          "routes exist in mixture-of-experts models only (e.g. tiny:qwen3-vl-moe); drop the flag.")
    problem = router_problem(text) if text is not None else None
    if problem:
        raise ConfigError(f"{' and '.join(flags)}: {model_cfg.model}'s router is not supported by routing replay and its "
                          f"load-balancing loss yet ({problem}); drop the flag.")
    if algo_cfg.routing_replay == "rollout" and (rollout_cfg.use_vllm or rollout_cfg.max_turns > 1):
        what = "--use_vllm" if rollout_cfg.use_vllm else "--max_turns > 1"
        raise ConfigError(f"--routing_replay rollout records routes in the HF rollout engine; with {what} nothing records "
                          "them here: use --routing_replay off (the importance weights then correct the gap).")


def moe_text_config(model: str) -> dict | None:
    """The text model's part of `model`'s config.json (a random: name: its published numbers); None where the
    config cannot be read yet (a hub id not downloaded: loading says so)."""
    import json
    from pathlib import Path

    from mmgrpo.models.loading import local_model_folder
    from mmgrpo.models.real_configs import RANDOM_PREFIX, REAL_SIZES, parse_random_name
    from mmgrpo.models.tiny import resolve_model_path

    if model.startswith(RANDOM_PREFIX):  # its published numbers: nothing to build
        return dict(REAL_SIZES[parse_random_name(model)[0]].text)
    try:
        config = json.loads((Path(local_model_folder(resolve_model_path(model))) / "config.json").read_text())
    except (ConfigError, OSError, ValueError):
        return None
    return config.get("text_config") or config.get("thinker_config", {}).get("text_config") or config


def configured_experts(model: str) -> int | None:
    """Routed experts per MoE layer in `model`'s config (0: dense; GLM-4.5V names them n_routed_experts); None
    where the config cannot be read yet."""
    text = moe_text_config(model)
    return None if text is None else routed_experts(text)


def routed_experts(text_config: dict) -> int:
    """Routed experts per MoE layer in a text config (0: dense), under the names the families give them."""
    return int(text_config.get("num_experts") or text_config.get("num_local_experts")
               or text_config.get("n_routed_experts") or 0)


def check_sft_flags(cfg: SFTConfig) -> None:
    """`mmgrpo sft`'s flags: the parts shared with GRPO, each flag's domain and the rules between flags,
    and one process. Fills --model_type from a tiny:/random: --model name first."""
    fill_model_type(cfg.model)
    fill_precision(cfg)
    check_common_parts(cfg.model, cfg.optim)
    cfg.validate()
    if env_world_size() > 1:
        raise ConfigError("mmgrpo sft runs in one process: launch it without torchrun.")


def check_common_parts(model_cfg: ModelConfig, optim_cfg: OptimConfig) -> None:
    """What GRPO and SFT resolve alike: the schedule's name and options (a typo fails before any model
    loads) and the fusion flags (plugins, module name, layers)."""
    scheduler_kwargs(optim_cfg)
    check_fusion_flags(model_cfg)
    check_attention(model_cfg.attn_implementation)


def fill_precision(cfg: TrainConfig | SFTConfig) -> None:
    """--torch_dtype, --bf16 and --fp16 become one precision, recorded as --bf16 / --fp16 (config.yaml and
    the checkpoints' flags say what the run used): --torch_dtype names one of them; --bf16 left unset becomes
    what this machine has (`bf16_by_default`: a GPU with bfloat16). Contradictions and --bf16 on a GPU
    without bfloat16 are errors."""
    import torch

    if cfg.bf16 and cfg.fp16:
        raise ConfigError("--bf16 and --fp16 together: choose one (bfloat16 where the GPU has it, float16 on older GPUs).")
    named = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(cfg.torch_dtype or "auto")
    if named is not None:
        if (cfg.bf16 is not None and cfg.bf16 != (named == "bf16")) or (cfg.fp16 and named != "fp16"):
            given = "--bf16 " + str(cfg.bf16).lower() if cfg.bf16 is not None else "--fp16"
            raise ConfigError(f"--torch_dtype {cfg.torch_dtype} and {given} disagree: give one of them.")
        cfg.bf16, cfg.fp16 = named == "bf16", named == "fp16"
    if cfg.bf16 is None:
        cfg.bf16 = not cfg.fp16 and bf16_by_default()  # the start-up summary's device line says which (build_run)
    elif cfg.bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"--bf16: {torch.cuda.get_device_name()} has no bfloat16; use --fp16 (float16 with loss scaling) "
                          "or leave --bf16 out to train in float32.")


def fill_model_type(model_cfg: ModelConfig) -> None:
    """--model_type, when not given, from a `tiny:` or `random:` --model name, which says its family.
    Loading infers it anyway (mmgrpo/models/loading.py); filled here so that config.yaml and every
    checkpoint's flags name the family, which a resumed run compares (runs have always recorded it)."""
    if model_cfg.model_type is None:
        model_cfg.model_type = built_model_family(model_cfg.model)


def check_generic_boxes(model_cfg: ModelConfig, algo_cfg: AlgoConfig, data_cfg: DataConfig, eval_cfg: EvalConfig) -> None:
    """--model_type auto (the generic path, mmgrpo/templates/generic.py) has no box convention: a
    reward that reads boxes (one taking `to_image_box`: --reward_funcs, or a --dataset's own rewards)
    or a box metric (--eval_metrics) is a ConfigError naming the flag. A checkpoint that infers the
    generic path gets the same refusal at its first box (`GenericTemplate.box_to_image`)."""
    import inspect

    from mmgrpo.data.catalog import load_registry, parse_spec
    from mmgrpo.eval.metrics import get_metric
    from mmgrpo.rewards import get_reward
    from mmgrpo.rewards.reward_set import scoped_entries
    from mmgrpo.templates.base import TEMPLATES
    from mmgrpo.templates.generic import GenericTemplate

    model_type = model_cfg.model_type
    if model_type is None or model_type not in TEMPLATES or TEMPLATES.get(model_type) is not GenericTemplate:
        return
    datasets = [parse_spec(spec)[0] for spec in data_cfg.dataset]
    if algo_cfg.reward_funcs:
        rewards = [("--reward_funcs", name) for _, name in scoped_entries(list(algo_cfg.reward_funcs), datasets)]
    else:
        registry = load_registry(data_cfg.dataset_registry)
        rewards = [(f"--dataset {name} (its reward_funcs)", reward)
                   for name in datasets if name in registry for reward in registry[name].reward_funcs]
    fix = ("the generic path (--model_type auto) has no box convention, so boxes in the model's text cannot be mapped "
           "to image pixels; write a template file for the family that declares one (docs/custom_template.md) and "
           "pass it with --template_plugin")
    for flag, name in rewards:
        if "to_image_box" in inspect.signature(get_reward(name)).parameters:
            raise ConfigError(f"{flag}: the reward {name!r} scores boxes, and {fix}.")
    for name in eval_cfg.eval_metrics:
        if get_metric(name).needs_box:
            raise ConfigError(f"--eval_metrics: the metric {name!r} scores boxes, and {fix}.")


def loss_config(algo_cfg: AlgoConfig, rollout_cfg: RolloutConfig) -> LossConfig:
    """The policy loss's options (`LossConfig`, which checks them when made) from --loss_type, --epsilon,
    --epsilon_high, --beta, --importance_sampling_level, --delta and --max_completion_length."""
    return LossConfig(
        loss_type=algo_cfg.loss_type, epsilon=algo_cfg.epsilon, epsilon_high=algo_cfg.epsilon_high,
        beta=algo_cfg.beta, max_completion_length=rollout_cfg.max_completion_length,
        importance_sampling_level=algo_cfg.importance_sampling_level, delta=algo_cfg.delta,
    )
