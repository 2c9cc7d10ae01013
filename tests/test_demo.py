"""The embedded demo end to end, shrunk: every stage runs and leaves its files."""

import json

import pytest

from mmgrpo.demo import main as demo_main


@pytest.mark.slow
def test_demo_smoke_run_writes_evals_comparisons_and_report(tmp_path):
    out = tmp_path / "demo"
    demo_main(["--output_dir", str(out), "--sft_steps", "2", "--grpo_steps", "2", "--eval_limit", "8"])
    for stage in ("eval_sft", "eval_grpo"):
        for name in ("shapes-color", "shapes-count", "shapes-ground"):
            result = json.loads((out / stage / name / "eval.json").read_text())
            assert len(result["samples"]) == 8
    comparison = json.loads((out / "compare" / "shapes-ground.json").read_text())
    assert {row["metric"] for row in comparison["metrics"]} >= {"iou", "iou_acc@0.5"}
    assert (out / "grpo" / "report.html").stat().st_size > 10_000
    assert (out / "grpo" / "checkpoint-2" / "model.safetensors").exists()
