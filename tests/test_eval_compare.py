"""A/B statistics: McNemar against scipy and a hand count, bootstrap and permutation on synthetic
paired data with a known real difference and with none, reproducibility, speed, and the
comparison tables."""

import json
import time

import numpy as np
import pytest
from scipy.stats import binomtest

from mmgrpo.errors import ConfigError
from mmgrpo.eval.compare import HEADER, compare, compare_markdown, print_compare, write_compare
from mmgrpo.eval.stats import mcnemar_exact, paired_bootstrap_ci, sign_flip_test


def _paired_table(both_wrong, only_b, only_a, both_right):
    a = [0] * both_wrong + [0] * only_b + [1] * only_a + [1] * both_right
    b = [0] * both_wrong + [1] * only_b + [0] * only_a + [1] * both_right
    return a, b


def test_mcnemar_exact_on_a_hand_made_table():
    a, b = _paired_table(both_wrong=10, only_b=8, only_a=2, both_right=30)
    p = mcnemar_exact(a, b)
    # 10 discordant pairs, 2 of them for A: 2 * P(X <= 2), X ~ Bin(10, 1/2) = 2 * 56 / 1024
    assert p == pytest.approx(2 * 56 / 1024)
    assert p == pytest.approx(binomtest(2, 10, 0.5).pvalue)
    assert mcnemar_exact(b, a) == pytest.approx(p)  # symmetric
    assert mcnemar_exact([1, 0, 1], [1, 0, 1]) == 1.0  # no discordant pair


@pytest.mark.parametrize("only_b, only_a", [(15, 3), (7, 7), (0, 9), (40, 25)])
def test_mcnemar_exact_equals_scipy_binomtest(only_b, only_a):
    a, b = _paired_table(5, only_b, only_a, 5)
    assert mcnemar_exact(a, b) == pytest.approx(binomtest(only_a, only_a + only_b, 0.5).pvalue)


def _eval(name, scores_by_metric, ids=None, wall_time_s=100.0):
    n = len(next(iter(scores_by_metric.values())))
    ids = ids or [f"ds/test/{i}" for i in range(n)]
    samples = [
        {
            "id": ids[i],
            "modality": "image",
            "prompt": "",
            "completions": [""],
            "scores": {m: float(v[i]) for m, v in scores_by_metric.items()},
        }
        for i in range(n)
    ]
    return {
        "model": name,
        "dataset": "ds",
        "split": "test",
        "config": {},
        "metrics": {},
        "per_modality": {},
        "wall_time_s": wall_time_s,
        "samples": samples,
    }


def _row(result, metric):
    return next(r for r in result["metrics"] if r["metric"] == metric)


def test_a_real_difference_is_significant():
    rng = np.random.default_rng(1)
    n = 500
    a = rng.normal(0.5, 0.1, n)
    b = a + 0.05 + rng.normal(0, 0.05, n)  # B is better by 0.05 on average
    correct_a = (rng.random(n) < 0.5).astype(float)
    correct_b = correct_a.copy()
    correct_b[(correct_a == 0) & (rng.random(n) < 0.3)] = 1.0  # B fixes some, breaks none
    result = compare(_eval("A", {"score": a, "acc": correct_a}), _eval("B", {"score": b, "acc": correct_b}))

    score = _row(result, "score")
    assert score["test"] == "sign_flip_permutation"
    assert score["p"] < 0.01
    assert 0 < score["ci_low"] < 0.05 < score["ci_high"]
    assert score["diff"] == pytest.approx(float(np.mean(b - a)))
    acc = _row(result, "acc")
    assert acc["test"] == "mcnemar_exact" and acc["p"] < 0.01 and acc["ci_low"] > 0


def test_no_difference_is_not_significant():
    rng = np.random.default_rng(2)
    n = 500
    a = rng.normal(0.5, 0.1, n)
    b = a + rng.normal(0, 0.05, n)  # same mean
    correct_a = (rng.random(n) < 0.5).astype(float)
    correct_b = np.where(rng.random(n) < 0.1, 1 - correct_a, correct_a)  # random flips both ways
    result = compare(_eval("A", {"score": a, "acc": correct_a}), _eval("B", {"score": b, "acc": correct_b}))
    for metric in ("score", "acc"):
        row = _row(result, metric)
        assert row["p"] > 0.05, row
        assert row["ci_low"] < 0 < row["ci_high"], row


