"""The checks of `TrainConfig.validate` and `SFTConfig.validate` (mmgrpo/config/schema.py), and the parsers of
flags whose values have a syntax of their own (`--stop_at`, `--modality_weights`).

Every check runs before any model loads and raises a ConfigError that names the flag and says what
to give instead. The config classes come in as arguments; this module does not import mmgrpo.config
(which calls it), so the two do not import each other.
"""

from __future__ import annotations

import math
import re
import warnings

from mmgrpo.errors import ConfigError


def validate_common(cfg) -> None:
    """Checks every training command shares (GRPO and SFT): model, optimizer, steps."""
    from mmgrpo.training.optim import scheduler_kwargs

    scheduler_kwargs(cfg.optim)  # the schedule's name and options: a typo fails before any model loads
    from mmgrpo.runstate.trackers import report_targets

    report_targets(cfg.report_to)  # an unknown tracker fails before any model loads
    choices = {
        "optim": (cfg.optim.optim, ("adamw_torch_fused", "adamw_torch")),
    }
    check_choices(choices)
    from mmgrpo.fusion.attach import check_fusion_flags

    check_fusion_flags(cfg)  # --fusion_module, --fusion_layers, --train_type fusion, --vit_lr ...
    if cfg.max_steps == 0 or (cfg.max_steps < 0 and cfg.num_train_epochs <= 0):
        raise ConfigError("--max_steps must be positive (or -1 with --num_train_epochs > 0).")


def parse_stop_at(spec: str) -> tuple[str, str, float]:
    """`METRIC>=VALUE` or `METRIC<=VALUE` -> (metric, comparison, value); a ConfigError otherwise.

    >>> parse_stop_at("shapes-color/vqa_accuracy>=0.5")
    ('shapes-color/vqa_accuracy', '>=', 0.5)
    """
    match = re.fullmatch(r"\s*([^<>=\s]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*", spec)
    value = None
    if match:
        try:
            value = float(match.group(3))
        except ValueError:
            pass
    if value is None or not math.isfinite(value):
        raise ConfigError(
            f"--stop_at {spec!r}: write METRIC>=VALUE or METRIC<=VALUE, e.g. --stop_at 'shapes-color/vqa_accuracy>=0.5'."
        )
    return match.group(1), match.group(2), value


SFT_LOSS_NORMALIZATIONS = ("token", "sample")


def validate_sft(cfg) -> None:
    """SFT's checks (`SFTConfig.validate`)."""
    from mmgrpo.parallel.launch import env_world_size

    validate_common(cfg)
    validate_eval(cfg.eval)
    if cfg.stop_at is not None:
        parse_stop_at(cfg.stop_at)
        if not cfg.eval.eval_dataset or cfg.eval.eval_steps < 1:
            raise ConfigError(f"--stop_at {cfg.stop_at!r} needs --eval_dataset NAME and --eval_steps N (how often to check).")
    if cfg.max_completion_length < 1:
        raise ConfigError("--max_completion_length must be >= 1.")
    check_choices({"loss_normalization": (cfg.loss_normalization, SFT_LOSS_NORMALIZATIONS)})
    if env_world_size() > 1:
        raise ConfigError("mmgrpo sft runs in one process: launch it without torchrun.")
    if cfg.eval.fusion_probe_steps:
        raise ConfigError("--fusion_probe_steps measures GRPO steps' completions; SFT has none. Use `mmgrpo eval --fusion_probe`.")
    if cfg.resume_from_checkpoint:  # its loop saves weights only (mmgrpo/sft.py)
        raise ConfigError("--resume_from_checkpoint: mmgrpo sft does not resume; start it again with --model CHECKPOINT.")


def check_choices(choices: dict[str, tuple[str, tuple[str, ...]]]) -> None:
    for flag, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"--{flag} {value!r}: choose one of {', '.join(allowed)}.")


