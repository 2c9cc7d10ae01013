"""benchmarks/gpu_suite.py --dry_run_on_cpu: the GPU suite's code (building the real 3B configuration,
the three systems' worker processes, the figures, `mmgrpo estimate` beside the measured peak, the
report) at reduced depth on the CPU, so the suite cannot rot between GPU visits.

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
