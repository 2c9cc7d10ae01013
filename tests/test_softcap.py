"""Final-logit soft-capping (Gemma 2, Gemma 4: `final_logit_softcapping`, 30.0 in the published
checkpoints): the chunked LM head caps the logits as transformers' forward does.

  - the chunked log-probs, entropies and their hand-written backward equal autograd through
    cap * tanh(z / cap) on full logits (fp64, several chunks, temperature, bias);
  - tiny:gemma4 with a cap of 0.5 (its logits reach about +-1, so the cap matters; a copy of the
    tiny checkpoint whose config.json sets it): Policy log-probs equal generate(output_logits=True)
    scores for a left-padded batch and are far from the uncapped ones; the gradients equal
    autograd through `model(...).logits`; its rollout engines (HFRollout, SharedPrefixRollout) decode greedily as
    generate; one GRPO step trains;
  - Gemma3's multimodal forward applies no cap even where its config sets one, and neither does
    its Policy (`Template.logit_softcap_field`); where a shared-prefix family caps, the
    shared-prefix sampler draws from the capped distribution (its log-probs equal the policy's);
  - the lean decode step refuses attention soft-capping; `mmgrpo estimate` reads Gemma 4's
    per-layer head dims.
"""

import json
import shutil

import pytest
import torch

from mmgrpo.data.sample import LoadedSample
from mmgrpo.forward.policy import Policy
from mmgrpo.grpo.logprobs import completion_logprobs, naive_completion_logprobs
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.rollout import HFRollout
from mmgrpo.rollout.base import SamplingParams
from mmgrpo.rollout.lean_decode import LeanDecoder
from mmgrpo.rollout.shared_prefix_engine import SharedPrefixRollout
from mmgrpo.templates import get_template
from mmgrpo.templates.gemma3 import Gemma3Template

CAP = 0.5


# ---------------------------------------------------------------------------------------------
# The chunked head
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compute_entropy", [False, True])
def test_chunked_capped_logprobs_and_gradients_equal_autograd(compute_entropy):
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = (3 * torch.randn(13, 8, dtype=torch.float64)).requires_grad_()  # logits ~ +-10: well into the cap
    bias = torch.randn(13, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (2, 5))
    targets[1, 3:] = -100  # padding: logp 0, no gradient
    grad_out = torch.randn(2, 5, dtype=torch.float64)
    results = []
    for fn, extra in ((completion_logprobs, {"chunk_size": 3}), (naive_completion_logprobs, {})):
        logps, entropy = fn(hidden, weight, targets, temperature=0.7, lm_head_bias=bias, softcap=2.0,
                            compute_entropy=compute_entropy, **extra)
        loss = (logps * grad_out).sum() + (entropy.sum() * 0.3 if compute_entropy else 0)
        grads = torch.autograd.grad(loss, (hidden, weight, bias))
        results.append((logps, entropy, grads))
    (chunked, chunked_entropy, chunked_grads), (naive, naive_entropy, naive_grads) = results
    torch.testing.assert_close(chunked, naive, atol=1e-12, rtol=0)
    if compute_entropy:
        torch.testing.assert_close(chunked_entropy, naive_entropy, atol=1e-12, rtol=0)
    for got, expected in zip(chunked_grads, naive_grads):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    # the naive reference is hand-checked: capped logits never exceed the cap
    uncapped, _ = naive_completion_logprobs(hidden, weight, targets, temperature=0.7, lm_head_bias=bias)
    assert (uncapped - naive).abs().max() > 1.0
    capped, _ = naive_completion_logprobs(hidden, weight, targets, softcap=0.0)  # 0: no cap
    torch.testing.assert_close(capped, naive_completion_logprobs(hidden, weight, targets)[0])


def test_capped_backward_passes_gradcheck():
    torch.manual_seed(1)
    hidden = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    weight = (2 * torch.randn(7, 3, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 7, (1, 4))

    def fn(h, w):
        logps, entropy = completion_logprobs(h, w, targets, chunk_size=3, softcap=1.5, compute_entropy=True)
        return logps, entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight))


