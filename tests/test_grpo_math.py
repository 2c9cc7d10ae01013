"""GRPO math against numbers computed by hand: advantages, every loss type, clipping, KL,
gradient accumulation, and chunked log-probs (values, gradients, peak memory).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_grpo_math.py
"""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from mmgrpo.errors import ConfigError
from mmgrpo.grpo import (
    LossConfig,
    completion_logprobs,
    get_advantage,
    group_advantages,
    naive_completion_logprobs,
    policy_loss,
    register_advantage,
    register_loss,
)
from mmgrpo.grpo import losses as losses_module
from mmgrpo.grpo.importance import IS_MODES, sampling_importance_weights

LN = math.log

# ---------------------------------------------------------------- advantages

# Two prompts, G = 2: group 0 = [3, 1] (mean 2), group 1 = [2, 2] (mean 2, std 0).
REWARDS = torch.tensor([3.0, 1.0, 2.0, 2.0])


def test_advantages_scale_group():
    # group 0: unbiased std = sqrt(((3-2)^2 + (1-2)^2) / (2-1)) = sqrt(2) = 1.414214
    #          A = +-1 / (1.414214 + 1e-4) = +-0.707057
    # group 1: std 0 -> A = 0 / (0 + 1e-4) = 0
    adv, stats = group_advantages(REWARDS, num_generations=2, scale_rewards="group")
    torch.testing.assert_close(adv, torch.tensor([0.707057, -0.707057, 0.0, 0.0]), atol=1e-6, rtol=0)
    # reward_std = mean(1.414214, 0) = 0.707107; one group of two has zero std
    assert float(stats["reward_std"]) == pytest.approx(0.707107, abs=1e-6)
    assert float(stats["frac_reward_zero_std"]) == 0.5
    assert float(stats["reward_mean"]) == 2.0


def test_advantages_scale_batch():
    # still minus the GROUP mean (2 and 2); divided by the std of all four rewards:
    # batch mean 2, squared deviations 1, 1, 0, 0 -> var = 2 / 3, std = 0.816497
    # A = +-1 / (0.816497 + 1e-4) = +-1.224595
    adv, _ = group_advantages(REWARDS, num_generations=2, scale_rewards="batch")
    torch.testing.assert_close(adv, torch.tensor([1.224595, -1.224595, 0.0, 0.0]), atol=1e-6, rtol=0)


def test_advantages_scale_none():
    # Dr. GRPO: r - mean, no division
    adv, _ = group_advantages(REWARDS, num_generations=2, scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_advantages_groups_are_contiguous_rows():
    # G = 3, rows 0..2 are prompt 0 and rows 3..5 prompt 1 (not interleaved)
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 40.0])
    adv, stats = group_advantages(rewards, num_generations=3, scale_rewards="none")
    # means 2 and 20
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, -10.0, -10.0, 20.0]))
    assert float(stats["frac_reward_zero_std"]) == 0.0


def test_advantages_reject_bad_input():
    with pytest.raises(ConfigError, match="scale_rewards"):
        group_advantages(REWARDS, 2, "std")
    with pytest.raises(ConfigError, match="num_generations"):
        group_advantages(REWARDS, 1)
    with pytest.raises(ValueError, match="num_generations=3"):
        group_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


def test_advantage_registry():
    assert get_advantage("grpo") is group_advantages
    with pytest.raises(ConfigError, match="grpo"):
        get_advantage("no-such-estimator")
    with pytest.raises(ConfigError, match="already registered"):
        register_advantage("grpo")(group_advantages)


# ---------------------------------------------------------------- policy loss values

