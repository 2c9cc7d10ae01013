"""Answer extraction shared by every accuracy reward.

Accuracy rewards never grade the whole completion when the model wrote an `<answer>` part: they
grade what `extract_answer` returns, and an empty result scores 0.0 everywhere. That closes the
known hack where an empty `<answer></answer>` scored 1.0 under a substring match.

    >>> extract_answer("<think>2 + 2</think> <answer> 4 </answer>")
    '4'
    >>> extract_answer("no tags at all")
    'no tags at all'
"""

from __future__ import annotations

import re

from mmgrpo.rewards.reward_funcs import register_reward

_ANY_TAG = re.compile(r"</?(?:think|answer)>")


def extract_answer(text: str, tag: str = "answer") -> str:
    """The part of a completion an accuracy reward grades, stripped; '' when there is none.

    - a complete `<answer>...</answer>`: the content of the first one;
    - otherwise, if the model closed a `</think>`: what follows the last `</think>`;
    - otherwise the whole completion (models trained without tags);
    - leftover `<think>`/`<answer>` tags are removed, so a tag-only completion gives ''.

    >>> extract_answer("<answer>red</answer><answer>blue</answer>")  # the first answer counts
    'red'
    >>> extract_answer("<think>hmm</think>The cat.")
    'The cat.'
    >>> extract_answer("<answer>  </answer>"), extract_answer("</answer>"), extract_answer("<think>x</think>")
    ('', '', '')
    >>> extract_answer("<ans>5</ans>", tag="ans")
    '5'
    """
    if not isinstance(text, str):
        raise TypeError(f"a completion must be a str, got {type(text).__name__}")
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    # str.find, not a lazy regex: `<answer>(.*?)</answer>` is quadratic on many unclosed tags.
    start = text.find(open_tag)
    end = text.find(close_tag, start + len(open_tag)) if start >= 0 else -1
    if end >= 0:
        answer = text[start + len(open_tag) : end]
    elif "</think>" in text:
        answer = text.rsplit("</think>", 1)[1]
    else:
        answer = text
    answer = _ANY_TAG.sub("", answer)
    if tag not in ("think", "answer"):
        answer = answer.replace(open_tag, "").replace(close_tag, "")
    return answer.strip()


def gold_texts(solution) -> list[str]:
    """A `solution` cell as a list of reference strings (answer tags in it are removed).

    Accepts a string, a number, a list of those, or VQAv2-style dicts `{"answer": ...}`.

    >>> gold_texts("<answer> 3 </answer>")
    ['3']
    >>> gold_texts([{"answer": "yes"}, "no", 2])
    ['yes', 'no', '2']
    """
    items = solution if isinstance(solution, (list, tuple)) else [solution]
    texts = []
    for item in items:
        if isinstance(item, dict):
            if "answer" not in item:
                raise ValueError(f"a solution dict needs an 'answer' key, got keys {sorted(item)}")
            item = item["answer"]
        if item is None:
            continue
        texts.append(extract_answer(str(item)))
    return texts


_EDGE_PUNCTUATION = " \t\n.,;:!?\"'`()[]{}"


def normalize_text(text: str) -> str:
    """Light normalisation for `exact_match`: lower-case, one space between words, and
    punctuation, quotes and brackets stripped from both ends (so "(B)." equals "b").

    >>> normalize_text("  The  Red\\nCar. ")
    'the red car'
    >>> normalize_text("(B).")
    'b'
    """
    return " ".join(text.lower().split()).strip(_EDGE_PUNCTUATION)


def exact_match_score(completion: str, solution) -> float:
    """1.0 if the answer part of `completion` equals the solution (or one of a list of
    solutions) after `normalize_text`; an empty answer scores 0.0. The `exact_match` reward and
    the `exact_match` evaluation metric both score with this function.

    >>> exact_match_score("<answer>(B)</answer>", "B"), exact_match_score("Paris.", "paris")
    (1.0, 1.0)
    """
    answer = normalize_text(extract_answer(completion))
    return float(bool(answer) and answer in {normalize_text(g) for g in gold_texts(solution)})


@register_reward("exact_match")
def exact_match(completions: list[str], solution: list, **columns) -> list[float]:
    """`exact_match`: `exact_match_score` of each completion against its solution.

    >>> exact_match(["<answer>(B)</answer>", "<answer>b</answer>", "<answer> </answer>", "Paris."],
    ...             solution=["B", ["a", "B"], [""], "paris"])
    [1.0, 1.0, 0.0, 1.0]
    """
    return [exact_match_score(completion, gold) for completion, gold in zip(completions, solution, strict=True)]


def make_soft_overlong(max_completion_length: int, cache_length: int):
    """DAPO's soft overlong punishment, from token counts: 0 up to `max_completion_length -
    cache_length` tokens, then falling linearly to -1 at `max_completion_length`, -1 beyond.

    Reads the `completion_ids` column (token ids per completion, as TRL passes them).

    >>> soft_overlong = make_soft_overlong(max_completion_length=10, cache_length=4)
    >>> soft_overlong(["", "", "", ""], completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 12])
    [0.0, -0.5, -1.0, -1.0]
    """
    if not 0 < cache_length <= max_completion_length:
        raise ValueError(
            f"need 0 < cache_length <= max_completion_length, got {cache_length}, {max_completion_length}"
        )
    threshold = max_completion_length - cache_length

    def soft_overlong(completions: list[str], completion_ids: list | None = None, **columns) -> list[float]:
        if completion_ids is None:
            raise ValueError("soft_overlong needs the `completion_ids` column (token ids per completion)")
        lengths = [len(ids) for ids in completion_ids]
        return [max(-1.0, min(0.0, (threshold - n) / cache_length)) for n in lengths]

    soft_overlong.reward_name = "soft_overlong"
    return soft_overlong


exact_match.grades = "answers"  # a mixture's rows whose references are boxes are not scored by it (reward_set.task_routes)
