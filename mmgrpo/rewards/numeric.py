"""Partial credit for numeric answers (counting): a near miss scores more than a far one.

An exact-match reward gives a counting model nothing to climb when all G answers of a group are
wrong, and treats "4" for five shapes like "1". `number_closeness` scores 1 / (1 + |answer - gold|):
exact 1.0, one off 0.5, two off 0.33 ... so a group's advantages point toward the right count.
Used beside the exact reward (`vqa_accuracy` or `exact_match`), which still decides what counts
as correct.
"""

from __future__ import annotations

import re

from mmgrpo.rewards.reward_funcs import register_reward
from mmgrpo.rewards.text import extract_answer, gold_texts
from mmgrpo.rewards.vqa import normalize_vqa_answer

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def first_number(text: str) -> float | None:
    """The first number in `text` after VQA normalisation (number words become digits), or None.

    >>> first_number("Three."), first_number("about 12 cats"), first_number("none"), first_number("many")
    (3.0, 12.0, 0.0, None)
    """
    match = _NUMBER.search(normalize_vqa_answer(text))
    return float(match.group()) if match else None


@register_reward("number_closeness")
def number_closeness(completions: list[str], solution: list, **columns) -> list[float | None]:
    """`number_closeness`: 1 / (1 + |answer - gold|) for the first number of the answer part; 0.0
    without a number; None (skipped) where the solution holds no number. Against several
    references (VQA-style answers) the most common number counts.

    >>> number_closeness(["<answer>5</answer>", "<answer>4</answer>", "<answer>two</answer>", "<answer>many</answer>"],
    ...                  solution=["5", "5", "5", "5"])
    [1.0, 0.5, 0.25, 0.0]
    """
    scores = []
    for completion, gold in zip(completions, solution, strict=True):
        numbers = [n for n in (first_number(g) for g in gold_texts(gold)) if n is not None]
        if not numbers:
            scores.append(None)
            continue
        target = max(set(numbers), key=numbers.count)
        answer = first_number(extract_answer(completion))
        scores.append(0.0 if answer is None else 1.0 / (1.0 + abs(answer - target)))
    return scores


number_closeness.grades = "answers"  # a mixture's rows whose references are boxes are not scored by it (reward_set.task_routes)
