"""benchmarks/gpu_suite.py --dry_run_on_cpu: the GPU suite's code (building the real 3B configuration,
the three systems' worker processes, the figures, `mmgrpo estimate` beside the measured peak, the
media and eval parts, the report) at reduced depth on the CPU, so the suite cannot rot between GPU visits.

    .venv/bin/python -m pytest -q -p no:xdist tests/test_benchmark_gpu_suite.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.xdist_group("real_size")  # three processes in turn, each with the 3B width in memory (2-4 GB)
def test_gpu_suite_dry_run_on_cpu(tmp_path):
    pytest.importorskip("trl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry_run_on_cpu", "--out",
                           str(tmp_path / "out"), "--work_dir", str(tmp_path / "work")],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_suite.json").read_text())
    assert not report["failures"], report["failures"]
    for system in ("mmgrpo", "trl", "mmgrpo-hf"):
        (run,) = report["results"][system]
        assert run["s_per_step"] > 0 and run["peak_memory_gb"] > 0 and 0 < run["mfu"] < 1
        assert set(run["phases"]) == {"rollout", "reward", "reference", "training", "other"}
    assert report["spec"]["shape"]["n_lm_head"] == 151936 * 2048  # the 3B width and vocabulary
    assert report["estimate_gb"] > 0
    assert "step tokens/s" in done.stdout and "mmgrpo estimate:" in done.stdout
    # item 2: media_prep's runs on the same model (its 3B-wide dry-run copy): mmgrpo's workers (TRL's on the GPU)
    media = report["media"]
    assert [(run["label"], run["rows"]) for run in media["runs"]] == [("mmgrpo, 2 workers", "images")]
    (workers,) = media["runs"]
    assert workers["processor_calls"] == 0 and workers["s_per_step"] > 0  # prepared off the trainer's path
    assert media["prep"]["images"]["prompt_tokens"] > 100 and "share of the step" in done.stdout
    # item 3: eval_speed on that model, greedy answers of the HF loop and mmgrpo eval compared
    (row,) = report["eval"]["rows"]
    assert row["k"] == 1 and row["hf loop"] > 0 and row["eval"] > 0 and row["equal"] is True
    assert report["eval"]["model"].startswith("random:qwen2.5-vl-3b") and "| 1 | " in done.stdout


def test_gpu_suite_names_a_part_it_does_not_have(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry_run_on_cpu", "--out",
                           str(tmp_path), "--parts", "step,rollouts"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--parts 'step,rollouts': give some of step, media, eval" in done.stderr
