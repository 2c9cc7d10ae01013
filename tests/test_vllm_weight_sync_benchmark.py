"""benchmarks/weight_sync.py in its smoke setting: one real server, each transfer once after a
warm-up, the report and the plot behind docs/benchmarks.md's "Scale out"."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import weight_sync  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_smoke_run_measures_both_transfers_and_plots(tmp_path, capsys):
    measured = weight_sync.main(["--models", "2.7m", "--repeats", "1", "--plot", str(tmp_path / "sync.png")])
    tiny = measured["2.7m"]
    assert 2.5e6 < tiny["parameters"] < 3e6 and tiny["gigabytes"] > 0.01
    assert {"http (/dev/shm)", "collective (gloo)"} <= set(tiny["arms"])
    for row in tiny["arms"].values():
        assert len(row["wall"]) == 1 and row["wall"][0] > 0
    printed = capsys.readouterr().out
    assert "| collective (gloo) |" in printed and "http (/dev/shm) / collective" in printed and "7B model in bf16" in printed
    assert (tmp_path / "sync.png").stat().st_size > 1000