# Two completions, three token slots; the second completion has two tokens (last is padding).
# Token ratios pi/pi_old are [[1.5, 0.5, 1], [1, 1, -]] and advantages [+1, -1].
OLD = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
DELTA = torch.tensor([[LN(1.5), LN(0.5), 0.0], [0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])
# Per-token clipped loss, eps = 0.2:
#   row 0 (A=+1): -min(1.5, 1.2) = -1.2 | -min(0.5, 0.8) = -0.5 | -min(1, 1) = -1
#   row 1 (A=-1): -min(-1, -1) = 1 | 1 | (padding)
# Sum over the 5 real tokens: -2.7 + 2 = -0.7


def _loss(loss_type, num_items_in_batch=None, **kwargs):
    config = LossConfig(loss_type=loss_type, epsilon=0.2, **kwargs)
    return policy_loss(OLD + DELTA, OLD, None, ADV, MASK, config, num_items_in_batch=num_items_in_batch)[0]


def test_loss_grpo():
    # per-sequence mean then mean: row 0 (-1.2 - 0.5 - 1) / 3 = -0.9, row 1 (1 + 1) / 2 = 1
    # (-0.9 + 1) / 2 = 0.05
    assert float(_loss("grpo")) == pytest.approx(0.05, abs=1e-6)


def test_loss_bnpo_and_dapo():
    # -0.7 / 5 tokens = -0.14
    assert float(_loss("bnpo")) == pytest.approx(-0.14, abs=1e-6)
    assert float(_loss("dapo")) == pytest.approx(-0.14, abs=1e-6)
    # dapo over a whole step of 10 tokens: -0.7 / 10 = -0.07
    assert float(_loss("dapo", num_items_in_batch=10)) == pytest.approx(-0.07, abs=1e-6)


def test_loss_dr_grpo():
    # -0.7 / (N * max_completion_length) = -0.7 / (2 * 4) = -0.0875
    assert float(_loss("dr_grpo", max_completion_length=4)) == pytest.approx(-0.0875, abs=1e-6)
    with pytest.raises(ValueError, match="max_completion_length"):
        _loss("dr_grpo")


def test_loss_cispo_value_and_gradient():
    # weight sg(min(ratio, 1 + 0.2)) = [[1.2, 0.5, 1], [1, 1, -]], loss_t = -w * A * logp
    #   row 0: -1.2 * (-1 + ln 1.5) = 0.713442 | -0.5 * (-1 + ln 0.5) = 0.846574 | -1 * (-1) = 1
    #   row 1: -1 * (-1) * (-2) = -2 | -2
    # sum = -1.439985, token mean over 5 tokens = -0.287997
    logps = (OLD + DELTA).requires_grad_()
    loss, metrics = policy_loss(logps, OLD, None, ADV, MASK, LossConfig(loss_type="cispo", epsilon=0.2))
    assert float(loss.detach()) == pytest.approx(-0.287997, abs=1e-6)
    loss.backward()
    # d loss / d logp = -w * A / 5: every token keeps a gradient, even the clipped one
    expected = torch.tensor([[-1.2, -0.5, -1.0], [1.0, 1.0, 0.0]]) / 5
    torch.testing.assert_close(logps.grad, expected)
    assert float(metrics["clip_ratio/high"]) == pytest.approx(1 / 5)  # the 1.5 token


def test_loss_gspo_sequence_level():
    # one ratio per completion: exp(mean log-ratio)
    #   row 0: exp((ln 1.5 + ln 0.5 + 0) / 3) = exp(-0.095894) = 0.908560 (inside [0.8, 1.2])
    #   row 1: exp(0) = 1
    # token losses: row 0 -0.908560 x3, row 1 +1 x2; grpo: (-0.908560 + 1) / 2 = 0.045720
    logps = (OLD + DELTA).requires_grad_()
    loss, _ = policy_loss(
        logps, OLD, None, ADV, MASK, LossConfig(loss_type="grpo", epsilon=0.2, importance_sampling_level="sequence")
    )
    assert float(loss.detach()) == pytest.approx(0.045720, abs=1e-6)
    loss.backward()
    # d loss / d logp_0t = -(1/2) * ratio_0 * (1/3) = -0.151427 for each token of row 0;
    # row 1: +(1/2) * 1 * (1/2) = 0.25 for its two tokens
    expected = torch.tensor([[-0.151427] * 3, [0.25, 0.25, 0.0]])
    torch.testing.assert_close(logps.grad, expected, atol=1e-6, rtol=0)


def test_on_policy_when_old_logps_is_none():
    # ratio 1 everywhere: loss = -A per token; grpo = (-1 + 1) / 2 = 0; gradient -A / (N * len)
    logps = (OLD + DELTA).requires_grad_()
    loss, metrics = policy_loss(logps, None, None, ADV, MASK, LossConfig(loss_type="grpo"))
    assert float(loss.detach()) == 0.0
    assert float(metrics["ratio_mean"]) == 1.0
    loss.backward()
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [1 / 4, 1 / 4, 0.0]])
    torch.testing.assert_close(logps.grad, expected)


