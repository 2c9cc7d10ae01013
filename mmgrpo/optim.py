"""The optimizer and its learning-rate schedule, from the `optim` flags (GRPO and SFT alike).

    optimizer = make_optimizer(cfg.optim)(params)        # a factory: sharding strategies build it on the shards
    scheduler = make_scheduler(cfg.optim, optimizer, total_steps)

Schedules are transformers' own, by their HF names (`--lr_scheduler_type`), with their options as
`--lr_scheduler_kwargs` JSON; the warm-up is ceil(warmup_ratio x steps), as the HF Trainer counts it.
"""

from __future__ import annotations

import inspect
import json
import math
from functools import partial

import torch

from mmgrpo.errors import ConfigError

# The HF schedule names mmgrpo accepts (transformers.SchedulerType values).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup", "warmup_stable_decay")
# cosine_with_min_lr without options decays to 10% of the peak (mmgrpo's `cosine` before HF's names).
DEFAULT_SCHEDULER_KWARGS = {"cosine_with_min_lr": {"min_lr_rate": 0.1}}


def make_optimizer(optim_cfg):
    """`params -> AdamW` as the optim flags say. Fused (default): one kernel updates every tensor
    in place, on CPU and CUDA; the update is the same as the for-loop's to float rounding."""
    return partial(
        torch.optim.AdamW, lr=optim_cfg.learning_rate, weight_decay=optim_cfg.weight_decay,
        betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2), fused=optim_cfg.optim == "adamw_torch_fused" or None,
    )


def scheduler_kwargs(optim_cfg) -> dict:
    """--lr_scheduler_kwargs (a JSON string, or a mapping from YAML) checked against the schedule's options.

    >>> from mmgrpo.config import OptimConfig
    >>> scheduler_kwargs(OptimConfig(lr_scheduler_type="cosine_with_min_lr"))
    {'min_lr_rate': 0.1}
    >>> scheduler_kwargs(OptimConfig(lr_scheduler_type="cosine", lr_scheduler_kwargs='{"num_cycles": 1.0}'))
    {'num_cycles': 1.0}
    """
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    name, value = optim_cfg.lr_scheduler_type, optim_cfg.lr_scheduler_kwargs
    if name not in LR_SCHEDULERS:
        raise ConfigError(f"--lr_scheduler_type {name!r}: choose one of {', '.join(LR_SCHEDULERS)} (HF's names).")
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lr_scheduler_kwargs is not valid JSON ({exc.msg}); give e.g. '{{\"min_lr_rate\": 0.1}}'.") from None
    if name == "warmup_stable_decay" and not (isinstance(value, dict) and "num_decay_steps" in value):
        raise ConfigError(
            "--lr_scheduler_type warmup_stable_decay needs the length of its decay: "
            "--lr_scheduler_kwargs '{\"num_decay_steps\": 60, \"min_lr_ratio\": 0.1}'."
        )
    if value in (None, "", {}):
        return dict(DEFAULT_SCHEDULER_KWARGS.get(name, {}))
    if not isinstance(value, dict):
        raise ConfigError(f"--lr_scheduler_kwargs must be a JSON object, got {value!r}.")
    accepted = [
        p for p in inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters
        if p not in ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")
    ]
    unknown = sorted(set(value) - set(accepted))
    if unknown:
        raise ConfigError(
            f"--lr_scheduler_kwargs: {', '.join(unknown)} is not an option of {name!r}; it takes: {', '.join(accepted) or 'none'}."
        )
    return dict(value)


def warmup_steps(optim_cfg, total_steps: int) -> int:
    """ceil(warmup_ratio x total steps), as the HF Trainer counts them."""
    return math.ceil(optim_cfg.warmup_ratio * total_steps)


def make_scheduler(optim_cfg, optimizer, total_steps: int):
    """transformers' schedule named by --lr_scheduler_type, stepped once per optimizer step.

    >>> from mmgrpo.config import OptimConfig
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    >>> sched = make_scheduler(OptimConfig(lr_scheduler_type="linear", warmup_ratio=0.25), opt, total_steps=8)
    >>> rates = []
    >>> for _ in range(8):
    ...     rates.append(round(sched.get_last_lr()[0], 3)); opt.step(); sched.step()
    >>> rates
    [0.0, 0.5, 1.0, 0.833, 0.667, 0.5, 0.333, 0.167]
    """
    from transformers import get_scheduler

    return get_scheduler(
        optim_cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(optim_cfg, total_steps),
        num_training_steps=total_steps, scheduler_specific_kwargs=scheduler_kwargs(optim_cfg),
    )
