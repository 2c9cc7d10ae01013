"""What a resumed run may change. Every checkpoint records the flags of the run that wrote it
(`TrainState.flags`, the resolved TrainConfig); a resumed run compares its own flags with them, and
each flag that differs is either refused or allowed on purpose, never taken silently.

    check_resume_flags(cfg)                   # first of check_train_flags: ConfigError naming every refused change
    changes = flag_changes(state.flags, cfg)  # {flag: (old, new)}; allowed_lines(changes) says each in one line
    retarget_schedule(optimizer, scheduler, old_rates, new_rates)   # the schedule rule below

Each flag's kind is declared beside it in mmgrpo/config/schema.py (`flag(..., resume="schedule")`;
refused unless said otherwise), and read here:

| kind | flags | on resume |
|---|---|---|
| refused | what the run computes or the order it reads data in: `--model`, `--dataset`, `--seed`, `--num_generations`, the batch, the rewards, the loss, sampling, the optimizer's other options, LoRA and freezing, the evaluation the best checkpoint is judged by ... (`REFUSED`) | a ConfigError naming each flag with its old and new value, before any model loads |
| the schedule | `--max_steps`, `--num_train_epochs`, `--learning_rate`, `--lr_scheduler_type`, `--lr_scheduler_kwargs`, `--warmup_ratio`, `--warmup_steps`, `--vit_lr`, `--aligner_lr`, `--fusion_lr` (`SCHEDULE`) | allowed: from the resumed step on, each parameter group's learning rate is the one the new flags' schedule gives at that step (as if the run had started with them); the steps already trained keep theirs. `--max_steps` must stay above the checkpoint's step; a per-component rate given or dropped is refused (the optimizer's groups would differ) |
| staleness | `--max_staleness`, `--async_generate` (`STALENESS`) | allowed: from the resumed step a rollout lags at most the new K steps; rollouts the checkpoint saved in flight that would be staler are dropped and generated again (`rollout/dropped_stale`). Synchronous (K = 0) from a checkpoint with rollouts in flight is refused |
| how, not what | saving, logging, trackers, workers, threads, timeouts, memory and speed options (`OPERATIONAL`) | allowed, one line each |
| where | `--output_dir`, `--resume_from_checkpoint`, `--overwrite_output_dir`, `--config` | not compared |

Every allowed change is kept, with its step, in `TrainState.resumed` and config.yaml's `resumed:` list.

>>> old = {"seed": 0, "max_steps": 12, "optim": {"learning_rate": 0.001}}
>>> flag_changes(old, {"seed": 0, "max_steps": 24, "optim": {"learning_rate": 0.0005}})
{'max_steps': (12, 24), 'learning_rate': (0.001, 0.0005)}
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from mmgrpo.config import TrainConfig
from mmgrpo.config.domains import resume_kinds
from mmgrpo.errors import ConfigError


def flags_of_kind(kind: str) -> tuple[str, ...]:
    """The flags of `mmgrpo train` whose declared resume kind is `kind`."""
    return tuple(name for name, declared in resume_kinds(TrainConfig).items() if declared == kind)


REFUSED, SCHEDULE, STALENESS, OPERATIONAL, NOT_COMPARED = (
    flags_of_kind(kind) for kind in ("refused", "schedule", "staleness", "operational", "not_compared"))
GROUP_RATES = ("vit_lr", "aligner_lr", "fusion_lr")  # the schedule's, each its parameter group's peak


def leaves(flags: dict) -> dict:
    """{flag name: value} of a nested TrainConfig dict (every flag name is unique across sections)."""
    out = {}
    for key, value in flags.items():
        if isinstance(value, dict) and key in ("model", "data", "rollout", "algo", "optim", "eval", "dist"):
            out.update(leaves(value))
        else:
            out[key] = value
    return out


def _plain(value):
    """A value as it reads back from training_state.json (tuples are lists)."""
    return json.loads(json.dumps(value, default=str))


def flag_changes(saved: dict, now: dict) -> dict[str, tuple]:
    """{flag: (checkpoint's value, this run's)} for every compared flag both know and that differs."""
    old, new = leaves(saved), leaves(now)
    return {name: (old[name], _plain(new[name])) for name in new
            if name in old and name not in NOT_COMPARED and _plain(new[name]) != old[name]}


def show(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def refused_message(changes: dict[str, tuple], checkpoint) -> str | None:
    """One line naming every refused change (None when there is none)."""
    refused = [f"--{name} {show(old)} -> {show(new)}" for name, (old, new) in changes.items()
               if name not in SCHEDULE and name not in OPERATIONAL and name not in STALENESS]
    if not refused:
        return None
    return (f"--resume_from_checkpoint {checkpoint}: {'; '.join(refused)}: a resumed run keeps the flags that decide what it "
            "computes and the order it reads data in (docs/training.md lists those that may change); resume with the "
            "checkpoint's values, or start a new run in another --output_dir")


def allowed_lines(changes: dict[str, tuple], step: int, staleness: int = 0) -> list[str]:
    """One line per allowed change, saying what it does (`staleness`: the resumed run's K)."""
    lines = []
    for name, (old, new) in changes.items():
        if name in SCHEDULE:
            lines.append(f"resume: --{name} {show(old)} -> {show(new)}: from step {step + 1} the learning rate follows the "
                         "schedule of the new flags")
        elif name in STALENESS:
            lines.append(f"resume: --{name} {show(old)} -> {show(new)}: from step {step + 1} a rollout lags at most "
                         f"{staleness} steps; those saved in flight that would lag more are generated again")
        elif name in OPERATIONAL:
            lines.append(f"resume: --{name} {show(old)} -> {show(new)} (how the run works, not what it computes)")
    return lines


def check_resume_flags(cfg) -> None:
    """A resumed run's flags against its checkpoint's, read only, before anything is built: a
    ConfigError naming every refused change. The checkpoint not found or unreadable is left to
    preflight (mmgrpo/training/output_dir.py), which names it; a checkpoint that records no flags
    (an earlier mmgrpo) is not compared."""
    from mmgrpo.parallel.launch import env_rank
    from mmgrpo.runstate.checkpoint import checkpoint_problem, list_checkpoints
    from mmgrpo.runstate.run_lock import in_use_error, live_holder
    from mmgrpo.runstate.state import STATE_FILE

    resume = cfg.resume_from_checkpoint
    if not resume:
        return
    holder = live_holder(cfg.output_dir)
    if holder is not None:  # a live run there is what a second run hears about, whatever its flags
        if env_rank() == 0:
            raise in_use_error(cfg.output_dir, holder)
        return  # another rank: the holder may be this job's rank 0, which decides
    if resume == "latest":
        found = list_checkpoints(Path(cfg.output_dir).expanduser(), warn=False)
        path = found[-1] if found else None
    else:
        path = Path(resume).expanduser()
    if path is None or checkpoint_problem(path) is not None:
        return
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return
    if state.get("flags"):
        check_changes(flag_changes(state["flags"], cfg.to_dict()), path, state.get("step", 0),
                      in_flight=int(state.get("rollout_in_flight") or 0), staleness=cfg.rollout.staleness_bound,
                      partial=cfg.rollout.partial_rollouts)


def check_changes(changes: dict[str, tuple], checkpoint, step: int, in_flight: int = 0, staleness: int = 0,
                  partial: bool = False) -> None:
    """ConfigError for refused changes, a --max_steps the checkpoint is already past, a per-component
    rate given or dropped, a synchronous run (`staleness` 0) from a checkpoint with `in_flight` rollouts,
    and --partial_rollouts (`partial`: this run's) given or dropped, or K changed under it."""
    if "partial_rollouts" in changes:
        old, new = changes["partial_rollouts"]
        raise ConfigError(f"--resume_from_checkpoint {checkpoint}: --partial_rollouts {'given' if new else 'dropped'}: the "
                          f"checkpoint's rollouts in flight were generated {'whole' if new else 'in chunks'}; resume "
                          f"{'without' if new else 'with'} --partial_rollouts, or start a new run in another --output_dir")
    moved = [name for name in ("max_staleness", "async_generate") if name in changes]
    if partial and in_flight and moved:
        old, new = changes[moved[0]]
        raise ConfigError(f"--resume_from_checkpoint {checkpoint}: --{moved[0]} {old} -> {new} with --partial_rollouts: the "
                          "rollouts saved in flight are paused part way through the chunks of the checkpoint's K; resume "
                          f"with --{moved[0]} {old}")
    message = refused_message(changes, checkpoint)
    if message:
        raise ConfigError(message)
    for name in GROUP_RATES:
        if name in changes and None in changes[name]:
            old, new = changes[name]
            raise ConfigError(f"--resume_from_checkpoint {checkpoint}: --{name} {old} -> {new}: the optimizer's parameter "
                              f"groups would differ from the checkpoint's; resume with --{name} {old} or another rate "
                              "(docs/training.md), or start a new run in another --output_dir")
    if in_flight and not staleness:
        raise ConfigError(f"--resume_from_checkpoint {checkpoint}: saved by asynchronous training with {in_flight} "
                          f"rollout(s) in flight; resume with --max_staleness {in_flight} (a smaller K >= 1 generates "
                          "those too stale again)")
    if "max_steps" in changes and 0 < changes["max_steps"][1] < step:
        raise ConfigError(f"--max_steps {changes['max_steps'][1]}: the checkpoint {checkpoint} is at step {step}, past it; "
                          f"give --max_steps above {step} (the run's own was {changes['max_steps'][0]})")


def retarget_schedule(optimizer, scheduler, old_rates: list[float], new_rates: list[float]) -> list[float]:
    """After a checkpoint's schedule state is loaded into this run's schedule (built from this run's
    flags: its total steps, warm-up, kind): each parameter group's peak rate goes from `old_rates[i]`
    to `new_rates[i]` (its base rate scaled by new / old) and the rate of the next step is what that
    schedule gives at the resumed step. Returns the new rates per group.

    >>> import torch
    >>> from mmgrpo.config import OptimConfig
    >>> from mmgrpo.training.optim import make_scheduler
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    >>> short = make_scheduler(OptimConfig(learning_rate=1.0, lr_scheduler_type="linear"), opt, total_steps=4)
    >>> for _ in range(4): opt.step(); short.step()       # the end of a 4-step run: rate 0
    >>> longer = make_scheduler(OptimConfig(learning_rate=1.0, lr_scheduler_type="linear"), opt, total_steps=8)
    >>> longer.load_state_dict(short.state_dict())
    >>> retarget_schedule(opt, longer, old_rates=[1.0], new_rates=[0.5])   # step 5 of 8 at half the peak
    [0.25]
    """
    scheduler.base_lrs = [base * (new / old if old else 1.0) for base, old, new in zip(scheduler.base_lrs, old_rates, new_rates)]
    rates = [base * rule(scheduler.last_epoch) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, base, rate in zip(optimizer.param_groups, scheduler.base_lrs, rates):
        group["initial_lr"], group["lr"] = base, rate
    scheduler._last_lr = list(rates)
    return rates


def group_peaks(optimizer, flags: dict) -> list[float]:
    """Each parameter group's peak rate under these flags: its own flag's (--vit_lr ..., groups named
    by mmgrpo/training/optim.py), else --learning_rate."""
    from mmgrpo.training.optim import GROUP_FLAGS

    peaks = []
    for group in optimizer.param_groups:
        own = flags.get(GROUP_FLAGS.get(group.get("name"), ""))
        peaks.append(own if own is not None else flags["learning_rate"])
    return peaks


def apply_resume_changes(run, state) -> None:
    """In `resume_run`, after the optimizer and schedule are loaded: the schedule rule for changed
    schedule flags (with one line giving the next step's rate), and the change recorded in
    `state.resumed` for config.yaml and later checkpoints."""
    if not state.flags:
        return
    changes = flag_changes(state.flags, run.cfg.to_dict())
    state.resumed.append({"after_step": state.step, "changed": {name: [old, new] for name, (old, new) in changes.items()}})
    if not any(name in SCHEDULE for name in changes):
        return
    old_flags, new_flags = leaves(state.flags), leaves(run.cfg.to_dict())
    old_rates, new_rates = group_peaks(run.optimizer, old_flags), group_peaks(run.optimizer, new_flags)
    before = run.scheduler.get_last_lr()[0]
    rates = retarget_schedule(run.optimizer, run.scheduler, old_rates, new_rates)
    if run.strategy.is_main and math.isfinite(rates[0]):
        print(f"mmgrpo: resume: step {state.step + 1} trains at learning rate {rates[0]:.4g} under the new schedule "
              f"({before:.4g} under the checkpoint's)", file=sys.stderr, flush=True)