# ---------------------------------------------------------------- clipping


def _single_token(ratio, advantage, **kwargs):
    """Loss and d loss / d logp for one token with the given ratio (old logp 0)."""
    logps = torch.tensor([[LN(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(
        logps, torch.zeros(1, 1), None, torch.tensor([advantage]), torch.ones(1, 1), LossConfig(**kwargs)
    )
    loss.backward()
    return float(loss.detach()), float(logps.grad), metrics


def test_clip_high_with_positive_advantage():
    # ratio 1.5, A = +1: -min(1.5, 1.2) = -1.2, clipped: no gradient
    loss, grad, metrics = _single_token(1.5, 1.0, epsilon=0.2)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert float(metrics["clip_ratio/high"]) == 1.0 and float(metrics["clip_ratio/low"]) == 0.0


def test_no_clip_high_with_negative_advantage():
    # ratio 1.5, A = -1: -min(-1.5, -1.2) = 1.5, not clipped: d/dlogp (ratio) = ratio = 1.5
    loss, grad, metrics = _single_token(1.5, -1.0, epsilon=0.2)
    assert loss == pytest.approx(1.5)
    assert grad == pytest.approx(1.5)
    assert float(metrics["clip_ratio/region"]) == 0.0


def test_clip_low_with_negative_advantage():
    # ratio 0.5, A = -1: -min(-0.5, -0.8) = 0.8, clipped; with A = +1: -0.5, gradient -0.5
    loss, grad, metrics = _single_token(0.5, -1.0, epsilon=0.2)
    assert (loss, grad) == (pytest.approx(0.8), 0.0)
    assert float(metrics["clip_ratio/low"]) == 1.0 and float(metrics["clip_ratio/region"]) == 1.0
    loss, grad, _ = _single_token(0.5, 1.0, epsilon=0.2)
    assert (loss, grad) == (pytest.approx(-0.5), pytest.approx(-0.5))


def test_epsilon_high_is_asymmetric():
    # range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]
    loss, grad, _ = _single_token(1.25, 1.0, epsilon=0.2, epsilon_high=0.28)  # inside: kept
    assert (loss, grad) == (pytest.approx(-1.25), pytest.approx(-1.25))
    loss, grad, _ = _single_token(1.3, 1.0, epsilon=0.2, epsilon_high=0.28)  # above 1.28: clipped
    assert (loss, grad) == (pytest.approx(-1.28), 0.0)
    loss, grad, _ = _single_token(0.75, -1.0, epsilon=0.2, epsilon_high=0.28)  # below 0.8: clipped
    assert (loss, grad) == (pytest.approx(0.8), 0.0)
    # symmetric default: epsilon_high None means epsilon, so 1.25 > 1.2 is clipped
    assert _single_token(1.25, 1.0, epsilon=0.2)[1] == 0.0


# ---------------------------------------------------------------- KL


def test_kl_k3_value():
    # token 0: logp = ln 0.5, ref = ln 0.25: d = ref - logp = -ln 2
    #   k3 = e^d - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    # token 1: logp = ln 0.25, ref = ln 0.5: d = ln 2 -> 2 - 0.693147 - 1 = 0.306853
    # mean KL = (0.193147 + 0.306853) / 2 = 0.25; A = 0 so grpo loss = beta * 0.25 = 0.025
    logps = torch.tensor([[LN(0.5), LN(0.25)]])
    ref = torch.tensor([[LN(0.25), LN(0.5)]])
    loss, metrics = policy_loss(
        logps, None, ref, torch.zeros(1), torch.ones(1, 2), LossConfig(loss_type="grpo", beta=0.1)
    )
    assert float(metrics["kl"]) == pytest.approx(0.25, abs=1e-6)
    assert float(loss) == pytest.approx(0.025, abs=1e-7)


def test_kl_gradient():
    # d k3 / d logp = -e^d + 1 with d = ref - logp: token 0 -> 0.5, token 1 -> -1; x beta / 2 tokens
    logps = torch.tensor([[LN(0.5), LN(0.25)]], requires_grad=True)
    ref = torch.tensor([[LN(0.25), LN(0.5)]])
    loss, _ = policy_loss(logps, None, ref, torch.zeros(1), torch.ones(1, 2), LossConfig(loss_type="grpo", beta=0.1))
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.025, -0.05]]))