# ---------------------------------------------------------------------------------------------
# Gemma 4 with a cap
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma4_capped(tmp_path_factory):
    """(folder, model, template): a copy of tiny:gemma4 whose text config sets the cap."""
    folder = tmp_path_factory.mktemp("gemma4-softcap") / "model"
    shutil.copytree(build_tiny("gemma4"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = CAP
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model = load_model(str(folder))
    assert model.config.get_text_config().final_logit_softcapping == CAP
    return folder, model, get_template("gemma4", load_processor(str(folder)))


def _prompts(template):
    samples = [
        LoadedSample(id="cap/0", messages=[{"role": "user", "content": "Hi."}]),
        LoadedSample(id="cap/1", messages=[{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": "Which colour is the sky on a clear day?"}]),
    ]
    return [template.encode_prompt(sample) for sample in samples]


def test_gemma4_logprobs_equal_generate_scores_with_the_cap(gemma4_capped):
    _, model, template = gemma4_capped
    prompts = _prompts(template)
    batch = template.collate(prompts)
    assert batch["attention_mask"][0, 0] == 0  # left padding
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=True, suppress_tokens=template.suppress_token_ids,
                             output_logits=True, return_dict_in_generate=True)
    completion_ids = out.sequences[:, batch["input_ids"].shape[1]:]  # [2, T]
    logits = torch.stack(out.logits, dim=1).float()  # [2, T, V]: the model's forward, cap applied
    assert logits.abs().max() <= CAP
    expected = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]
    mask = torch.ones_like(completion_ids)
    policy = Policy(model, template)
    assert policy.logit_softcap == CAP
    forward_batch = policy.forward_batch(prompts, [1, 1])
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
        policy.logit_softcap = None  # what the head without the cap would say
        uncapped, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
    torch.testing.assert_close(logps, expected, atol=2e-5, rtol=0)
    assert (uncapped - expected).abs().max() > 0.1


def test_gemma4_gradients_equal_autograd_through_the_model_logits(gemma4_capped):
    _, model, template = gemma4_capped
    prompts = _prompts(template)
    policy = Policy(model, template)
    forward_batch = policy.forward_batch(prompts, [1, 1])
    completion_ids = torch.tensor([[300, 301, 302, 303], [310, 311, 312, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    weights = torch.tensor([[1.0, -0.5, 2.0, 0.3], [-1.0, 0.7, 0.2, 0.0]])

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    logps, entropy = policy.completion_logprobs(forward_batch, completion_ids, mask, compute_entropy=True)
    chunked = grads((logps * weights).sum() + 0.1 * (entropy * mask).sum())

    inputs = template.forward_inputs(forward_batch.prompts, completion_ids, mask)
    prompt_len = forward_batch.prompts["input_ids"].shape[1]
    logits = model(**inputs, use_cache=False).logits[:, prompt_len - 1 : -1].float()  # [2, T, V], capped by HF
    log_probs = torch.log_softmax(logits, -1)
    reference_logps = log_probs.gather(-1, completion_ids[..., None])[..., 0] * mask
    reference_entropy = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(logps.detach(), reference_logps.detach(), atol=2e-5, rtol=0)
    reference = grads((reference_logps * weights).sum() + 0.1 * (reference_entropy * mask).sum())
    assert chunked.keys() == reference.keys() and "model.language_model.embed_tokens.weight" in chunked  # the tied head
    for name, grad in reference.items():
        torch.testing.assert_close(chunked[name], grad, atol=1e-4, rtol=1e-3,  # fp32 sums in another order
                                    msg=lambda m, name=name: f"{name}: {m}")


def test_gemma4_rollout_engine_decodes_as_generate(gemma4_capped):
    _, model, template = gemma4_capped
    prompts = _prompts(template)
    batch = template.collate(prompts)
    with torch.no_grad():
        expected = model.generate(**batch, max_new_tokens=5, do_sample=False, suppress_tokens=template.suppress_token_ids,
                                  eos_token_id=template.eos_token_ids, pad_token_id=template.completion_pad_id)
    # HFRollout: the logits come from the model's forward, capped; SharedPrefixRollout caps its LM head's itself
    for engine in (HFRollout(model, template), SharedPrefixRollout(model, template)):
        rollout = engine.generate(prompts, SamplingParams(num_generations=2, max_new_tokens=5, greedy=True))
        got = rollout.completion_ids[::2]
        width = got.shape[1]
        assert torch.equal(got, expected[:, batch["input_ids"].shape[1]:][:, :width].masked_fill(
            rollout.completion_mask[::2] == 0, template.completion_pad_id)), type(engine).__name__


def test_one_grpo_step_trains_the_capped_gemma4(gemma4_capped, tmp_path):
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    folder, model, _ = gemma4_capped
    plugin = tmp_path / "length.py"
    plugin.write_text("def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n")
    out = train(TrainConfig.from_args([
        "--model", str(folder), "--dataset", "shapes-color", "--dataloader_num_workers", "0", "--report_to", "none",
        "--torch_threads", "1", "--reward_funcs", f"{plugin}:length", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_completion_length", "6", "--max_steps", "1",
        "--learning_rate", "1e-3", "--beta", "0", "--output_dir", str(tmp_path / "run"),
    ]))  # fmt: skip
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, (int, float)))
    after = load_model(str(out / "checkpoint-1"))
    assert after.config.get_text_config().final_logit_softcapping == CAP
    before = dict(model.named_parameters())
    changed = [name for name, p in after.named_parameters() if not torch.equal(p, before[name])]
    assert "model.language_model.embed_tokens.weight" in changed  # the tied head trained


# ---------------------------------------------------------------------------------------------
# Gemma3: its multimodal forward never caps; the shared-prefix sampler caps where a model does
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3():
    folder = str(build_tiny("gemma3"))
    model, processor = load_model(folder), load_processor(folder)
    samples = [LoadedSample(id="g3/0", messages=[{"role": "user", "content": "Hi."}]),
               LoadedSample(id="g3/1", messages=[{"role": "user", "content": "Name three colours of the rainbow."}])]
    return model, processor, samples


def test_gemma3_ignores_a_cap_in_its_config_as_its_forward_does(gemma3):
    model, processor, samples = gemma3
    template = get_template("gemma3", processor)
    prompts = [template.encode_prompt(sample) for sample in samples]
    text_config = model.config.get_text_config()
    assert text_config.final_logit_softcapping is None and Policy(model, template).logit_softcap is None
    text_config.final_logit_softcapping = CAP  # Gemma3ForConditionalGeneration does not apply it
    try:
        policy = Policy(model, template)
        assert policy.logit_softcap is None and policy.shared_prefix
        batch = template.collate(prompts)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=4, do_sample=False, suppress_tokens=template.suppress_token_ids,
                                 output_logits=True, return_dict_in_generate=True)
            completion_ids = out.sequences[:, batch["input_ids"].shape[1]:]
            logits = torch.stack(out.logits, dim=1).float()
            assert logits.abs().max() > CAP  # not capped
            expected = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]
            logps, _ = policy.completion_logprobs(policy.forward_batch(prompts, [1, 1]), completion_ids,
                                                  torch.ones_like(completion_ids))
        torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
    finally:
        text_config.final_logit_softcapping = None


class CappedGemma3(Gemma3Template):
    """Gemma3 as if its forward capped its logits (as its text-only class does): a shared-prefix family with a cap."""

    logit_softcap_field = "final_logit_softcapping"


def test_shared_prefix_sampler_draws_from_the_capped_distribution(gemma3):
    model, processor, samples = gemma3
    template = CappedGemma3(processor)
    prompts = [template.encode_prompt(sample) for sample in samples]
    params = SamplingParams(num_generations=2, max_new_tokens=5, temperature=0.9, seed=3)
    text_config = model.config.get_text_config()
    text_config.final_logit_softcapping = CAP
    try:
        engine, policy = SharedPrefixRollout(model, template), Policy(model, template)
    finally:
        text_config.final_logit_softcapping = None
    assert engine.logit_softcap == policy.logit_softcap == CAP and policy.shared_prefix
    rollout = engine.generate(prompts, params)
    forward_batch = policy.forward_batch(prompts, [2, 2])
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(forward_batch, rollout.completion_ids, rollout.completion_mask,
                                              temperature=0.9)
        policy.logit_softcap = None
        uncapped, _ = policy.completion_logprobs(forward_batch, rollout.completion_ids, rollout.completion_mask,
                                                 temperature=0.9)
    torch.testing.assert_close(rollout.logps, logps, atol=2e-5, rtol=0)  # the sampler's distribution is the policy's
    assert (uncapped - rollout.logps).abs().max() > 0.02  # and the cap changes it (1000x the tolerance)


def test_lean_decode_refuses_attention_soft_capping():
    model = load_model(str(build_tiny("qwen2")))
    decoder = model.model
    assert LeanDecoder.supports(decoder)[0]
    decoder.config.attn_logit_softcapping = 50.0  # as Gemma 2's config has it
    supported, reason = LeanDecoder.supports(decoder)
    assert not supported and "attn_logit_softcapping=50.0" in reason


# ---------------------------------------------------------------------------------------------
# mmgrpo estimate on Gemma 4
# ---------------------------------------------------------------------------------------------


def test_estimate_reads_gemma4_per_layer_head_dims(capsys):
    from mmgrpo.estimate import attention_widths, main, model_config

    text = model_config("tiny:gemma4").get_text_config()
    # 4 sliding layers: 4 heads x 32 and 2 KV heads x 32; 2 full layers: 4 heads x 64 and 1 KV head x 64
    assert attention_widths(text) == (round((4 * 128 + 2 * 256) / 6), 64)
    assert attention_widths(model_config("tiny:qwen2").get_text_config())[0] > 0  # a uniform config: read globally
    main(["--model", "tiny:gemma4"])
    assert "needed" in capsys.readouterr().out
