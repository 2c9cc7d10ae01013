"""Paired statistics for comparing two models on the same samples.

All three take the per-sample scores of model A and model B on the same samples, in the same
order, and look at the per-sample differences d = b - a:

    paired_bootstrap_ci(a, b)   95% CI of mean(d): resample samples with replacement
    sign_flip_test(a, b)        two-sided p of mean(d) != 0: under "A and B are exchangeable"
                                each d_i is as likely to be -d_i, so flip signs at random
    mcnemar_exact(a, b)         two-sided p for 0/1 scores: of the samples where exactly one
                                model is right, is "B right" a fair coin? (exact binomial)

Resampling is vectorised (a [chunk, n] index or sign matrix per step) and seeded: the same
seed gives the same numbers.

    >>> mcnemar_exact([0, 0, 0, 1], [1, 1, 1, 1])   # 3 discordant pairs, all for B: 2 * 0.5**3
    0.25
"""

from __future__ import annotations

import numpy as np

# Resampling works on [chunk, n] matrices; bound a chunk to about this many elements (~8 MB).
_CHUNK_ELEMENTS = 1_000_000


def _differences(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired scores need two 1-d arrays of one length, got {a.shape} and {b.shape}")
    return b - a  # [n]


def _chunks(total: int, n: int):
    rows = max(1, _CHUNK_ELEMENTS // max(n, 1))
    for start in range(0, total, rows):
        yield min(rows, total - start)


def paired_bootstrap_ci(a, b, *, n_boot: int = 10_000, seed: int = 0, confidence: float = 0.95):
    """Percentile bootstrap CI of mean(b - a), resampling the pairs; returns (low, high)."""
    d = _differences(a, b)
    n = len(d)
    if n == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    done = 0
    for rows in _chunks(n_boot, n):
        index = rng.integers(0, n, size=(rows, n))  # [rows, n]
        means[done : done + rows] = d[index].mean(axis=1)
        done += rows
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def sign_flip_test(a, b, *, n_perm: int = 10_000, seed: int = 0) -> float:
    """Two-sided paired permutation test (random sign flips of d = b - a) of mean(d) = 0.

    p = (1 + #{|mean of flipped d| >= |mean d|}) / (n_perm + 1), never 0.
    """
    d = _differences(a, b)
    n = len(d)
    if n == 0:
        return 1.0
    observed = abs(d.sum())
    total = d.sum()
    rng = np.random.default_rng(seed)
    extreme = 0
    for rows in _chunks(n_perm, n):
        flipped = rng.random((rows, n)) < 0.5  # [rows, n] True = this pair's sign is flipped
        # sum(s_i * d_i) with s_i = -1 where flipped = sum(d) - 2 * sum(flipped d)
        sums = total - 2.0 * (flipped @ d)  # [rows]
        # a small tolerance so that ties with the observed value count as extreme
        extreme += int(np.count_nonzero(np.abs(sums) >= observed - 1e-9 * max(1.0, observed)))
    return (1 + extreme) / (n_perm + 1)


def mcnemar_exact(a, b) -> float:
    """Exact McNemar test for paired 0/1 scores: two-sided binomial test of the discordant pairs."""
    from scipy.stats import binom

    a, b = np.asarray(a), np.asarray(b)
    if not (is_binary(a) and is_binary(b)):
        raise ValueError("mcnemar_exact needs scores that are all 0 or 1")
    b_only = int(np.sum((a == 0) & (b == 1)))
    a_only = int(np.sum((a == 1) & (b == 0)))
    discordant = a_only + b_only
    if discordant == 0:
        return 1.0
    return float(min(1.0, 2.0 * binom.cdf(min(a_only, b_only), discordant, 0.5)))


def is_binary(values) -> bool:
    values = np.asarray(values, dtype=np.float64)
    return bool(np.all((values == 0) | (values == 1)))