def test_beta_zero_needs_no_reference():
    loss, metrics = policy_loss(OLD + DELTA, OLD, None, ADV, MASK, LossConfig(beta=0.0))
    assert float(loss) == pytest.approx(0.05, abs=1e-6) and float(metrics["kl"]) == 0.0
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(OLD + DELTA, OLD, None, ADV, MASK, LossConfig(beta=0.04))


def test_beta_zero_with_reference_only_logs_kl():
    logps = (OLD + DELTA).requires_grad_()
    loss, metrics = policy_loss(logps, OLD, OLD, ADV, MASK, LossConfig(loss_type="grpo", epsilon=0.2, beta=0.0))
    assert float(loss.detach()) == pytest.approx(0.05, abs=1e-6)
    assert float(metrics["kl"]) > 0


def test_padding_values_never_reach_the_loss():
    logps = (OLD + DELTA).clone()
    logps[1, 2] = -float("inf")  # a padding slot holding garbage
    logps.requires_grad_()
    ref = OLD.clone()
    loss, metrics = policy_loss(logps, OLD, ref, ADV, MASK, LossConfig(loss_type="dapo", beta=0.04))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logps.grad).all()
    assert all(torch.isfinite(value) for value in metrics.values())


# ---------------------------------------------------------------- gradient accumulation


def _random_batch(seed, num_rows=4, num_tokens=6):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(num_rows, num_tokens, generator=generator) * 3
    logps = old + 0.3 * torch.randn(num_rows, num_tokens, generator=generator)
    ref = old + 0.3 * torch.randn(num_rows, num_tokens, generator=generator)
    lengths = torch.tensor([6, 2, 4, 5])
    mask = (torch.arange(num_tokens)[None] < lengths[:, None]).float()
    advantages = torch.randn(num_rows, generator=generator)
    return logps, old, ref, advantages, mask


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "grpo", "dr_grpo"])
def test_micro_batches_sum_to_the_full_batch(loss_type):
    # rows 0-1 and rows 2-3 as two micro-batches of one optimizer step (8 and 9 tokens)
    logps, old, ref, advantages, mask = _random_batch(0)
    config = LossConfig(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=0.04, max_completion_length=6)
    full_logps = logps.clone().requires_grad_()
    full, _ = policy_loss(full_logps, old, ref, advantages, mask, config)
    full.backward()

    micro_logps = logps.clone().requires_grad_()
    step_totals = dict(num_items_in_batch=int(mask.sum()), num_sequences_in_batch=4)
    summed = sum(
        policy_loss(
            micro_logps[rows], old[rows], ref[rows], advantages[rows], mask[rows], config, **step_totals
        )[0]
        for rows in (slice(0, 2), slice(2, 4))
    )
    summed.backward()
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(micro_logps.grad, full_logps.grad)


