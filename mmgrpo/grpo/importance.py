"""Correcting for completions sampled by other weights than the policy's own module.

A rollout engine that holds its own copy of the weights (vLLM; any engine under
`--async_generate`) samples from a distribution that differs from the policy being trained:
by numerics (other kernels, another dtype) and, asynchronously, by optimizer steps. The step
then recomputes the completions' log-probs with the policy (`trainer_logps`) and weights each
token's policy loss by the ratio of the two probabilities (`--vllm_importance_sampling_mode`),
per token, per completion, or per completion as a geometric mean; the ratio is truncated into
[floor, cap] or masked (weight 0) outside it:

    d_t = trainer_logp_t - sampling_logp_t         (log ratio of one sampled token)
    token_*:      w_t = exp(d_t)                     truncated importance sampling (TIS) / masked (MIS)
    sequence_*:   w   = exp(sum_t d_t)              one weight per completion
    geometric_*:  w   = exp(mean_t d_t)             the sequence ratio per token: length does not inflate it
    *_truncate:   min(max(w, floor), cap)           *_mask: w where floor <= w <= cap, else 0

`token_mask` with a floor is IcePop's two-sided band (tokens whose ratio leaves [floor, cap]
carry no gradient). Off-policy sequence masking (`--opsm_delta`, DeepSeek-V3.2) acts on top of
any mode: a completion with a negative advantage whose mean log(sampler / trainer) exceeds
delta is left out, since pushing down a sample the policy no longer produces mostly adds noise:

    masked_i = A_i < 0  and  mean_t (sampling_logp_t - trainer_logp_t) > delta

    >>> import torch
    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    >>> sampler = torch.log(torch.tensor([[0.5, 0.1], [0.3, 0.1]]))
    >>> weights, stats = sampling_importance_weights(trainer, sampler, torch.ones(2, 2), "token_truncate", cap=3.0)
    >>> weights.tolist()
    [[1.0, 3.0], [3.0, 1.0]]
    >>> weights, _ = sampling_importance_weights(trainer, sampler, torch.ones(2, 2), "sequence_mask", cap=3.0)
    >>> weights.tolist()
    [[0.0], [3.0]]
    >>> weights, _ = sampling_importance_weights(trainer, sampler, torch.ones(2, 2), "geometric_mask", cap=3.0)
    >>> [round(w, 4) for w in weights.flatten().tolist()]      # sqrt(5) and sqrt(3): inside the band
    [2.2361, 1.7321]
    >>> weights, stats = sampling_importance_weights(trainer, sampler, torch.ones(2, 2), "token_mask", cap=2.0, floor=0.5)
    >>> weights.tolist(), round(float(stats["masked_frac"]), 2)   # IcePop: ratios 5 and 3 leave [0.5, 2]
    ([[1.0, 0.0], [0.0, 1.0]], 0.5)
    >>> off_policy_sequence_mask(trainer, sampler, torch.ones(2, 2), torch.tensor([-1.0, -1.0]), delta=0.1).tolist()
    [[1.0], [1.0]]
    >>> keen = torch.log(torch.full((2, 2), 0.9))   # a sampler far keener on both completions than the trainer
    >>> off_policy_sequence_mask(trainer, keen, torch.ones(2, 2), torch.tensor([-1.0, 1.0]), delta=0.1).tolist()
    [[0.0], [1.0]]
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmgrpo.errors import ConfigError

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_truncate", "geometric_mask")


def sampling_importance_weights(
    trainer_logps: Tensor, sampling_logps: Tensor, completion_mask: Tensor, mode: str = "token_truncate",
    cap: float | None = 3.0, floor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights [N, T] (token modes) or [N, 1] (sequence and geometric modes), no grad,
    and stats for logging: the log-prob gap between trainer and sampler (`logp_diff_mean`,
    `logp_diff_max` over real tokens), the sampler-to-trainer KL (`kl`, the k3 estimate
    exp(d) - 1 - d averaged over the sampled tokens), the weights' min / mean / max before
    truncation or masking, and the share of tokens whose weight was cut (`truncated_frac`) or zeroed
    (`masked_frac`).

    trainer_logps, sampling_logps: [N, T] log-probs of the completion tokens; completion_mask [N, T].
    """
    if mode not in IS_MODES:
        raise ConfigError(f"--vllm_importance_sampling_mode {mode!r}: choose one of {', '.join(IS_MODES)}")
    mask = completion_mask.bool()
    diff = log_ratio_of(trainer_logps, sampling_logps, mask)  # [N, T]
    if mode.startswith("token"):
        log_ratio = diff
    else:
        log_ratio = diff.sum(-1, keepdim=True)  # [N, 1]
        if mode.startswith("geometric"):
            log_ratio = log_ratio / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    low = -float("inf") if floor is None else floor
    high = float("inf") if cap is None else cap
    inside = (ratio >= low) & (ratio <= high)
    if mode.endswith("truncate"):
        weights = ratio if floor is None and cap is None else ratio.clamp(min=floor, max=cap)
    else:
        weights = torch.where(inside, ratio, 0.0)
    outside = (~inside).expand_as(mask)[mask].float()  # per real token (a sequence's verdict on each of its tokens)
    counted = ratio.expand_as(mask)[mask] if mode.startswith("token") else ratio.flatten()
    gaps = diff.abs()[mask]
    cut = outside.mean() if outside.numel() else diff.new_zeros(())
    stats = {
        "logp_diff_mean": gaps.mean() if gaps.numel() else diff.new_zeros(()),
        "logp_diff_max": gaps.max() if gaps.numel() else diff.new_zeros(()),
        "kl": token_kl(diff, mask),
        "is_ratio_min": counted.min() if counted.numel() else diff.new_ones(()),
        "is_ratio_mean": counted.mean() if counted.numel() else diff.new_ones(()),
        "is_ratio_max": counted.max() if counted.numel() else diff.new_ones(()),
        "truncated_frac": cut if mode.endswith("truncate") else diff.new_zeros(()),
        "masked_frac": cut if mode.endswith("mask") else diff.new_zeros(()),
    }
    return weights, stats


