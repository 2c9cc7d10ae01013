"""Eval metrics: pass@k against hand-computed values, library reference values (sacrebleu's own
README example, a hand ROUGE-L case, CIDEr against pycocoevalcap), IoU through the real
`iou` reward, rewards as metrics, and the errors a user sees."""

import math
from fractions import Fraction

import pytest

from mmgrpo.errors import ConfigError
from mmgrpo.eval import metrics as metrics_module
from mmgrpo.eval.metrics import get_metric, mean_at_k, pass_at_k, score_batch

# ---------------------------------------------------------------- pass@k, mean@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (2, 1, 1, 0.5),  # the documented example
        (3, 1, 2, 2 / 3),  # 1 - C(2,2)/C(3,2) = 1 - 1/3
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (10, 3, 1, 0.3),  # pass@1 = c / n
        (5, 0, 3, 0.0),
        (5, 3, 3, 1.0),  # n - c < k: every 3-subset holds a correct one
        (5, 5, 5, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    # C(2000, 1000) has about 600 digits; the product form never forms it
    exact = 1 - Fraction(math.comb(1990, 1000), math.comb(2000, 1000))
    assert pass_at_k(2000, 10, 1000) == pytest.approx(float(exact), rel=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_mean_at_k():
    assert mean_at_k([1.0, 0.0, 1.0, 1.0], 4) == 0.75
    with pytest.raises(ValueError):
        mean_at_k([1.0], 2)


def test_pass_at_k_metric_reports_powers_of_two_and_n():
    completions = [["a", "b", "c"], ["x", "x", "x"]]  # sample 0: 1 of 3 correct, sample 1: none
    values = get_metric("pass_at_k").fn(completions, solution=["b", "a"])
    assert values.scores == {
        "pass@1": [pytest.approx(1 / 3), 0.0],
        "pass@2": [pytest.approx(2 / 3), 0.0],
        "pass@3": [1.0, 0.0],
    }
    assert get_metric("mean_at_k").fn(completions, solution=["b", "a"]).scores == {
        "mean@3": [pytest.approx(1 / 3), 0.0]
    }


def test_pass_at_named_k_needs_enough_samples():
    with pytest.raises(ConfigError, match=r"pass@5.*--num_samples >= 5"):
        get_metric("pass@5").fn([["a", "b"]], solution=["a"])


# ---------------------------------------------------------------- text metrics


def test_exact_match_reads_the_answer_part_and_normalises():
    completions = [
        ["<think>it is red</think><answer> Red. </answer>"],
        ["blue"],
        ["Two  Cats", "three cats"],  # k = 2: the mean over completions
        ["42"],
    ]
    solution = ["red", "green", "two cats", ["41", "42"]]  # a list: any reference counts
    assert get_metric("exact_match").fn(completions, solution=solution).scores == {
        "exact_match": [1.0, 0.0, 0.5, 1.0]
    }


def test_corpus_bleu_matches_sacrebleu_readme_example():
    # sacrebleu's README: "BLEU = 48.53 82.4/50.0/45.5/37.5 (BP = 0.943 ...)"
    hypotheses = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
    references = [
        ["The dog bit the man.", "The dog had bit the man."],
        ["It was not unexpected.", "No one was surprised."],
        ["The man bit him first.", "The man had bitten the dog."],
    ]
    values = get_metric("bleu").fn([[h] for h in hypotheses], solution=references)
    assert round(values.corpus["bleu"], 2) == 48.53
    assert values.scores["sentence_bleu"][0] == pytest.approx(100.0)  # an exact copy of a reference
    assert all(0.0 <= s < 100.0 for s in values.scores["sentence_bleu"][1:])


def test_corpus_bleu_with_different_numbers_of_references():
    values = get_metric("bleu").fn(
        [["a cat sat on the mat"], ["the dog ran"]],
        solution=["a cat sat on the mat", ["the dog ran", "a dog ran"]],
    )
    assert values.corpus["bleu"] == pytest.approx(100.0)


def test_rouge_l_hand_case():
    # LCS("the cat on the mat", "the cat sat on the mat") = 5 tokens: P = 5/5, R = 5/6, F = 10/11
    values = get_metric("rouge_l").fn(
        [["the cat on the mat"], ["completely different"]],
        solution=["the cat sat on the mat", "the cat sat on the mat"],
    )
    assert values.scores["rouge_l"] == [pytest.approx(10 / 11), 0.0]


def test_cider_runs_offline_and_matches_pycocoevalcap():
    from pycocoevalcap.cider.cider import Cider

    references = [
        ["a red square on a white background", "a red box"],
        ["two blue circles", "a pair of blue circles"],
        ["a green triangle", "one green triangle on white"],
        ["a yellow star", "a star in yellow"],
    ]
    predictions = ["a red square", "two blue circles", "a purple elephant", "A yellow star!"]
    values = get_metric("cider").fn([[p] for p in predictions], solution=references)
    scores = values.scores["cider"]
    assert len(scores) == 4 and all(math.isfinite(s) for s in scores)
    assert scores[2] == pytest.approx(0.0, abs=1e-9)  # no shared n-gram
    assert scores[1] > scores[0] > 0.0
    # the same numbers as pycocoevalcap called directly on the same (already tokenized) text
    gts = {str(i): refs for i, refs in enumerate(references)}
    res = {str(i): [p.lower().rstrip("!")] for i, p in enumerate(predictions)}
    _, direct = Cider().compute_score(gts, res)
    assert scores == pytest.approx(list(direct))


# ---------------------------------------------------------------- IoU and rewards as metrics


def test_iou_metric_uses_the_iou_reward():
    completions = [["<answer>[0, 0, 10, 10]</answer>"], ["[0, 0, 10, 2]"], ["no box"], ["[0, 0, 10, 5]"]]
    solution = [[0, 0, 10, 5]] * 4  # IoUs 0.5, 0.4, 0 (no box), 1.0
    scores = score_batch([get_metric("iou")], completions, {"solution": solution}, ["a", "b", "c", "d"])
    assert scores["iou"] == [pytest.approx(0.5), pytest.approx(0.4), 0.0, 1.0]
    assert scores["iou_acc@0.5"] == [1.0, 0.0, 0.0, 1.0]


def test_iou_metric_maps_model_boxes_through_to_image_box():
    double = lambda box: [2 * v for v in box]  # noqa: E731  (model coordinates are half-size)
    scores = score_batch(
        [get_metric("iou")],
        [["[0, 0, 5, 5]", "[0, 0, 5, 10]"]],
        {"solution": [[0, 0, 10, 10]], "to_image_box": [double]},
        ["a"],
    )
    assert scores == {"iou": [0.75], "iou_acc@0.5": [1.0]}  # IoUs 1.0 and 0.5: mean over k = 2


def test_iou_without_a_box_solution_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'iou' needs the dataset field 'solution'.*'ds/test/0'"):
        score_batch([get_metric("iou")], [["[0, 0, 1, 1]"]], {"answer": ["cat"]}, ["ds/test/0"])
    with pytest.raises(ConfigError, match=r"'iou' needs a box `solution`.*'ds/test/1'.*'cat'"):
        score_batch(
            [get_metric("iou")],
            [["[0, 0, 1, 1]"]] * 2,
            {"solution": [[0, 0, 2, 2], "cat"]},
            ["ds/test/0", "ds/test/1"],
        )


def test_a_registered_reward_is_a_per_sample_metric(monkeypatch):
    calls = []

    def length_reward(completions, solution, **columns):
        calls.append((list(completions), list(solution)))
        return [None if c == "skip" else float(len(c)) for c in completions]

    monkeypatch.setattr(metrics_module, "_get_reward", lambda name: length_reward)
    metric = get_metric("reward:length")
    scores = metric.fn([["ab", "abcd"], ["skip", "a"], ["skip", "skip"]], solution=["x", "y", "z"]).scores
    assert scores == {"length": [3.0, 1.0, None]}
    # the reward saw the flat completions, each column repeated per completion (contiguous)
    assert calls == [(["ab", "abcd", "skip", "a", "skip", "skip"], ["x", "x", "y", "y", "z", "z"])]


def test_pass_at_k_with_a_reward_judge(monkeypatch):
    monkeypatch.setattr(
        metrics_module,
        "_get_reward",
        lambda name: lambda completions, **_: [1.0 if c == "ok" else 0.0 for c in completions],
    )
    assert get_metric("pass@2:judge").fn([["ok", "no", "no"]], solution=["-"]).scores == {
        "pass@2": [pytest.approx(2 / 3)]
    }


def test_real_reward_names_work_as_metrics():
    scores = get_metric("iou@0.5").fn([["[0, 0, 10, 10]", "none"]], solution=[[0, 0, 10, 10]]).scores
    assert scores == {"iou@0.5": [0.5]}


def test_unknown_metric_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown metric 'bleu4'.*exact_match.*rouge_l"):
        get_metric("bleu4")


def test_exact_match_reward_and_metric_agree():
    """The `exact_match` reward in training and the `exact_match` metric in evaluation score the
    same completion against the same solution alike (one function: rewards.text.exact_match_score)."""
    from mmgrpo.eval.metrics import get_metric
    from mmgrpo.rewards import exact_match

    cases = [("<answer>(B)</answer>", "B"), ("paris", "Paris"), ("<answer>Paris.</answer>", "paris"),
             ("<answer> </answer>", ""), ("the red car", "red car"), ("<think>x</think>42", "42"),
             ("<answer>b</answer>", ["a", "B"]), ("Lyon", "Nice")]  # fmt: skip
    completions, solutions = [c for c, _ in cases], [s for _, s in cases]
    rewards = exact_match(completions, solution=solutions)
    metric = get_metric("exact_match").fn([[c] for c in completions], solution=solutions).scores["exact_match"]
    assert rewards == metric == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
