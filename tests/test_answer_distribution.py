"""benchmarks/answer_distribution.py: the per-class answer distributions behind docs/benchmarks.md's
"What a start needs for GRPO to pass the plateau"."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import answer_distribution  # noqa: E402


def test_each_row_is_a_distribution_over_the_dataset_classes_and_the_true_class_is_one_of_them():
    probabilities, truth, classes = answer_distribution.distributions("tiny:qwen2-vl", "shapes-count", 12, "<answer>{}</answer>")
    assert probabilities.shape == (12, len(classes)) and set(classes) <= {"1", "2", "3", "4", "5", "6"}
    np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-5)
    assert (probabilities > 0).all() and truth.min() >= 0 and truth.max() < len(classes)


def test_the_report_names_the_closest_pair(capsys):
    from mmgrpo.runstate.runlog import console

    with console.capture() as captured:
        answer_distribution.main(["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--split", "validation", "--limit", "12"])
    text = captured.get()
    assert "shapes-color:validation" in text and "mean p(true answer)" in text and "closest pairs" in text
    # an untrained model answers every image alike: its closest pair is (nearly) the same row
    closest = text.split("closest pairs")[1].split(":", 1)[1].split(",")[0].split()
    assert float(closest[-1]) < 0.05
