"""The rules between flags of `TrainConfig.validate` and `SFTConfig.validate` (mmgrpo/config/schema.py),
and the parsers of flags whose values have a syntax of their own (`--stop_at`, `--modality_weights`).

Each flag's own domain (a number's range, a name from a fixed list) is declared beside it and checked
by `check_domains` first; what is here relates two or more flags. The checks that need a part (a
registered loss, vLLM installed, the world size) are mmgrpo/training/startup_checks.py's. Every check
raises a ConfigError that names the flag and says what to give instead. The config classes come in
as arguments; this module does not import mmgrpo.config's schema (which calls it).
"""

from __future__ import annotations

import math
import re
import warnings

from mmgrpo.config.domains import above
from mmgrpo.errors import ConfigError

GRPO_LEARNING_RATE = above(0, hint="e.g. 1e-6")  # SFT may measure at rate 0 (tests/test_sft.py); a GRPO run must move


def validate_common(cfg) -> None:
    """The rules every training command shares (GRPO and SFT): steps, trackers, part rates, evaluation."""
    from mmgrpo.runstate.trackers import report_targets

    report_targets(cfg.report_to)  # an unknown tracker fails before any model loads
    if cfg.max_steps == 0 or (cfg.max_steps < 0 and cfg.num_train_epochs <= 0):
        raise ConfigError("--max_steps must be positive (or -1 with --num_train_epochs > 0).")
    if not str(cfg.output_dir).strip():
        raise ConfigError("--output_dir '': give a folder (an empty name would write into the current one).")
    model, optim = cfg.model, cfg.optim
    if model.fusion_layers and model.fusion_module is None:
        raise ConfigError("--fusion_layers needs --fusion_module (gated_xattn, coattn or a registered one).")
    if optim.vit_lr is not None and model.freeze_vit:
        raise ConfigError("--vit_lr with --freeze_vit: the frozen tower has no rate; drop one of them.")
    if optim.aligner_lr is not None and model.freeze_aligner:
        raise ConfigError("--aligner_lr with --freeze_aligner: the frozen aligner has no rate; drop one of them.")
    low, high = model.min_pixels, model.max_pixels
    if low is not None and high is not None and low > high:
        raise ConfigError(f"--min_pixels {low} is above --max_pixels {high}: no image size satisfies both.")
    validate_eval(cfg.eval)


def validate_eval(options) -> None:
    """The in-training evaluation's flags (GRPO and SFT)."""
    if not options.eval_dataset and (options.eval_steps or options.eval_limit or options.metric_for_best_model):
        raise ConfigError("--eval_steps, --eval_limit and --metric_for_best_model need --eval_dataset NAME[:split].")


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


def validate_sft(cfg) -> None:
    """SFT's rules between flags (`SFTConfig.validate`)."""
    validate_common(cfg)
    if cfg.stop_at is not None:
        parse_stop_at(cfg.stop_at)
        if not cfg.eval.eval_dataset or cfg.eval.eval_steps < 1:
            raise ConfigError(f"--stop_at {cfg.stop_at!r} needs --eval_dataset NAME and --eval_steps N (how often to check).")
    if cfg.eval.fusion_probe_steps:
        raise ConfigError("--fusion_probe_steps measures GRPO steps' completions; SFT has none. Use `mmgrpo eval --fusion_probe`.")
    if cfg.resume_from_checkpoint:  # its loop saves weights only (mmgrpo/sft.py)
        raise ConfigError("--resume_from_checkpoint: mmgrpo sft does not resume; start it again with --model CHECKPOINT.")