def test_results_are_reproducible_from_the_seed():
    rng = np.random.default_rng(3)
    a, b = rng.random(200), rng.random(200)
    one = compare(_eval("A", {"s": a}), _eval("B", {"s": b}), seed=7)
    two = compare(_eval("A", {"s": a}), _eval("B", {"s": b}), seed=7)
    other = compare(_eval("A", {"s": a}), _eval("B", {"s": b}), seed=8)
    assert one == two
    assert _row(one, "s")["ci_low"] != _row(other, "s")["ci_low"]
    # a metric's numbers do not depend on the other metrics compared beside it
    with_more = compare(_eval("A", {"s": a, "t": a}), _eval("B", {"s": b, "t": b}), seed=7)
    assert _row(with_more, "s") == _row(one, "s")


def test_ten_thousand_resamples_of_500_samples_take_well_under_a_second():
    rng = np.random.default_rng(4)
    a, b = rng.random(500), rng.random(500)
    start = time.process_time()
    paired_bootstrap_ci(a, b, n_boot=10_000, seed=0)
    sign_flip_test(a, b, n_perm=10_000, seed=0)
    assert time.process_time() - start < 1.0


def test_permutation_p_for_a_tiny_all_positive_sample():
    # 6 positive differences: only the identity and the all-flipped of 64 sign patterns are as
    # extreme, so the exact two-sided p is 2/64
    p = sign_flip_test([0] * 6, [1, 2, 1, 3, 2, 1], n_perm=20_000, seed=0)
    assert p == pytest.approx(2 / 64, abs=0.005)


def test_different_sample_sets_are_an_error():
    a = _eval("A", {"s": [1, 2, 3, 4]})
    b = _eval("B", {"s": [1, 2, 3, 4]}, ids=["ds/test/0", "ds/test/1", "ds/test/7", "ds/test/9"])
    with pytest.raises(ConfigError, match=r"4 ids differ.*'ds/test/2'.*'ds/test/7'"):
        compare(a, b)


def test_none_scores_are_dropped_pairwise_and_one_sided_metrics_listed():
    a = _eval("A", {"s": [1.0, 2.0, 3.0], "only_a": [1, 1, 1]})
    b = _eval("B", {"s": [2.0, 3.0, 4.0]})
    b["samples"][1]["scores"]["s"] = None
    result = compare(a, b)
    row = _row(result, "s")
    assert row["n"] == 2 and row["diff"] == 1.0
    assert result["not_compared"] == ["only_a"]


def test_markdown_json_and_console_tables(tmp_path):
    rng = np.random.default_rng(5)
    a, b = rng.random(50), rng.random(50)
    result = compare(
        _eval("base", {"s": a}, wall_time_s=120.0), _eval("grpo", {"s": b}, wall_time_s=90.5), n_boot=2000
    )
    markdown = compare_markdown(result)
    assert HEADER == "| metric | A (baseline) | B | diff [95% CI] | p |"
    assert HEADER in markdown.splitlines()
    row = _row(result, "s")
    assert f"| s | {row['a']:.4g} | {row['b']:.4g} | {row['diff']:+.4g} [" in markdown
    assert "| eval wall time (s) | 120 | 90.5 | -29.5 |" in markdown

    json_path, markdown_path = write_compare(result, tmp_path / "out")
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(result))
    assert markdown_path.read_text() == markdown

    from rich.console import Console

    console = Console(record=True, width=160)
    print_compare(result, console=console)
    text = console.export_text()
    assert "diff [95% CI]" in text and "grpo" in text and "eval wall time" in text


def test_compare_reads_eval_directories(tmp_path):
    for name, values in (("a", [0, 1, 1]), ("b", [1, 1, 1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(json.dumps(_eval(name, {"acc": values})))
    result = compare(tmp_path / "a", tmp_path / "b/eval.json")
    assert _row(result, "acc")["diff"] == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match="eval.json not found"):
        compare(tmp_path / "a", tmp_path / "missing")