def test_bnpo_micro_batches_average():
    logps, old, ref, advantages, mask = _random_batch(1)
    config = LossConfig(loss_type="bnpo", beta=0.04)
    halves = [
        policy_loss(logps[r], old[r], ref[r], advantages[r], mask[r], config)[0]
        for r in (slice(0, 2), slice(2, 4))
    ]
    summed = sum(
        policy_loss(logps[r], old[r], ref[r], advantages[r], mask[r], config, num_sequences_in_batch=4)[0]
        for r in (slice(0, 2), slice(2, 4))
    )
    torch.testing.assert_close(summed, (halves[0] + halves[1]) / 2)


def test_loss_registry():
    with pytest.raises(ConfigError, match="dapo"):
        policy_loss(OLD, None, None, ADV, MASK, LossConfig(loss_type="nope"))
    with pytest.raises(ConfigError, match="importance_sampling_level"):
        policy_loss(OLD, None, None, ADV, MASK, LossConfig(importance_sampling_level="group"))
    with pytest.raises(ConfigError, match="already registered"):
        register_loss("grpo")(lambda *args, **kwargs: None)

    @register_loss("test_sum")
    def _sum(per_token_loss, completion_mask, **_):
        return (per_token_loss * completion_mask).sum()

    try:
        assert float(_loss("test_sum")) == pytest.approx(-0.7, abs=1e-6)  # the -0.7 sum above
    finally:
        losses_module.LOSSES.unregister("test_sum")


# ---------------------------------------------------------------- chunked log-probs


def _lm_inputs(dtype, batch=3, seq_len=4, hidden_size=8, vocab=37, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq_len, hidden_size, generator=generator, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=dtype)
    bias = torch.randn(vocab, generator=generator, dtype=dtype)
    targets = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    targets[-1, -1] = -100  # padding
    return hidden, weight, bias, targets


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_size", [1, 5, 12, 64])  # B*T = 12: smaller, not dividing, equal, larger
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_naive(dtype, tolerance, chunk_size, temperature):
    hidden, weight, bias, targets = _lm_inputs(dtype)
    generator = torch.Generator().manual_seed(1)  # its own draws: the result does not depend on the tests run before
    upstream = torch.randn(3, 4, generator=generator, dtype=torch.promote_types(dtype, torch.float32))  # a generic d loss / d logp
    entropy_upstream = torch.randn(3, 4, generator=generator, dtype=upstream.dtype)  # and d loss / d entropy (--entropy_coeff)

    results = []
    for fn, extra in ((completion_logprobs, {"chunk_size": chunk_size}), (naive_completion_logprobs, {})):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        logps, entropy = fn(
            leaves[0],
            leaves[1],
            targets,
            temperature=temperature,
            lm_head_bias=leaves[2],
            compute_entropy=True,
            **extra,
        )
        ((logps * upstream).sum() + (entropy * entropy_upstream).sum()).backward()
        results.append((logps, entropy, *(leaf.grad for leaf in leaves)))

    for chunked, naive in zip(*results):
        torch.testing.assert_close(chunked, naive, atol=tolerance, rtol=tolerance)
    logps, entropy = results[0][:2]
    assert logps.dtype == entropy.dtype == torch.promote_types(dtype, torch.float32)
    assert logps[2, 3] == 0


def test_chunked_logprobs_gradcheck():
    hidden, weight, bias, targets = _lm_inputs(torch.float64, batch=2, seq_len=3, hidden_size=4, vocab=7)
    inputs = [t.requires_grad_() for t in (hidden, weight, bias)]
    assert torch.autograd.gradcheck(
        lambda h, w, b: completion_logprobs(h, w, targets, chunk_size=4, temperature=0.7, lm_head_bias=b)[0],
        inputs,
    )


