"""The optimizer and its learning-rate schedule, from the `optim` flags (GRPO and SFT alike).

    optimizer = make_optimizer(cfg.optim)(params)        # a factory: sharding strategies build it on the shards
    scheduler = make_scheduler(cfg.optim, optimizer, total_steps)
"""

from __future__ import annotations

import math
from functools import partial

import torch


def make_optimizer(optim_cfg):
    """`params -> AdamW` as the optim flags say. Fused (default): one kernel updates every tensor
    in place, on CPU and CUDA; the update is the same as the for-loop's to float rounding."""
    return partial(
        torch.optim.AdamW, lr=optim_cfg.learning_rate, weight_decay=optim_cfg.weight_decay,
        betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2), fused=optim_cfg.optim == "adamw_torch_fused" or None,
    )


def lr_factor(optim_cfg, total_steps: int):
    """step -> multiplier of the peak rate: linear warm-up over warmup_ratio of the steps, then
    `cosine` (to 10% of the peak) or `constant`.

    >>> from mmgrpo.config import OptimConfig
    >>> factor = lr_factor(OptimConfig(warmup_ratio=0.25), total_steps=8)
    >>> [round(factor(step), 3) for step in range(8)]
    [0.333, 0.667, 1.0, 0.94, 0.775, 0.55, 0.325, 0.16]
    """
    warmup = int(optim_cfg.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if optim_cfg.lr_scheduler_type == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))  # cosine to 10% of peak

    return factor


def make_scheduler(optim_cfg, optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(optim_cfg, total_steps))
