"""Correcting for completions sampled by other weights than the policy's own module.

A rollout engine that holds its own copy of the weights (vLLM; any engine under
`--async_generate`) samples from a distribution that differs from the policy being trained:
by numerics (other kernels, another dtype) and, asynchronously, by one optimizer step. The
step then recomputes the completions' log-probs with the policy (`trainer_logps`) and weights
each token's policy loss by the ratio of the two probabilities, truncated (TIS) or masked where
it leaves [floor, cap], per token or per sequence (TRL's `vllm_importance_sampling_mode`):

    w_t = exp(trainer_logp_t - sampling_logp_t)                         token_*
    w   = exp(sum_t (trainer_logp_t - sampling_logp_t))                 sequence_* (one per completion)
    *_truncate: min(max(w, floor), cap)        *_mask: w where floor <= w <= cap, else 0

    >>> import torch
    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    >>> sampler = torch.log(torch.tensor([[0.5, 0.1], [0.3, 0.1]]))
    >>> weights, stats = sampling_importance_weights(trainer, sampler, torch.ones(2, 2), "token_truncate", cap=3.0)
    >>> weights.tolist()
    [[1.0, 3.0], [3.0, 1.0]]
    >>> weights, _ = sampling_importance_weights(trainer, sampler, torch.ones(2, 2), "sequence_mask", cap=3.0)
    >>> weights.tolist()
    [[0.0], [3.0]]
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmgrpo.errors import ConfigError

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampling_importance_weights(
    trainer_logps: Tensor, sampling_logps: Tensor, completion_mask: Tensor, mode: str = "token_truncate",
    cap: float | None = 3.0, floor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights [N, T] (token modes) or [N, 1] (sequence modes), no grad, and stats for
    logging: the log-prob gap between trainer and sampler (`logp_diff_mean`, `logp_diff_max` over
    real tokens) and the weights' min / mean / max before truncation or masking.

    trainer_logps, sampling_logps: [N, T] log-probs of the completion tokens; completion_mask [N, T].
    """
    if mode not in IS_MODES:
        raise ConfigError(f"--vllm_importance_sampling_mode {mode!r}: choose one of {', '.join(IS_MODES)}")
    mask = completion_mask.bool()
    diff = torch.where(mask, trainer_logps.detach().float() - sampling_logps.float(), 0.0)  # [N, T]
    diff = torch.nan_to_num(diff, nan=0.0)  # a token without a sampling log-prob gets weight 1
    log_ratio = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff  # [N, 1] or [N, T]
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    low = -float("inf") if floor is None else floor
    high = float("inf") if cap is None else cap
    if mode.endswith("truncate"):
        weights = ratio if floor is None and cap is None else ratio.clamp(min=floor, max=cap)
    else:
        weights = torch.where((ratio >= low) & (ratio <= high), ratio, 0.0)
    counted = ratio.expand_as(mask)[mask] if mode.startswith("token") else ratio.flatten()
    gaps = diff.abs()[mask]
    stats = {
        "logp_diff_mean": gaps.mean() if gaps.numel() else diff.new_zeros(()),
        "logp_diff_max": gaps.max() if gaps.numel() else diff.new_zeros(()),
        "is_ratio_min": counted.min() if counted.numel() else diff.new_ones(()),
        "is_ratio_mean": counted.mean() if counted.numel() else diff.new_ones(()),
        "is_ratio_max": counted.max() if counted.numel() else diff.new_ones(()),
    }
    return weights, stats


def logp_gap_by_group(trainer_logps: Tensor, sampling_logps: Tensor, completion_mask: Tensor,
                      groups: Tensor) -> dict[int, float]:
    """The mean |trainer - sampler| log-prob gap over the real tokens of each group of rows, by the
    group's number (asynchronous training: rows by staleness, where the gap grows with it).
    trainer_logps, sampling_logps, completion_mask: [N, T]; groups: [N] integers.

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.2, 0.2]]))
    >>> sampler = torch.log(torch.tensor([[0.5, 0.5], [0.3, 0.1], [0.1, 0.1]]))
    >>> gaps = logp_gap_by_group(trainer, sampler, torch.ones(3, 2), torch.tensor([0, 2, 2]))
    >>> {group: round(gap, 4) for group, gap in gaps.items()}   # group 2: (log 3 + 0 + log 2 + log 2) / 4
    {0: 0.0, 2: 0.6212}
    """
    mask = completion_mask.bool()
    gaps = torch.nan_to_num((trainer_logps.detach().float() - sampling_logps.float()).abs(), nan=0.0)  # [N, T]
    result = {}
    for group in sorted(set(groups.tolist())):
        rows = mask & (groups == group).to(mask.device)[:, None]  # [N, T]
        result[int(group)] = float(gaps[rows].mean()) if rows.any() else 0.0
    return result