def test_chunked_logprobs_entropy_gradcheck():
    hidden, weight, bias, targets = _lm_inputs(torch.float64, batch=2, seq_len=3, hidden_size=4, vocab=7)
    inputs = [t.requires_grad_() for t in (hidden, weight, bias)]

    def entropy_and_logps(h, w, b):
        logps, entropy = completion_logprobs(h, w, targets, chunk_size=4, temperature=0.7, lm_head_bias=b,
                                             compute_entropy=True)
        return logps, entropy

    assert torch.autograd.gradcheck(entropy_and_logps, inputs)
    # the entropy alone (the log-probs unused: their gradient is None inside the backward)
    assert torch.autograd.gradcheck(lambda h, w, b: entropy_and_logps(h, w, b)[1], inputs)


def test_padding_rows_get_no_gradient_from_their_logprob():
    hidden, weight, bias, targets = _lm_inputs(torch.float64)
    hidden.requires_grad_()
    logps, _ = completion_logprobs(hidden, weight, targets, chunk_size=5, lm_head_bias=bias)
    logps.sum().backward()
    assert logps[2, 3] == 0 and hidden.grad[2, 3].abs().sum() == 0 and hidden.grad[0, 0].abs().sum() > 0


def test_chunked_logprobs_bf16_hidden_gives_fp32():
    hidden, weight, _, targets = _lm_inputs(torch.float32)
    hidden_bf16, weight_bf16 = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    logps, _ = completion_logprobs(hidden_bf16, weight_bf16, targets, chunk_size=5)
    reference, _ = naive_completion_logprobs(hidden_bf16.float(), weight_bf16.float(), targets)
    assert logps.dtype == torch.float32
    torch.testing.assert_close(logps, reference, atol=1e-5, rtol=1e-5)  # computed from the same bf16 values
    logps.sum().backward()
    assert hidden_bf16.grad.dtype == weight_bf16.grad.dtype == torch.bfloat16


