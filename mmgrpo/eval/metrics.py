"""Evaluation metrics over per-sample completions and references, registered by name.

A metric takes the completions of a batch of samples and their dataset columns, and returns
one score per sample (plus, for corpus-level metrics, whole-set values):

    metric.fn(completions: list[list[str]], **columns) -> MetricValues
        completions[i] = the k completions generated for sample i
        columns["solution"][i] = sample i's reference (str, list of str, a box ...)

With k > 1 completions a sample's score is the mean over its completions. The per-sample
scores are what `mmgrpo compare` pairs for its bootstrap and tests.

Text metrics look at the answer part of a completion, as the rewards do: the first
`<answer>...</answer>`, else the text after `</think>`, else the whole completion.

Names `--metrics` accepts (`get_metric`):
    exact_match  rouge_l  bleu  cider  iou  pass_at_k  mean_at_k
    vqav2_accuracy (the official VQAv2 script)  vqa_accuracy (the reward's lenient score)   (vqa_official.py)
    map (COCO AP@[.5:.95] and map50 over several boxes)               (detection.py)
    pass@K, mean@K           pass@K over K completions (--num_samples >= K)
    pass@K:JUDGE             JUDGE = exact_match (default) or a reward name
    reward:NAME or NAME      any registered reward, as the mean reward per sample

    >>> m = get_metric("exact_match")
    >>> m.fn([["<answer>Paris</answer>"], ["Lyon"]], solution=["paris", "Nice"]).scores
    {'exact_match': [1.0, 0.0]}
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from mmgrpo.errors import ConfigError, MMGRPOError
from mmgrpo.registry import Registry

# A completion counts as correct for pass@k / mean@k when its judge score is at least this
# (exact_match and accuracy-style rewards give 0 or 1; IoU >= 0.5 is the usual grounding hit).
CORRECT_THRESHOLD = 0.5


@dataclass
class MetricValues:
    """What a metric returns for a set of samples."""

    scores: dict[str, list[float | None]]  # per-sample scores, one list per score name
    corpus: dict[str, float] = field(default_factory=dict)  # whole-set values that are not means


@dataclass(frozen=True)
class Metric:
    name: str
    fn: Callable[..., MetricValues]  # fn(completions: list[list[str]], **columns)
    needs: tuple[str, ...] = ()  # dataset columns the metric reads; absent -> ConfigError
    # True: scored once over the whole set when the eval finishes (CIDEr's idf and corpus BLEU
    # depend on every sample), from the stored completions and `solution`s.
    corpus: bool = False
    needs_box: bool = False  # `solution` must be a box [x1, y1, x2, y2]
    # keeps(completions of one sample, its columns) -> dict stored in samples.jsonl under "kept", whose
    # keys reach the corpus metric as columns: what it needs that cannot be stored raw (mapped boxes)
    keeps: Callable[[list[str], dict], dict] | None = None


METRICS = Registry("metric", flag="--metrics")


def register_metric(name: str, *, needs: tuple[str, ...] = (), corpus: bool = False, needs_box=False, keeps=None):
    """Register `fn(completions, **columns) -> MetricValues` under `name` (a duplicate is an error)."""

    def decorator(fn):
        METRICS.register(name, Metric(name, fn, needs, corpus, needs_box, keeps))
        return fn

    return decorator


def metric_names() -> list[str]:
    return METRICS.names()


def get_metric(spec: str) -> Metric:
    """The metric named `spec` (see the module docstring for the forms); unknown -> ConfigError."""
    if spec in METRICS:
        return METRICS.get(spec)
    if match := re.fullmatch(r"(pass|mean)@(\d+)(?::(.+))?", spec):
        kind, k, judge = match.group(1), int(match.group(2)), match.group(3) or "exact_match"
        if k < 1:
            raise ConfigError(f"metric {spec!r}: k must be at least 1")
        return _at_k_metric(kind, k, judge, name=spec)
    name = spec.removeprefix("reward:")
    try:
        return reward_metric(name)
    except (MMGRPOError, KeyError) as error:
        raise ConfigError(
            f"unknown metric {spec!r}: metrics are {', '.join(metric_names())}, pass@K, mean@K, "
            f"or a reward name ({error})"
        ) from None


def check_columns(metric: Metric, columns: dict, ids: list[str]) -> None:
    """ConfigError naming the metric, the missing field and a sample, if a needed column is absent."""
    for name in metric.needs:
        values = columns.get(name)
        missing = [i for i, v in enumerate(values or [None] * len(ids)) if v is None]
        if missing:
            raise ConfigError(
                f"metric {metric.name!r} needs the dataset field {name!r}, but sample {ids[missing[0]]!r} "
                f"has none ({len(missing)} of {len(ids)} in this batch lack it): choose a dataset "
                f"that has {name!r} or drop {metric.name!r} from --metrics"
            )
    if metric.needs_box:
        for sample_id, solution in zip(ids, columns["solution"]):
            if not _is_box(solution):
                raise ConfigError(
                    f"metric {metric.name!r} needs a box `solution` [x1, y1, x2, y2] (original-image "
                    f"pixels), but sample {sample_id!r} has {str(solution)[:80]!r}"
                )


def score_batch(metrics: list[Metric], completions: list[list[str]], columns: dict, ids: list[str]):
    """Per-sample scores of `metrics` on one batch: {score name: [value per sample]}."""
    scores: dict[str, list[float | None]] = {}
    for metric in metrics:
        check_columns(metric, columns, ids)
        scores.update(metric.fn(completions, **columns).scores)
    return scores


# ---------------------------------------------------------------------------------------------
# pass@k and mean@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms the huge binomials
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

    >>> pass_at_k(2, 1, 1)
    0.5
    >>> pass_at_k(4, 1, 2)   # 1 - C(3,2)/C(4,2) = 1 - 3/6
    0.5
    >>> round(pass_at_k(10, 3, 5), 6)   # 1 - C(7,5)/C(10,5) = 1 - 21/252
    0.916667
    >>> pass_at_k(5, 0, 3), pass_at_k(5, 3, 3)   # none correct; every 3-subset holds a correct one
    (0.0, 1.0)
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_at_k(scores: list[float], k: int) -> float:
    """mean@k: the expected mean score of k completions; from n >= k i.i.d. completions the
    unbiased estimate with the least variance is the mean over all n.

    >>> mean_at_k([1.0, 0.0, 1.0, 1.0], 4)
    0.75
    """
    if not 1 <= k <= len(scores):
        raise ValueError(f"mean_at_k needs 1 <= k <= n = {len(scores)}, got k={k}")
    return sum(scores) / len(scores)


def _judge(name: str) -> Callable[[list[str], dict], list[float | None]]:
    """Per-completion score function for pass@k: exact_match or a reward."""
    if name == "exact_match":
        return lambda flat, columns: [_exact(c, s) for c, s in zip(flat, columns["solution"])]
    reward = _get_reward(name)
    return lambda flat, columns: reward(flat, **columns)


def _at_k_metric(kind: str, k: int | None, judge_name: str, name: str) -> Metric:
    judge = _judge(judge_name)

    def fn(completions, **columns):
        n = _num_completions(completions)
        ks = [k] if k is not None else sorted({2**j for j in range(n.bit_length()) if 2**j <= n} | {n})
        if ks[-1] > n:
            raise ConfigError(f"metric {name!r} needs --num_samples >= {ks[-1]}, got {n}")
        flat, flat_columns = _flatten(completions, columns)
        values = judge(flat, flat_columns)
        correct = [v is not None and v >= CORRECT_THRESHOLD for v in values]
        per_sample = [correct[i * n : (i + 1) * n] for i in range(len(completions))]
        if kind == "mean":
            return MetricValues({f"mean@{n if k is None else k}": [mean_at_k(c, n) for c in per_sample]})
        return MetricValues({f"pass@{kk}": [pass_at_k(n, sum(c), kk) for c in per_sample] for kk in ks})

    needs = ("solution",) if judge_name == "exact_match" else ()
    return Metric(name, fn, needs)


METRICS.register("pass_at_k", _at_k_metric("pass", None, "exact_match", "pass_at_k"))  # pass@1, 2, 4 ... n
METRICS.register("mean_at_k", _at_k_metric("mean", None, "exact_match", "mean_at_k"))  # mean@n


# ---------------------------------------------------------------------------------------------
# text metrics


def answer_text(completion: str) -> str:
    """The part of a completion that is graded: the same as the rewards grade in training
    (`mmgrpo.rewards.text.extract_answer`: the first `<answer>...</answer>`, else the text after
    `</think>`, else the whole completion; stripped).

    >>> answer_text("<think>hm</think><answer> 42 </answer>")
    '42'
    """
    from mmgrpo.rewards.text import extract_answer

    return extract_answer(completion)


def _references(solution) -> list[str]:
    return [str(s) for s in solution] if isinstance(solution, list | tuple) else [str(solution)]


def _exact(completion: str, solution) -> float:
    from mmgrpo.rewards.text import exact_match_score

    return exact_match_score(completion, solution)


@register_metric("exact_match", needs=("solution",))
def exact_match(completions, solution, **_):
    """1 if the answer equals a reference (any of a list) as the `exact_match` reward scores it
    (`mmgrpo.rewards.text.exact_match_score`: case, repeated whitespace and edge punctuation,
    quotes and brackets ignored; an empty answer always 0), else 0."""
    return MetricValues({"exact_match": _per_sample(completions, solution, _exact)})


@functools.cache
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


@register_metric("rouge_l", needs=("solution",))
def rouge_l(completions, solution, **_):
    """ROUGE-L F-measure (rouge-score, Porter stemming), 0-1; the best over several references.

    >>> get_metric("rouge_l").fn([["the cat on the mat"]], solution=["the cat sat on the mat"]).scores
    {'rouge_l': [0.9090909090909091]}
    """

    def f(completion, reference):
        refs = _references(reference)
        return _rouge_scorer().score_multi(refs, answer_text(completion))["rougeL"].fmeasure

    return MetricValues({"rouge_l": _per_sample(completions, solution, f)})


@register_metric("bleu", needs=("solution",), corpus=True)
def bleu(completions, solution, **_):
    """sacrebleu BLEU, 0-100: `bleu` is corpus BLEU over every completion (the number papers
    report); `sentence_bleu` is each sample's sentence BLEU (effective order), which the paired
    tests of `mmgrpo compare` use."""
    from sacrebleu.metrics import BLEU

    sentence = BLEU(effective_order=True)
    per_sample = _per_sample(
        completions, solution, lambda c, s: sentence.sentence_score(answer_text(c), _references(s)).score
    )
    hypotheses, references = [], []
    for sample_completions, reference in zip(completions, solution):
        for completion in sample_completions:
            hypotheses.append(answer_text(completion))
            references.append(_references(reference))
    # sacrebleu wants reference streams aligned with the hypotheses; None pads a shorter list.
    width = max(len(r) for r in references)
    streams = [[r[j] if j < len(r) else None for r in references] for j in range(width)]
    corpus_bleu = BLEU().corpus_score(hypotheses, streams).score
    return MetricValues({"sentence_bleu": per_sample}, corpus={"bleu": corpus_bleu})


def _cider_tokens(text: str) -> str:
    # The COCO pipeline tokenizes with Stanford PTBTokenizer (Java); this is the same idea:
    # lower case, words and numbers only, punctuation dropped.
    return " ".join(re.findall(r"[a-z0-9]+(?:'[a-z]+)?", text.lower()))


@register_metric("cider", needs=("solution",), corpus=True)
def cider(completions, solution, **_):
    """CIDEr-D-style consensus score (pycocoevalcap's pure-Python Cider, no Java), usually 0-10.
    Its idf comes from every reference in the set, so it is a corpus metric: a set of a few
    samples gives meaningless values."""
    from pycocoevalcap.cider.cider import Cider

    if not completions:
        return MetricValues({"cider": []})
    references, hypotheses = {}, {}
    for i, (sample_completions, reference) in enumerate(zip(completions, solution)):
        for j, completion in enumerate(sample_completions):
            references[f"{i}:{j}"] = [_cider_tokens(r) for r in _references(reference)]
            hypotheses[f"{i}:{j}"] = [_cider_tokens(answer_text(completion))]
    _, item_scores = Cider().compute_score(references, hypotheses)
    # keys keep insertion order, so the item scores follow the (sample, completion) order
    n = _num_completions(completions)
    per_sample = [float(item_scores[i * n : (i + 1) * n].mean()) for i in range(len(completions))]
    return MetricValues({"cider": per_sample})


# ---------------------------------------------------------------------------------------------
# rewards as metrics


def _get_reward(name: str):
    from mmgrpo.rewards import get_reward  # lazy: the reward registry imports its plugins

    return get_reward(name)


def reward_metric(name: str) -> Metric:
    """A registered reward (or `path/file.py:fn`) as a metric: per sample, the mean of its
    completions' rewards (None rewards skipped; a sample whose rewards are all None scores None)."""
    reward = _get_reward(name)

    def fn(completions, **columns):
        flat, flat_columns = _flatten(completions, columns)
        values = reward(flat, **flat_columns)
        n = _num_completions(completions)
        return MetricValues({name: [_mean(values[i * n : (i + 1) * n]) for i in range(len(completions))]})

    return Metric(name, fn)


@register_metric("iou", needs=("solution",), needs_box=True)
def iou(completions, **columns):
    """Mean IoU of the predicted box with `solution` (from the `iou` reward, so boxes are in
    original-image pixels) and `iou_acc@0.5`, the fraction with IoU >= 0.5. A completion with no
    parsable box scores IoU 0."""
    flat, flat_columns = _flatten(completions, columns)
    values = [0.0 if v is None else float(v) for v in _get_reward("iou")(flat, **flat_columns)]
    n = _num_completions(completions)
    groups = [values[i * n : (i + 1) * n] for i in range(len(completions))]
    return MetricValues(
        {
            "iou": [sum(g) / n for g in groups],
            "iou_acc@0.5": [sum(v >= 0.5 for v in g) / n for g in groups],
        }
    )


# ---------------------------------------------------------------------------------------------
# helpers


def _num_completions(completions: list[list[str]]) -> int:
    counts = {len(c) for c in completions}
    if len(counts) > 1:
        raise ValueError(f"every sample needs the same number of completions, got {sorted(counts)}")
    return counts.pop() if counts else 1


def _flatten(completions: list[list[str]], columns: dict) -> tuple[list[str], dict]:
    """Completions flattened to one list, each column repeated per completion; a sample's k
    completions stay contiguous, as rewards receive them in training."""
    n = _num_completions(completions)
    flat = [c for sample_completions in completions for c in sample_completions]
    return flat, {key: [v for v in values for _ in range(n)] for key, values in columns.items()}


def _per_sample(completions, solution, score_one) -> list[float]:
    return [sum(score_one(c, ref) for c in cs) / len(cs) for cs, ref in zip(completions, solution)]


def _mean(values) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _is_box(value) -> bool:
    """Whether `value` holds a reference box the `iou` reward understands."""
    from mmgrpo.data.boxes import gold_boxes

    try:
        return bool(gold_boxes(value))
    except (ValueError, TypeError):
        return False