def validate_train(cfg) -> None:
    """GRPO's checks (`TrainConfig.validate`). Every name a registry resolves (loss type, advantage
    estimator) is looked up now, so a plugin's registered name works and a typo fails at start-up."""
    from mmgrpo.grpo import get_advantage
    from mmgrpo.grpo.importance import IS_MODES
    from mmgrpo.parallel import validate_parallel
    from mmgrpo.training.resume_flags import check_resume_flags

    check_resume_flags(cfg)  # resuming: a changed flag the run must keep is named first (mmgrpo/training/resume_flags.py)
    validate_common(cfg)
    validate_parallel(cfg)  # --parallel, --deepspeed JSON, world size, LoRA options
    g = cfg.rollout.num_generations
    batch = cfg.optim.per_device_train_batch_size * cfg.optim.gradient_accumulation_steps
    if g < 2:
        raise ConfigError(f"--num_generations {g}: GRPO needs at least 2 completions per prompt to compare.")
    if batch % g:
        raise ConfigError(
            f"--per_device_train_batch_size {cfg.optim.per_device_train_batch_size} x --gradient_accumulation_steps "
            f"{cfg.optim.gradient_accumulation_steps} = {batch} completions per step is not divisible by "
            f"--num_generations {g}: each prompt's {g} completions must stay in one step."
        )
    check_choices({
        "scale_rewards": (cfg.algo.scale_rewards, ("group", "batch", "none")),
        "reward_errors": (cfg.algo.reward_errors, ("raise", "none")),
        "missing_solution": (cfg.algo.missing_solution, ("error", "skip")),
        "vllm_importance_sampling_mode": (cfg.algo.vllm_importance_sampling_mode, IS_MODES),
        "vllm_mode": (cfg.rollout.vllm_mode, ("colocate", "server")),
        "dynamic_weights_by": (cfg.algo.dynamic_weights_by, ("modality", "dataset")),
        "save_strategy": (cfg.save_strategy, ("steps", "no")),
    })
    if cfg.save_strategy == "no" and cfg.save_steps:
        raise ConfigError(f"--save_steps {cfg.save_steps} with --save_strategy no: no checkpoint would be saved; drop one of them.")
    if not cfg.algo.vllm_importance_sampling_cap > 0:
        raise ConfigError(f"--vllm_importance_sampling_cap {cfg.algo.vllm_importance_sampling_cap}: give a ratio > 0.")
    get_advantage(cfg.algo.advantage_estimator)  # a ConfigError listing the registered ones
    if cfg.algo.judge_parse not in ("score", "verdict"):
        raise ConfigError(f"--judge_parse {cfg.algo.judge_parse!r}: choose one of score, verdict.")
    cfg.loss_config()  # --loss_type, --importance_sampling_level, --delta: checked by the loss's own config
    if cfg.algo.loss_type == "dr_grpo" and cfg.algo.scale_rewards != "none":
        # Dr. GRPO removes both biases: the length one (the loss) and the difficulty one (the std).
        # Kept as asked, since scaling may be wanted on purpose; said at start-up.
        warnings.warn(
            f"--loss_type dr_grpo with --scale_rewards {cfg.algo.scale_rewards}: Dr. GRPO also drops the std scaling "
            "of advantages; add --scale_rewards none for the algorithm of the paper (docs/algorithm.md).", stacklevel=2,
        )
    if cfg.algo.beta < 0 or cfg.algo.epsilon <= 0:
        raise ConfigError("--beta must be >= 0 and --epsilon > 0.")
    if not (math.isfinite(cfg.algo.entropy_coeff) and cfg.algo.entropy_coeff >= 0):
        raise ConfigError(f"--entropy_coeff {cfg.algo.entropy_coeff}: give a bonus >= 0 (e.g. 0.001); 0 turns it off.")
    if cfg.algo.num_iterations < 1:
        raise ConfigError("--num_iterations must be at least 1.")
    parse_modality_weights(cfg.algo.modality_weights)  # a typo is an error now, not a silent weight of 1
    if cfg.algo.max_tokens_per_microbatch < 0:
        raise ConfigError("--max_tokens_per_microbatch must be >= 0 (0: fixed micro-batches).")
    if cfg.algo.max_tokens_per_microbatch and cfg.dist.strategy != "none":
        raise ConfigError(
            "--max_tokens_per_microbatch is single-process for now: under torchrun each rank would pack its rows "
            "into a different number of forwards, and sharded forwards must match across ranks. Drop it, or use "
            "--per_device_train_batch_size."
        )
    if cfg.eval.fusion_probe_steps < 0 or cfg.eval.fusion_probe_rows < 1:
        raise ConfigError("--fusion_probe_steps must be >= 0 (0: off) and --fusion_probe_rows >= 1.")
    if cfg.rollout.use_vllm and cfg.model.fusion_module:
        raise ConfigError(
            f"--fusion_module {cfg.model.fusion_module} with --use_vllm: vLLM runs the model's stock architecture, "
            "without fusion modules. Drop --use_vllm (the in-process engines run the modules) or --fusion_module."
        )
    if cfg.rollout.max_turns > 1 and cfg.model.fusion_module:
        raise ConfigError(
            f"--fusion_module with --max_turns {cfg.rollout.max_turns}: the modules read the prompt's media, and a tool's "
            "images arrive inside the completion; drop one of them (docs/fusion.md)."
        )
    if cfg.rollout.use_vllm:  # before any model loads: vLLM installed, flags that fit
        from mmgrpo.rollout.vllm_engine import validate_vllm

        validate_vllm(cfg)
    if cfg.rollout.max_staleness is not None and cfg.rollout.max_staleness < 1:
        raise ConfigError(
            f"--max_staleness {cfg.rollout.max_staleness}: give K >= 1, the most optimizer steps a rollout's weights may "
            "lag behind the policy it trains (1: one step off-policy, as --async_generate); leave it out to train synchronously."
        )
    if cfg.rollout.max_resample_times < 0:
        raise ConfigError("--max_resample_times must be >= 0.")
    if not 0 <= cfg.rollout.first_stage_generations < cfg.rollout.num_generations:
        raise ConfigError(
            f"--first_stage_generations {cfg.rollout.first_stage_generations}: give 0 (off) or a K from 1 to "
            f"--num_generations - 1 ({cfg.rollout.num_generations - 1})."
        )
    if cfg.rollout.temperature <= 0:
        raise ConfigError("--temperature must be > 0 (log-probs are divided by it).")
    validate_sampling(cfg.rollout.top_p, cfg.rollout.top_k)
    validate_tools(cfg)
    validate_eval(cfg.eval)
    validate_run_limits(cfg)
    from mmgrpo.runstate.preemption import signal_numbers

    signal_numbers(cfg.save_on_signal)  # a signal name that does not exist fails now


