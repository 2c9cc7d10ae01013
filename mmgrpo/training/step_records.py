"""What a training step logs beside its loss: the batch's rewards and lengths, each reward function's
and modality's rewards, the staleness of asynchronous rollouts (metrics.jsonl), and the first
prompts' completions with their rewards and advantages (completions.jsonl)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mmgrpo.rollout.base import Rollout


def batch_metrics(batch: Rollout, adv_stats: dict) -> dict[str, float]:
    """The batch's rewards and completion lengths as logged."""
    lengths = batch.completion_mask.sum(1).float()
    return {
        "reward": float(batch.rewards.nanmean()),
        "reward_std": adv_stats["reward_std"],
        "frac_reward_zero_std": adv_stats["frac_reward_zero_std"],
        "completion_length": float(lengths.mean()),
        "completion_length_max": float(lengths.max()),
        "clipped_ratio": float(batch.truncated.float().mean()),
    }


def reward_metrics(names: list[str], batch: Rollout, samples: list, G: int) -> dict[str, float]:
    """reward/<name> and reward/<name>_std of each reward function (NaN: skipped), and reward/<modality>."""
    metrics = {}
    for name, values in zip(names, batch.reward_per_func):
        metrics[f"reward/{name}"] = float(values.nanmean())
        metrics[f"reward/{name}_std"] = float(values[~values.isnan()].std()) if (~values.isnan()).sum() > 1 else 0.0
    modalities = [s.modality for s in samples for _ in range(G)]
    for modality in sorted(set(modalities)):
        rows = torch.tensor([m == modality for m in modalities])
        metrics[f"reward/{modality}"] = float(batch.rewards[rows].nanmean())
    return metrics


def staleness_shares(staleness: torch.Tensor, max_staleness: int) -> dict[str, float]:
    """Asynchronous training: the share of the batch's completions sampled 0, 1, ... K steps back.

    >>> staleness_shares(torch.tensor([2, 2, 0, 2]), 2)
    {'staleness/share_0': 0.25, 'staleness/share_1': 0.0, 'staleness/share_2': 0.75}
    """
    if not max_staleness:
        return {}
    return {f"staleness/share_{k}": float((staleness == k).float().mean()) for k in range(max_staleness + 1)}


def completion_records(samples: list, batch: Rollout, names: list[str], G: int, step: int, limit: int) -> list[dict]:
    """The first `limit` prompts' completions, rewards and advantages, as completions.jsonl records
    them (multi-turn: the whole episodes too). Image paths stay as the dataset gives them, with the
    dataset's media root (absolute) beside them, so `mmgrpo report` finds the files from any folder;
    images held in memory (bytes, arrays, PIL) are counted, not stored."""
    records = []
    for p, sample in enumerate(samples[:limit]):
        rows = range(p * G, (p + 1) * G)
        in_memory = sum(not isinstance(ref, str) for ref in sample.images)
        records.append({
            "step": step,
            "sample_id": sample.id,
            "prompt": sample.messages,
            "images": [ref for ref in sample.images if isinstance(ref, str)],
            **({"media_root": str(Path(sample.media_root).absolute())} if sample.media_root is not None else {}),
            **({"images_in_memory": in_memory} if in_memory else {}),
            "solution": sample.columns.get("solution"),
            "completions": [batch.texts[r] for r in rows],
            "rewards": {name: [None if math.isnan(v) else v for v in batch.reward_per_func[f, rows.start:rows.stop].tolist()]
                        for f, name in enumerate(names)},
            "reward": batch.rewards[rows.start:rows.stop].tolist(),
            "advantage": batch.advantages[rows.start:rows.stop].tolist(),
            **({"augment": sample.columns["augment"]} if "augment" in sample.columns else {}),  # data/augment.py
        })
        if "trajectory" in batch.columns:  # multi-turn: the whole episodes too
            records[-1]["trajectories"] = batch.columns["trajectory"][p * G : (p + 1) * G]
    return records
