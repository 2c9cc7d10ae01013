"""benchmarks/rollout_engines.py in its smoke setting, in .venv-vllm (it needs vLLM): the three
engines on the same prompts, one measured round, and the printed table with ratios against HF
generate. Figures are not checked (the script prints them); that every engine ran is."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import rollout_engines  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_smoke_run_times_every_engine_on_the_same_tokens(capsys):
    results = rollout_engines.run("tiny", "small", repeats=1, max_new_tokens=4)
    assert set(results) == {"hf", "lean", "vllm"}
    assert {r["tokens"] for r in results.values()} == {2 * 4 * 4}  # fixed length: 2 prompts x G=4 x 4 tokens each
    printed = capsys.readouterr().out
    for engine in results:
        assert f"  {engine:<5} " in printed and "vs hf" in printed, printed