def validate_sampling(top_p, top_k) -> None:
    """--top_p in (0, 1] and --top_k a count >= 0: a value outside would be clamped or ignored
    differently by each rollout engine, so a typo would silently change what is sampled."""
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ConfigError(f"--top_p {top_p}: give a probability in (0, 1] (1: no nucleus filter).")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ConfigError(f"--top_k {top_k}: give a number of tokens >= 0 (0: no top-k filter).")


def validate_eval(options) -> None:
    """The in-training evaluation's flags (GRPO and SFT)."""
    if not options.eval_dataset and (options.eval_steps or options.eval_limit or options.metric_for_best_model):
        raise ConfigError("--eval_steps, --eval_limit and --metric_for_best_model need --eval_dataset NAME[:split].")
    if options.eval_steps < 0 or (options.eval_limit is not None and options.eval_limit < 1):
        raise ConfigError("--eval_steps must be >= 0 and --eval_limit >= 1.")


def validate_run_limits(cfg) -> None:
    """A TrainConfig's numbers that cannot work (a zero batch, a NaN learning rate ...), each an error naming its flag."""
    positive = {
        "max_completion_length": cfg.rollout.max_completion_length,
        "per_device_train_batch_size": cfg.optim.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.optim.gradient_accumulation_steps,
        "max_nonfinite_steps": cfg.max_nonfinite_steps,
    }
    for flag, value in positive.items():
        if value is None or value < 1:
            raise ConfigError(f"--{flag} {value}: must be at least 1.")
    rate = cfg.optim.learning_rate
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ConfigError(f"--learning_rate {rate}: must be a finite number > 0 (e.g. 1e-6).")
    low, high = cfg.model.min_pixels, cfg.model.max_pixels
    for flag, value in (("min_pixels", low), ("max_pixels", high)):
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} {value}: must be a positive number of pixels.")
    if low is not None and high is not None and low > high:
        raise ConfigError(f"--min_pixels {low} is above --max_pixels {high}: no image size satisfies both.")
    timeout = cfg.algo.reward_timeout
    if timeout is None or not math.isfinite(timeout) or timeout < 0:
        raise ConfigError(f"--reward_timeout {timeout}: give seconds >= 0 (0: no limit).")
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        raise ConfigError(f"--save_total_limit {cfg.save_total_limit}: keep at least 1 checkpoint (or leave it unset to keep all).")
    if cfg.resume_from_checkpoint and cfg.overwrite_output_dir:
        raise ConfigError("--resume_from_checkpoint continues the run in --output_dir and --overwrite_output_dir deletes it: pass one of them.")
    from mmgrpo.parallel.launch import env_world_size

    if cfg.save_in_background and env_world_size() > 1:
        raise ConfigError("--save_in_background is for one process: under torchrun every rank saves in the foreground; drop the flag.")


