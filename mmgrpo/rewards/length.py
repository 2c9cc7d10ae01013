"""Length-shaped rewards: `cosine` (length-scaled correctness) and `soft_overlong` (DAPO).

Both read the `completion_ids` column (each completion's token ids, which the engine passes) and
take their options by keyword (`--reward_kwargs '{"cosine": {"cosine_max_len": 512}}'`, see
docs/rewards.md). Option names and defaults follow ms-swift.

    >>> cosine(["<answer>4</answer>", "<answer>5</answer>"], solution=["4", "4"], completion_ids=[[0] * 10, [0] * 10],
    ...        cosine_accuracy="exact_match", cosine_max_len=20)
    [0.75, -0.25]
"""

from __future__ import annotations

import math

from mmgrpo.rewards.reward_funcs import get_reward, register_reward


def _lengths(completions: list[str], completion_ids) -> list[int]:
    if completion_ids is None:
        raise ValueError("this reward needs the `completion_ids` column (token ids per completion; mmgrpo train passes it)")
    if len(completion_ids) != len(completions):
        raise ValueError(f"{len(completion_ids)} completion_ids for {len(completions)} completions")
    return [len(ids) for ids in completion_ids]


def cosine_schedule(length: int, max_len: int, value_at_zero: float, value_at_max: float) -> float:
    """Half a cosine from `value_at_zero` (length 0) to `value_at_max` (length >= max_len).

    >>> cosine_schedule(0, 100, 1.0, 0.5), cosine_schedule(50, 100, 1.0, 0.5), cosine_schedule(200, 100, 1.0, 0.5)
    (1.0, 0.75, 0.5)
    """
    progress = min(length, max_len) / max_len
    return value_at_max + (value_at_zero - value_at_max) * 0.5 * (1.0 + math.cos(math.pi * progress))


@register_reward("cosine")
def cosine(
    completions: list[str],
    completion_ids: list | None = None,
    *,
    cosine_min_len_value_wrong: float = 0.0,
    cosine_max_len_value_wrong: float = -0.5,
    cosine_min_len_value_correct: float = 1.0,
    cosine_max_len_value_correct: float = 0.5,
    cosine_max_len: int | None = None,
    cosine_accuracy: str = "math_accuracy",
    max_completion_length: int | None = None,
    **columns,
) -> list[float | None]:
    """`cosine`: correctness scaled by length (Yeo et al. 2025, "Demystifying Long CoT"; ms-swift's
    parameters). A correct completion earns `cosine_min_len_value_correct` at length 0 falling to
    `cosine_max_len_value_correct` at `cosine_max_len` tokens (short and right is best); a wrong one
    goes from `cosine_min_len_value_wrong` to `cosine_max_len_value_wrong` (long and wrong is worst).

    Correct means the reward named by `cosine_accuracy` (a registered name, default `math_accuracy`)
    gives >= 0.5; a sample it skips (None) is skipped here too. `cosine_max_len` defaults to the
    run's --max_completion_length; lengths are tokens (the `completion_ids` column).

    >>> ids = [[1] * 0, [1] * 50, [1] * 100]
    >>> cosine(["<answer>3</answer>"] * 3, solution=["3"] * 3, completion_ids=ids, cosine_max_len=100,
    ...        cosine_accuracy="exact_match")
    [1.0, 0.75, 0.5]
    >>> cosine(["<answer>2</answer>"] * 3, solution=["3"] * 3, completion_ids=ids, cosine_max_len=100,
    ...        cosine_accuracy="exact_match")
    [0.0, -0.25, -0.5]
    """
    max_len = cosine_max_len or max_completion_length
    if not max_len or max_len <= 0:
        raise ValueError("cosine needs cosine_max_len > 0 (or the run's max_completion_length)")
    lengths = _lengths(completions, completion_ids)
    accuracy = get_reward(cosine_accuracy)(completions, **columns)
    rewards: list[float | None] = []
    for length, correct in zip(lengths, accuracy, strict=True):
        if correct is None:
            rewards.append(None)
        elif correct >= 0.5:
            rewards.append(cosine_schedule(length, max_len, cosine_min_len_value_correct, cosine_max_len_value_correct))
        else:
            rewards.append(cosine_schedule(length, max_len, cosine_min_len_value_wrong, cosine_max_len_value_wrong))
    return rewards


cosine.needs_solution = True  # it grades through an accuracy reward (--missing_solution)


@register_reward("soft_overlong")
def soft_overlong(
    completions: list[str],
    completion_ids: list | None = None,
    *,
    soft_max_length: int | None = None,
    soft_cache_length: int = 64,
    max_completion_length: int | None = None,
    **columns,
) -> list[float]:
    """`soft_overlong`: DAPO's soft overlong punishment from token counts. 0 up to
    `soft_max_length - soft_cache_length` tokens, then linearly down to -1 at `soft_max_length`,
    -1 beyond. `soft_max_length` defaults to the run's --max_completion_length (ms-swift's names).

    >>> soft_overlong(["", "", "", ""], completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 12],
    ...               soft_max_length=10, soft_cache_length=4)
    [0.0, -0.5, -1.0, -1.0]
    """
    max_length = soft_max_length or max_completion_length
    if not max_length or not 0 < soft_cache_length <= max_length:
        raise ValueError(
            f"soft_overlong needs 0 < soft_cache_length <= soft_max_length, got {soft_cache_length}, {max_length}"
        )
    threshold = max_length - soft_cache_length
    return [max(-1.0, min(0.0, (threshold - n) / soft_cache_length)) for n in _lengths(completions, completion_ids)]
