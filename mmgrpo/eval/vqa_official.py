"""The official VQAv2 accuracy, quirks included, and its lenient sibling.

Figures from this metric compare with published VQAv2 numbers. Per question, as the official
script (`vqaEval.py` of the VQA API, Agrawal et al.) computes it:

1. the prediction: newlines and tabs become spaces, ends stripped, then ALWAYS processed:
   punctuation (`process_punctuation`), then lower case, number words, articles and contractions
   (`process_digit_article`);
2. the human answers: ONLY if they are not all identical, punctuation processing and nothing
   else (no lower case, no number words, no whitespace cleaning). When all ten agree they are
   compared as written: "two" never matches ten "two"s (the prediction became "2");
3. each human answer is left out in turn; against the other nine, the prediction scores
   min(1, exact matches / 3); the score is the mean of the ten.

The quirks kept (they change scores, so they stay):
- the period rule's regex is written `(?!<=\\d)(\\.)(?!\\d)`: a look-AHEAD for "<=", so it never
  looks behind; every period not followed by a digit goes ("3." -> "3", "a.m." -> "am", "2.5" stays);
- that substitution gets `re.UNICODE` (= 32) where `count` goes: at most 32 periods are removed;
- a punctuation mark is deleted (not spaced) if that mark touches a space anywhere in the
  ORIGINAL text, or the text has a digit-comma-digit anywhere ("1,000"; then every mark is deleted);
- "none" maps to "0" like the number words; apostrophes, colons and periods are not in the
  punctuation list;
- the contraction table's keys with capitals ("Im", "Ive", "Id've") never match after
  lower-casing, and "somebody'd" maps to "somebodyd": the table is the official one, as written;
- human answers are compared case-sensitively ("Yes" among them never matches; VQAv2's
  annotations are lower case already).

What the script never sees, decided here: the prediction graded is the answer part of a
completion (`<answer>...</answer>`, as every metric); a sample with a single reference string
counts as ten humans who gave it; with answer dicts `{"answer": ...}` only the text is read.
This is the `vqav2_accuracy` metric. The `vqa_accuracy` metric is the `vqa_accuracy` reward's
lenient score (both sides always processed): one name, one score, in training and in evaluation.

    >>> official_vqa_accuracy("Two.", ["2"] * 10)        # the prediction is always processed
    1.0
    >>> official_vqa_accuracy("two", ["two"] * 10)       # the humans' words are not, when they agree
    0.0
    >>> official_vqa_accuracy("two", ["2"] * 9 + ["2."])  # they disagree: punctuation only
    1.0
"""

from __future__ import annotations

import re

from mmgrpo.eval.metrics import MetricValues, answer_text, register_metric
from mmgrpo.rewards.vqa import ARTICLES, CONTRACTIONS, NUMBER_WORDS, PUNCTUATION

# `(?!<=\d)` is a look-ahead (as written officially), so only "not followed by a digit" applies.
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
_OFFICIAL_PERIOD_COUNT = int(re.UNICODE)  # the official call passes re.UNICODE as `count`: 32


def clean_whitespace(text: str) -> str:
    return text.replace("\n", " ").replace("\t", " ").strip()


def process_punctuation(text: str) -> str:
    """The official punctuation step.

    >>> process_punctuation("black-and-white"), process_punctuation("black - white")
    ('black and white', 'black  white')
    >>> process_punctuation("1,000 (approx)"), process_punctuation("3."), process_punctuation("2.5")
    ('1000 approx', '3', '2.5')
    >>> len(process_punctuation("." * 40))   # only 32 periods are removed
    8
    """
    out = text
    has_digit_comma = _COMMA_STRIP.search(text) is not None
    for mark in PUNCTUATION:
        if (mark + " ") in text or (" " + mark) in text or has_digit_comma:
            out = out.replace(mark, "")
        else:
            out = out.replace(mark, " ")
    return _PERIOD_STRIP.sub("", out, count=_OFFICIAL_PERIOD_COUNT)


def process_digit_article(text: str) -> str:
    """The official word step: lower-case, number words to digits, articles out, contractions restored.

    >>> process_digit_article("The Two dogs"), process_digit_article("dont know"), process_digit_article("none")
    ('2 dogs', "don't know", '0')
    """
    words = [NUMBER_WORDS.get(word, word) for word in text.lower().split()]
    words = [CONTRACTIONS.get(word, word) for word in words if word not in ARTICLES]
    return " ".join(words)


def official_vqa_accuracy(prediction: str, answers) -> float:
    """One question's accuracy against its human answers (usually ten).

    >>> ten = ["red"] * 3 + ["blue"] * 7
    >>> official_vqa_accuracy("RED", ten)   # 3 matches: leaving one of them out leaves 2 -> (3 * 2/3 + 7 * 1) / 10
    0.9
    >>> official_vqa_accuracy("blue.", ten), official_vqa_accuracy("red", ["Red"] * 10)
    (1.0, 0.0)
    """
    prediction = process_digit_article(process_punctuation(clean_whitespace(prediction)))
    answers = list(answers)
    if len(set(answers)) > 1:
        answers = [process_punctuation(answer) for answer in answers]
    matches = [answer == prediction for answer in answers]
    # leave-one-out: the official loop drops each answer record (distinct ids) in turn
    per_left_out = [min(1.0, (sum(matches) - left_out) / 3) for left_out in matches]
    return sum(per_left_out) / len(per_left_out) if per_left_out else 0.0


def human_answers(solution) -> list[str]:
    """A `solution` cell as the list of human answers (a lone string: ten humans who gave it).

    >>> human_answers([{"answer": "yes"}, "no"]), human_answers("cat")[:2]
    (['yes', 'no'], ['cat', 'cat'])
    """
    if isinstance(solution, (list, tuple)):
        return [str(item["answer"] if isinstance(item, dict) else item) for item in solution]
    return [str(solution)] * 10


@register_metric("vqav2_accuracy", needs=("solution",))
def vqav2_accuracy(completions, solution, **_):
    """The official VQAv2 accuracy of each sample's completions (mean over its k completions)."""
    scores = [
        sum(official_vqa_accuracy(answer_text(c), human_answers(ref)) for c in sample) / len(sample)
        for sample, ref in zip(completions, solution)
    ]
    return MetricValues({"vqav2_accuracy": scores})


@register_metric("vqa_accuracy", needs=("solution",))
def vqa_accuracy(completions, solution, **_):
    """The `vqa_accuracy` reward as a metric, the same name for the same score: both sides always
    normalised, one reference by exact match."""
    from mmgrpo.rewards.vqa import vqa_soft_accuracy

    scores = [
        sum(vqa_soft_accuracy(answer_text(c), human_answers(ref) if isinstance(ref, (list, tuple)) else ref)
            for c in sample) / len(sample)
        for sample, ref in zip(completions, solution)
    ]
    return MetricValues({"vqa_accuracy": scores})
