"""`repetition`: the n-gram repetition penalty (Open-R1 / ms-swift).

    >>> repetition(["the cat sat on the mat", "go go go go go go"], repetition_n_grams=2)
    [0.0, -0.8]
"""

from __future__ import annotations

from mmgrpo.rewards.reward_funcs import register_reward


def repeated_fraction(text: str, n: int) -> float:
    """1 - distinct n-grams / all n-grams over the lower-cased words; 0 for fewer than n words.

    >>> repeated_fraction("a b a b a b", 2)   # 5 bigrams, 2 distinct
    0.6
    >>> repeated_fraction("one two", 3)
    0.0
    """
    words = text.lower().split()
    ngrams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not ngrams:
        return 0.0
    return 1.0 - len(set(ngrams)) / len(ngrams)


@register_reward("repetition")
def repetition(
    completions: list[str], *, repetition_n_grams: int = 3, repetition_max_penalty: float = -1.0, **columns
) -> list[float]:
    """`repetition`: `repetition_max_penalty` (<= 0) times the fraction of repeated word n-grams of each
    completion: 0 for text with no repeated n-gram, down to about `repetition_max_penalty` for a loop.

    >>> repetition(["a b c d e", "a b c a b c a b c"])   # trigrams: 5 distinct of 5; 3 distinct of 7
    [0.0, -0.5714285714285714]
    >>> repetition(["x y x y"], repetition_n_grams=2, repetition_max_penalty=-0.5)   # 2 distinct of 3
    [-0.16666666666666669]
    """
    if repetition_max_penalty > 0:
        raise ValueError(f"repetition_max_penalty must be <= 0, got {repetition_max_penalty}")
    if repetition_n_grams < 1:
        raise ValueError(f"repetition_n_grams must be >= 1, got {repetition_n_grams}")
    fractions = [repeated_fraction(text, repetition_n_grams) for text in completions]
    return [fraction * repetition_max_penalty if fraction else 0.0 for fraction in fractions]