def validate_train(cfg) -> None:
    """GRPO's rules between flags (`TrainConfig.validate`)."""
    from mmgrpo.runstate.preemption import signal_numbers

    validate_common(cfg)
    g, optim, rollout = cfg.rollout.num_generations, cfg.optim, cfg.rollout
    batch = optim.per_device_train_batch_size * optim.gradient_accumulation_steps
    if batch % g:
        raise ConfigError(
            f"--per_device_train_batch_size {optim.per_device_train_batch_size} x --gradient_accumulation_steps "
            f"{optim.gradient_accumulation_steps} = {batch} completions per step is not divisible by "
            f"--num_generations {g}: each prompt's {g} completions must stay in one step."
        )
    rate_problem = GRPO_LEARNING_RATE.problem("learning_rate", optim.learning_rate)
    if rate_problem:
        raise ConfigError(rate_problem)
    if not 0 <= rollout.first_stage_generations < g:
        raise ConfigError(f"--first_stage_generations {rollout.first_stage_generations}: give 0 (off) or a K from 1 to "
                          f"--num_generations - 1 ({g - 1}).")
    if cfg.save_strategy == "no" and cfg.save_steps:
        raise ConfigError(f"--save_steps {cfg.save_steps} with --save_strategy no: no checkpoint would be saved; drop one of them.")
    if cfg.resume_from_checkpoint and cfg.overwrite_output_dir:
        raise ConfigError("--resume_from_checkpoint continues the run in --output_dir and --overwrite_output_dir deletes it: pass one of them.")
    if cfg.algo.loss_type == "dr_grpo" and cfg.algo.scale_rewards != "none":
        # Dr. GRPO removes both biases: the length one (the loss) and the difficulty one (the std).
        # Kept as asked, since scaling may be wanted on purpose; said at start-up.
        warnings.warn(
            f"--loss_type dr_grpo with --scale_rewards {cfg.algo.scale_rewards}: Dr. GRPO also drops the std scaling "
            "of advantages; add --scale_rewards none for the algorithm of the paper (docs/algorithm.md).", stacklevel=2,
        )
    if rollout.mask_truncated_completions and rollout.suppress_eos:
        warnings.warn("--mask_truncated_completions with --suppress_eos: no completion can end, so every one is "
                      "truncated and masked: the run trains on nothing. Drop one of the two.", stacklevel=2)
    floor, cap = cfg.algo.vllm_importance_sampling_floor, cfg.algo.vllm_importance_sampling_cap
    if floor is not None and floor > cap:
        raise ConfigError(f"--vllm_importance_sampling_floor {floor} is above --vllm_importance_sampling_cap {cap}: "
                          "the band [floor, cap] would be empty; give a floor below the cap.")
    parse_modality_weights(cfg.algo.modality_weights)  # a typo is an error now, not a silent weight of 1
    validate_partial_rollouts(rollout)
    if cfg.algo.teacher_server_port is not None and not cfg.algo.teacher_model:
        raise ConfigError(f"--teacher_server_port {cfg.algo.teacher_server_port} needs --teacher_model: the model that "
                          "server serves (the trainer checks the server serves it); add it or drop --teacher_server_port.")
    if cfg.algo.teacher_server_port is not None and rollout.temperature != 1.0:
        raise ConfigError(f"--teacher_server_port with --temperature {rollout.temperature}: the server scores with vLLM's "
                          "prompt log-probs, which are of the raw logits (temperature 1), where the trainer divides "
                          "the teacher's logits by --temperature; use --temperature 1, or drop --teacher_server_port "
                          "(the teacher in the trainer).")
    one_process = cfg.dist.strategy == "none"
    if cfg.algo.max_tokens_per_microbatch and not one_process:
        raise ConfigError(
            "--max_tokens_per_microbatch is single-process for now: under torchrun each rank would pack its rows "
            "into a different number of forwards, and sharded forwards must match across ranks. Drop it, or use "
            "--per_device_train_batch_size."
        )
    if rollout.max_turns > 1 and not rollout.tools:
        raise ConfigError(f"--max_turns {rollout.max_turns} needs --tools (e.g. --tools image_zoom_in_tool): "
                          "without tools nothing answers a turn.")
    if rollout.tools and rollout.max_turns < 2:
        raise ConfigError("--tools needs --max_turns 2 or more: the turn that calls a tool would end the episode.")
    if rollout.max_turns > 1 and not one_process:
        raise ConfigError("--max_turns > 1 runs in one process for now: drop --parallel / --deepspeed (docs/tools.md).")
    fusion = cfg.model.fusion_module
    if rollout.use_vllm and fusion:
        raise ConfigError(f"--fusion_module {fusion} with --use_vllm: vLLM runs the model's stock architecture, without "
                          "fusion modules. Drop --use_vllm (the in-process engines run the modules) or --fusion_module.")
    if rollout.max_turns > 1 and fusion:
        raise ConfigError(f"--fusion_module with --max_turns {rollout.max_turns}: the modules read the prompt's media, and "
                          "a tool's images arrive inside the completion; drop one of them (docs/fusion.md).")
    signal_numbers(cfg.save_on_signal)  # a signal name that does not exist fails now


MODALITIES = ("text", "image", "video", "audio", "mixed")  # `Sample.modality` values


def validate_partial_rollouts(rollout) -> None:
    """--partial_rollouts: K >= 2 (a rollout spans K versions; with K = 1 it spans one) and an engine that can pause."""
    if rollout.partial_rollout_tokens is not None and not rollout.partial_rollouts:
        raise ConfigError(f"--partial_rollout_tokens {rollout.partial_rollout_tokens} needs --partial_rollouts; add it or drop "
                          "--partial_rollout_tokens.")
    if not rollout.partial_rollouts:
        return
    k = rollout.staleness_bound
    if k == 0:
        raise ConfigError("--partial_rollouts needs asynchronous training: add --max_staleness 2 (or more); a rollout then "
                          "pauses at each weight update and continues on the new weights.")
    if k == 1:
        raise ConfigError("--partial_rollouts with --max_staleness 1 (or --async_generate): each rollout is generated while "
                          "one step trains, on one weight version, so there is nothing to continue; use --max_staleness 2 "
                          "or more, or drop --partial_rollouts.")
    if rollout.max_turns > 1:
        raise ConfigError(f"--partial_rollouts with --max_turns {rollout.max_turns}: multi-turn episodes cannot pause (yet); "
                          "drop one of them.")


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