def validate_tools(cfg) -> None:
    """A TrainConfig's --max_turns, --tools and --tool_timeout agree, and every tool resolves (a typo fails now)."""
    from mmgrpo.tools import get_tool

    rollout = cfg.rollout
    if rollout.max_turns < 1:
        raise ConfigError(f"--max_turns {rollout.max_turns}: give 1 (single turn) or more.")
    if rollout.max_turns > 1 and not rollout.tools:
        raise ConfigError(f"--max_turns {rollout.max_turns} needs --tools (e.g. --tools image_zoom_in_tool): "
                          "without tools nothing answers a turn.")
    if rollout.tools and rollout.max_turns < 2:
        raise ConfigError("--tools needs --max_turns 2 or more: the turn that calls a tool would end the episode.")
    if not rollout.tool_timeout > 0:
        raise ConfigError(f"--tool_timeout {rollout.tool_timeout}: give a number of seconds > 0.")
    if rollout.max_turns > 1 and cfg.dist.strategy != "none":
        raise ConfigError("--max_turns > 1 runs in one process for now: drop --parallel / --deepspeed (docs/tools.md).")
    for spec in rollout.tools:
        get_tool(spec)


MODALITIES = ("text", "image", "video", "audio", "mixed")  # `Sample.modality` values


def parse_modality_weights(specs: list[str]) -> dict[str, float]:
    """`--modality_weights` as {modality: weight}; a bad name or number is a ConfigError.

    >>> parse_modality_weights(["image=1.0", "video=0.5"])
    {'image': 1.0, 'video': 0.5}
    """
    if isinstance(specs, dict):  # a YAML config may give {image: 1.0, video: 0.5}
        specs = [f"{name}={value}" for name, value in specs.items()]
    weights = {}
    for spec in specs or []:
        name, sep, value = str(spec).partition("=")
        name = name.strip()
        if not sep or name not in MODALITIES:
            raise ConfigError(
                f"--modality_weights {spec!r}: give NAME=WEIGHT with NAME one of {', '.join(MODALITIES)}, e.g. video=0.5."
            )
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not weight >= 0 or weight == float("inf"):
            raise ConfigError(f"--modality_weights {spec!r}: the weight must be a finite number >= 0.")
        if name in weights:
            raise ConfigError(f"--modality_weights names {name!r} twice.")
        weights[name] = weight
    return weights
