"""benchmarks/soak.py in its smoke mode: a short real run whose memory is read at every step, the
slope fitted and the plot drawn (the 1,000-step figures are in docs/benchmarks.md, "Soak")."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_smoke_soak_samples_every_step_and_fits_a_slope(tmp_path):
    completed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--smoke", "--out", str(tmp_path)],
                               env=dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"),
                               capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads((tmp_path / "soak-hf.json").read_text())
    assert [sample[0] for sample in result["samples"]] == list(range(1, 17))  # every step, once
    assert all(sample[1] > 100 and sample[4] >= sample[1] for sample in result["samples"])  # anon MB, within the RSS
    assert any(sample[2] for sample in result["samples"])  # the DataLoader workers were read too
    assert math.isfinite(result["trainer_mb_per_100_steps"]) and math.isfinite(result["workers_mb_per_100_steps"])
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert "hf" in completed.stdout and "MB/100 steps" in completed.stdout
