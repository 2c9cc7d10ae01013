"""The embedded demo end to end, shrunk: every stage runs and leaves its files."""

import json

import pytest
import yaml

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
    # two SFT stages, the second from the first's model, evaluated towards its colour target
    stage2 = yaml.safe_load((out / "sft-2" / "config.yaml").read_text())
    assert stage2["model"]["model"] == str(out / "sft-1" / "final")
    logged = [json.loads(line) for line in (out / "sft-2" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/vqa_accuracy" in logged[-1]  # the last step is evaluated (and checked against --stop_at)
    grpo = yaml.safe_load((out / "grpo" / "config.yaml").read_text())
    assert grpo["model"]["model"] == str(out / "sft-2" / "final")
