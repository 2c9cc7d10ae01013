"""Math accuracy: is the answer part mathematically equal to the solution? (math_verify)

Both sides go through `math_verify.parse`, then `math_verify.verify(gold, prediction)`:
"0.5", "1/2", "$\\frac{1}{2}$" and "\\boxed{\\frac12}" are all the same number. A bare
expression without `$` (e.g. "x^2+1", which the plain-expression parser misreads) is also read
as LaTeX, and either reading may match. math_verify failing on a prediction scores 0.0; a
solution it cannot parse scores None (the sample is skipped, with one warning), because 0.0
would punish a right answer for a dataset problem.

math_verify guards each call with `signal.alarm` (5 s), which only works in the main thread;
from another thread we call it without the timeout.
"""

from __future__ import annotations

import functools
import threading

from mmgrpo.rewards.reward_funcs import _warn_once, register_reward
from mmgrpo.rewards.text import extract_answer, gold_texts

_TIMEOUT_SECONDS = 5


def _timeout() -> int | None:
    return _TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)  # the G completions of a prompt share one solution
def _parse(text: str) -> tuple:
    """Every reading of `text` math_verify can parse: as written and, when it has no `$`, as LaTeX."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    readings = [text]
    if "$" not in text and "\\(" not in text and "\\[" not in text:
        readings.append(f"${text}$")
    parsed = []
    for reading in readings:
        try:
            result = parse(reading, parsing_timeout=_timeout())
        except (Exception, TimeoutException):
            result = []
        if result:
            parsed.append(tuple(result))
    return tuple(parsed)


def math_equal(prediction: str, gold: str) -> bool | None:
    """True if `prediction` equals `gold` mathematically; None if `gold` cannot be parsed.

    >>> math_equal("0.5", "$\\\\frac{1}{2}$"), math_equal("1+x^2", "x^2 + 1"), math_equal("2", "3")
    (True, True, False)
    """
    from math_verify import verify
    from math_verify.errors import TimeoutException

    gold_readings = _parse(gold)
    if not gold_readings:
        return None
    if not prediction.strip():
        return False
    for gold_parsed in gold_readings:
        for pred_parsed in _parse(prediction):
            try:
                if verify(list(gold_parsed), list(pred_parsed), timeout_seconds=_timeout()):
                    return True
            except (Exception, TimeoutException):
                pass
    return False


@register_reward("math_accuracy")
def math_accuracy(completions: list[str], solution: list, **columns) -> list[float | None]:
    """`math_accuracy`: 1.0 if the answer part equals the solution according to math_verify.

    `solution` per sample: a string (LaTeX or plain) or a list of acceptable answers.

    >>> math_accuracy(["<answer>0.5</answer>", "<think>1/2</think><answer>\\\\frac{1}{2}</answer>",
    ...                "<answer>1/3</answer>", "<answer></answer>", "<answer>\\\\frac{</answer>"],
    ...               solution=["$\\\\frac{1}{2}$"] * 5)
    [1.0, 1.0, 0.0, 0.0, 0.0]
    """
    scores = []
    for index, (completion, gold) in enumerate(zip(completions, solution, strict=True)):
        answer = extract_answer(completion)
        results = [math_equal(answer, g) for g in gold_texts(gold)]
        if any(results):
            scores.append(1.0)
        elif all(r is None for r in results):  # also no solution at all
            _warn_once(
                "math_accuracy:gold",
                f"math_accuracy: math_verify cannot parse the solution {gold!r} (batch index {index}); "
                "such samples are skipped (None). [warned once]",
            )
            scores.append(None)
        else:
            scores.append(0.0)
    return scores


math_accuracy.grades = "answers"  # a mixture's rows whose references are boxes are not scored by it (reward_set.task_routes)