def test_chunked_logprobs_ignore_autocast():
    # the engine may run the model under bf16 autocast; the LM head must stay fp32
    hidden, weight, _, targets = _lm_inputs(torch.float32)
    reference, _ = naive_completion_logprobs(hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, _ = completion_logprobs(hidden, weight, targets, chunk_size=5)
    torch.testing.assert_close(logps, reference, atol=1e-5, rtol=1e-5)


def test_frozen_lm_head_gets_no_gradient():
    hidden, weight, _, targets = _lm_inputs(torch.float32)
    hidden.requires_grad_()
    completion_logprobs(hidden, weight, targets, chunk_size=5)[0].sum().backward()
    assert hidden.grad is not None and weight.grad is None


# Peak resident memory of a fresh process, so no allocator state or other test interferes.
# ru_maxrss is the high-water mark: the delta around forward + backward is the extra peak.
_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, torch
    from mmgrpo.grpo import completion_logprobs
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab, hidden_size, batch, seq_len = 151936, 64, 8, 64   # B*T = 512 rows

    def run(rows, vocab):
        hidden = torch.randn(1, rows, hidden_size, requires_grad=True)
        weight = torch.randn(vocab, hidden_size).mul_(0.02).requires_grad_()  # no freed temporary
        targets = torch.randint(0, vocab, (1, rows))
        return hidden, weight, targets

    # warm up the same code path on small sizes (thread pools, kernels, first allocations)
    hidden, weight, targets = run(32, 1000)
    completion_logprobs(hidden, weight, targets, chunk_size=16)[0].sum().backward()

    hidden = torch.randn(batch, seq_len, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size).mul_(0.02).requires_grad_()  # no freed temporary
    targets = torch.randint(0, vocab, (batch, seq_len))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    logps, _ = completion_logprobs(hidden, weight, targets, chunk_size=16)
    logps.sum().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert weight.grad is not None and hidden.grad is not None
    print(after - before)
    """
)


def test_chunked_logprobs_peak_memory():
    full_logits_bytes = 512 * 151936 * 4  # one fp32 [B*T, V] tensor: 311 MB
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    extra_peak = int(result.stdout.strip().splitlines()[-1])
    # Measured: ~93 MiB = the [V, H] weight gradient (37 MiB) + a few 16 x V fp32 blocks (9 MiB
    # each) + malloc slack. The naive path measures ~860 MiB (logits, log_softmax, gradients).
    assert extra_peak < full_logits_bytes / 2, f"extra peak {extra_peak / 2**20:.0f} MiB"


def test_rloo_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])  # two groups of 4
    adv, stats = get_advantage("rloo")(rewards, 4, "none")
    # r_i - mean of the other three: 1 - 0 = 1, 0 - 1/3; the second group is all equal: 0
    assert adv.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, 0.0])
    assert float(stats["frac_reward_zero_std"]) == 0.5
    # scaled by the group std (0.5 here), as grpo is: G / (G - 1) times grpo's advantages
    scaled, _ = get_advantage("rloo")(rewards, 4, "group")
    grpo, _ = get_advantage("grpo")(rewards, 4, "group")
    torch.testing.assert_close(scaled, grpo * 4 / 3)
    assert scaled[0] == pytest.approx(1.0 / (0.5 + 1e-4))
    with pytest.raises(ConfigError, match="unknown advantage estimator 'nope'.*rloo"):
        get_advantage("nope")


def test_sampling_importance_weights_in_every_mode_by_hand():
    # token ratios (trainer / sampler): row 0: 1, 5, [pad]; row 1: 3, 0.2, 1.5
    trainer = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.9, 0.1, 0.6]]))
    sampler = torch.log(torch.tensor([[0.5, 0.1, 0.1], [0.3, 0.5, 0.4]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights = {mode: sampling_importance_weights(trainer, sampler, mask, mode, cap=4.0)[0] for mode in IS_MODES}
    assert torch.allclose(weights["token_truncate"][mask.bool()], torch.tensor([1.0, 4.0, 3.0, 0.2, 1.5]))
    assert torch.allclose(weights["token_mask"][mask.bool()], torch.tensor([1.0, 0.0, 3.0, 0.2, 1.5]))
    # sequence: row 0 = 1 * 5 = 5 (the pad's ratio 9 does not count); row 1 = 3 * 0.2 * 1.5 = 0.9
    assert torch.allclose(weights["sequence_truncate"], torch.tensor([[4.0], [0.9]]))
    assert torch.allclose(weights["sequence_mask"], torch.tensor([[0.0], [0.9]]))
    # a floor applies too; without cap and floor, truncation leaves the ratio as it is
    floored, _ = sampling_importance_weights(trainer, sampler, mask, "token_truncate", cap=4.0, floor=0.5)
    assert torch.allclose(floored[mask.bool()], torch.tensor([1.0, 4.0, 3.0, 0.5, 1.5]))
    free, _ = sampling_importance_weights(trainer, sampler, mask, "sequence_truncate", cap=None)
    assert torch.allclose(free, torch.tensor([[5.0], [0.9]]))


def test_sampling_importance_stats_and_missing_sampler_logps():
    trainer = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    sampler = torch.log(torch.tensor([[0.5, 0.1], [0.3, 0.1]]))
    sampler[1, 1] = float("nan")  # a token the sampler gave no log-prob for: weight 1
    weights, stats = sampling_importance_weights(trainer, sampler, torch.ones(2, 2), "token_truncate", cap=10.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 5.0], [3.0, 1.0]]))
    gaps = torch.tensor([0.0, math.log(5), math.log(3), 0.0])
    assert stats["logp_diff_mean"].item() == pytest.approx(gaps.mean().item(), rel=1e-5)
    assert stats["logp_diff_max"].item() == pytest.approx(math.log(5), rel=1e-5)
    assert (stats["is_ratio_min"].item(), stats["is_ratio_max"].item()) == pytest.approx((1.0, 5.0), rel=1e-5)
    with pytest.raises(ConfigError, match="token_truncate"):
        sampling_importance_weights(trainer, sampler, torch.ones(2, 2), "token_clip")
