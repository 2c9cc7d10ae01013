"""benchmarks/vs_trl.py runs end to end (its `smoke` preset: the tiny Qwen2-VL, one warm-up and one
timed step per system, the FLOP-count runs included), so a change to mmgrpo's flags or metrics, or to
TRL, breaks this test rather than the benchmark.

    .venv/bin/python -m pytest -q -p no:xdist tests/test_benchmark_vs_trl.py
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_vs_trl_smoke(tmp_path):
    pytest.importorskip("trl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--preset", "smoke", "--work_dir",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "completion length mmgrpo 4, trl 4" in out  # fixed-length completions in both (--suppress_eos)
    for line in ("samples/s", "CPU s/step", "peak RSS (MB)", "  s/step rollout", "executed GFLOP/step",
                 "mmgrpo/TRL samples/s ratio", "mmgrpo/TRL executed FLOPs ratio"):
        assert line in out, line