def log_ratio_of(trainer_logps: Tensor, sampling_logps: Tensor, mask: Tensor) -> Tensor:
    """[N, T] log(trainer / sampler) of each sampled token, no grad, float32; 0 outside `mask` (bool
    [N, T]) and where the sampler gave no log-prob (NaN: such a token counts as agreeing)."""
    return torch.nan_to_num(torch.where(mask, trainer_logps.detach().float() - sampling_logps.float(), 0.0), nan=0.0)


def token_kl(diff: Tensor, mask: Tensor) -> Tensor:
    """KL(sampler || trainer) over the sampled tokens, by the k3 estimator: with r = trainer / sampler
    probability of a token the sampler drew, E[r - 1 - log r] (non-negative, unbiased, low variance).
    diff: [N, T] log r; mask: [N, T] bool."""
    k3 = (torch.exp(diff.clamp(max=20.0)) - 1 - diff)[mask]
    return k3.mean() if k3.numel() else diff.new_zeros(())


def off_policy_sequence_mask(trainer_logps: Tensor, sampling_logps: Tensor, completion_mask: Tensor,
                             advantages: Tensor, delta: float) -> Tensor:
    """[N, 1] 0/1: 0 for a completion with a negative advantage whose mean log(sampler / trainer)
    over its real tokens exceeds `delta` (DeepSeek-V3.2's off-policy sequence masking), else 1.
    trainer_logps, sampling_logps, completion_mask: [N, T]; advantages: [N]."""
    mask = completion_mask.bool()
    mean_drift = -log_ratio_of(trainer_logps, sampling_logps, mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    masked = (advantages.to(mean_drift.device) < 0) & (mean_drift > delta)
    return (~masked).float()[:, None]


def mismatch_by_modality(trainer_logps: Tensor, sampling_logps: Tensor, completion_mask: Tensor, weights: Tensor,
                         modalities: list[str]) -> dict[str, float]:
    """The rollout-training mismatch of each modality's rows (text, image, video, audio, mixed):
    `mismatch/<modality>/logp_diff_mean|logp_diff_max|kl|masked_frac`, the last the share of its real
    tokens whose final weight is 0 (masking modes, --opsm_delta). Image and video rows are where
    samplers and trainers drift apart most, so the gap is reported per kind of row.

    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    >>> sampler = torch.log(torch.tensor([[0.5, 0.5], [0.3, 0.1]]))
    >>> gaps = mismatch_by_modality(trainer, sampler, torch.ones(2, 2), torch.ones(2, 2), ["text", "image"])
    >>> {key: round(value, 4) for key, value in gaps.items() if "diff" in key}
    {'mismatch/image/logp_diff_mean': 0.5493, 'mismatch/image/logp_diff_max': 1.0986, 'mismatch/text/logp_diff_mean': 0.0, 'mismatch/text/logp_diff_max': 0.0}
    """
    mask = completion_mask.bool()
    diff = log_ratio_of(trainer_logps, sampling_logps, mask)  # [N, T]
    zeroed = weights.expand_as(mask) == 0
    metrics = {}
    for modality in sorted(set(modalities)):
        rows = torch.tensor([m == modality for m in modalities], device=mask.device)[:, None] & mask  # [N, T]
        if not rows.any():
            continue
        gaps = diff.abs()[rows]
        metrics.update({f"mismatch/{modality}/logp_diff_mean": float(gaps.mean()),
                        f"mismatch/{modality}/logp_diff_max": float(gaps.max()),
                        f"mismatch/{modality}/kl": float(token_kl(diff, rows)),
                        f"mismatch/{modality}/masked_frac": float(zeroed[rows].float().mean())})
    return metrics


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
    gaps = log_ratio_of(trainer_logps, sampling_logps, mask).abs()  # [N, T]
    result = {}
    for group in sorted(set(groups.tolist())):
        rows = mask & (groups == group).to(mask.device)[:, None]  # [N, T]
        result[int(group)] = float(gaps[rows].mean()) if rows.any() else 0.0
    return result
