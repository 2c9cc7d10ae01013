"""VQAv2 soft accuracy as a reward: the official answer normalisation, applied leniently.

The normalisation steps are the official VQA evaluation script's:
1. newlines and tabs become spaces, surrounding whitespace is stripped;
2. punctuation: each of `; / [ ] " { } ( ) = + \\ _ - > < @ ` , ? !` is deleted if it touches a
   space somewhere in the text (or the text has a digit,digit comma like "1,000"), else replaced
   by a space; a period is deleted unless a digit follows it, which keeps decimals like 3.5
   (the official regex means "(?<!\\d)" but is written "(?!<=\\d)", so it never looks behind);
   apostrophes and colons are kept;
3. lower-case; the words none, zero ... ten become 0 ... 10; the articles a, an, the are dropped;
4. contractions written without the apostrophe are restored from the official table
   (dont -> don't, whats -> what's).

The score is lenient, so it is a denser training signal than the official one and its figures
are not published VQAv2 numbers (the `vqav2_accuracy` metric, mmgrpo/eval/vqa_official.py, is).

Where we differ from the script, deliberately:
- the script normalises only when the human answers disagree (when all ten agree it compares
  raw strings, lower-cased); we always normalise the prediction and every reference, so "Two."
  scores like "2" whatever the references;
- a single reference answer is graded by exact match (the leave-one-out mean needs several).
"""

from __future__ import annotations

import re

from mmgrpo.rewards.reward_funcs import register_reward
from mmgrpo.rewards.text import extract_answer, gold_texts

# The official table, as written (keys with capitals never match after lower-casing, and
# "somebody'd" maps to "somebodyd": both are kept so our scores equal the official ones).
CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've",
    "hasnt": "hasn't", "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've",
    "hes": "he's", "howd": "how'd", "howll": "how'll", "hows": "how's", "Id've": "I'd've",
    "I'dve": "I'd've", "Im": "I'm", "Ive": "I've", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've",
    "it'dve": "it'd've", "itll": "it'll", "let's": "let's", "maam": "ma'am", "mightnt": "mightn't",
    "mightnt've": "mightn't've", "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't",
    "mustve": "must've", "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't",
    "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd",
    "someoned've": "someone'd've", "someone'dve": "someone'd've", "someonell": "someone'll",
    "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's",
    "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're",
    "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll",
    "whyre": "why're", "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll",
    "y'allll": "y'all'll", "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    "youd": "you'd", "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll",
    "youre": "you're", "youve": "you've",
}  # fmt: skip
NUMBER_WORDS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
    "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
ARTICLES = {"a", "an", "the"}
PUNCTUATION = [
    ";",
    "/",
    "[",
    "]",
    '"',
    "{",
    "}",
    "(",
    ")",
    "=",
    "+",
    "\\",
    "_",
    "-",
    ">",
    "<",
    "@",
    "`",
    ",",
    "?",
    "!",
]

_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
_PERIOD_NOT_BEFORE_DIGIT = re.compile(r"\.(?!\d)")


def _process_punctuation(text: str) -> str:
    # Decided on the text as it came in, one mark at a time, as the official script does.
    has_digit_comma = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for mark in PUNCTUATION:
        touches_space = (mark + " ") in text or (" " + mark) in text
        out = out.replace(mark, "" if touches_space or has_digit_comma else " ")
    return _PERIOD_NOT_BEFORE_DIGIT.sub("", out)


def _process_words(text: str) -> str:
    words = [NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [CONTRACTIONS.get(w, w) for w in words if w not in ARTICLES]
    return " ".join(words)


def normalize_vqa_answer(text: str) -> str:
    """The official VQAv2 answer normalisation (see the module docstring).

    >>> normalize_vqa_answer("Two dogs.")
    '2 dogs'
    >>> normalize_vqa_answer("3.5"), normalize_vqa_answer("The answer is 3.")
    ('3.5', 'answer is 3')
    >>> normalize_vqa_answer("dont know"), normalize_vqa_answer("An apple")
    ("don't know", 'apple')
    >>> normalize_vqa_answer("black-and-white"), normalize_vqa_answer("black - white")
    ('black and white', 'black white')
    >>> normalize_vqa_answer("1,000")
    '1000'
    """
    text = text.replace("\n", " ").replace("\t", " ").strip()
    return _process_words(_process_punctuation(text))


def vqa_soft_accuracy(prediction: str, answers) -> float:
    """VQAv2 accuracy of one prediction against its human answers.

    Several answers: the mean over leave-one-out subsets (each answer left out in turn) of
    min(1, matches among the others / 3). One answer: exact match. Both sides normalised; an
    empty prediction scores 0.0.

    >>> ten = ["2"] * 2 + ["3"] * 8
    >>> vqa_soft_accuracy("two", ten)  # 2 of 10 match: (2 * 1/3 + 8 * 2/3) / 10
    0.6
    >>> vqa_soft_accuracy("3", ten), vqa_soft_accuracy("4", ten)
    (1.0, 0.0)
    >>> vqa_soft_accuracy("Yes.", "yes"), vqa_soft_accuracy("", [""])
    (1.0, 0.0)
    """
    prediction = normalize_vqa_answer(prediction)
    if not prediction:
        return 0.0
    golds = [normalize_vqa_answer(a) for a in (answers if isinstance(answers, (list, tuple)) else [answers])]
    if not golds:
        return 0.0
    if len(golds) == 1:
        return float(prediction == golds[0])
    matches = sum(g == prediction for g in golds)
    # Leaving out a matching answer leaves matches - 1 among the others, any other leaves matches.
    # Summed in thirds as integers so that e.g. 18/30 is exactly the float 0.6.
    thirds = [min(3, matches - (g == prediction)) for g in golds]
    return sum(thirds) / (3 * len(golds))


@register_reward("vqa_accuracy")
def vqa_accuracy(completions: list[str], solution: list, **columns) -> list[float]:
    """`vqa_accuracy`: VQAv2 soft accuracy of the answer part against `solution`.

    `solution` per sample: the human answers (a list of strings or of `{"answer": ...}` dicts,
    ten in VQAv2) or one reference string (exact match after normalisation).

    >>> ten = ["two"] * 2 + ["three"] * 8
    >>> vqa_accuracy(["<think>count</think><answer>2</answer>", "Three.", "<answer></answer>"], solution=[ten] * 3)
    [0.6, 1.0, 0.0]
    """
    return [
        vqa_soft_accuracy(extract_answer(c), gold_texts(s))
        for c, s in zip(completions, solution, strict=True)
    ]


vqa_accuracy.grades = "answers"  # a mixture's rows whose references are boxes are not scored by it (reward_set.task_routes)
