"""The lean decode step (mmgrpo/rollout/lean_decode.py) against transformers' decoder forward.

Both run inside SharedPrefixRollout on the same prefill; only the per-step decoder differs (and
the K/V layout: transformers' step reads a copy of the prompt's K/V per row, the lean step holds
it once per prompt and its G rows read it together). Greedy tokens must be identical and sampled tokens (same seed) identical with
log-probs equal to 1e-5 (fp32), for a left-padded batch (masked attention) and an unpadded one,
on every family whose decoder layers the lean step implements.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.data.sample import LoadedSample
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.rollout.base import SamplingParams
from mmgrpo.rollout.lean_decode import LeanDecoder
from mmgrpo.rollout.shared_prefix_engine import SharedPrefixRollout, lean_applies
from mmgrpo.templates import get_template

FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen2.5-omni", "qwen2", "qwen2-audio", "llava-onevision", "internvl",
            "qwen3.5"]  # fmt: skip


def _media_sample(template) -> LoadedSample:
    """A prompt with the family's first medium (text only for a text family)."""
    rng = np.random.RandomState(0)
    if "image" in template.modalities:
        image = Image.fromarray(rng.randint(0, 256, (56, 84, 3), dtype=np.uint8))
        return LoadedSample(id="m/0", messages=[{"role": "user", "content": "<image>What is it?"}], images=[image])
    if "audio" in template.modalities:
        audio = (0.3 * np.sin(2 * np.pi * 330 * np.arange(16000) / 16000)).astype(np.float32)
        return LoadedSample(id="m/0", messages=[{"role": "user", "content": "<audio>What is it?"}], audios=[audio])
    return LoadedSample(id="m/0", messages=[{"role": "user", "content": "Count from one to ten, please."}])


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    family = request.param
    path = str(build_tiny(family))
    model = load_model(path, dtype=torch.float32)
    template = get_template(family, load_processor(path))
    tokenizer = template.tokenizer
    eos = [tokenizer.eos_token_id, *template.stop_token_ids]
    # EOS never sampled: every row decodes all the steps (stopping is outside the step)
    kwargs = dict(eos_token_ids=eos, suppress_token_ids=[*template.suppress_token_ids, *eos])
    backends = {lean: SharedPrefixRollout(model, template, **kwargs, lean=lean) for lean in (False, True)}
    assert backends[True].lean is not None, LeanDecoder.supports(backends[True].decoder)
    assert backends[False].lean is None
    media = _media_sample(template)
    text = LoadedSample(id="t/0", messages=[{"role": "user", "content": "Hi."}])
    padded = template.collate([template.encode_prompt(s) for s in (media, text)])
    unpadded = template.collate([template.encode_prompt(s) for s in (media, media)])
    assert not bool(padded["attention_mask"].all()) and bool(unpadded["attention_mask"].all())
    return backends, {"padded": padded, "unpadded": unpadded}


@pytest.mark.parametrize("batch_kind", ["padded", "unpadded"])
@pytest.mark.parametrize("greedy", [True, False])
def test_lean_step_equals_transformers(setup, batch_kind, greedy):
    backends, batches = setup
    params = SamplingParams(num_generations=3, max_new_tokens=20, greedy=greedy)
    results = {}
    for lean, backend in backends.items():
        torch.manual_seed(0)
        results[lean] = backend.sample(batches[batch_kind], params)
    (reference, ref_logps), (lean, lean_logps) = results[False], results[True]
    assert torch.equal(reference.completion_ids, lean.completion_ids)
    assert torch.equal(reference.completion_mask, lean.completion_mask)
    torch.testing.assert_close(lean_logps, ref_logps, atol=1e-5, rtol=0)
    assert reference.completion_ids.shape[1] == params.max_new_tokens


def test_unsupported_layers_decode_through_transformers():
    """Gemma3's template does not declare lean_decode (its layers norm four times, use GELU, scale
    the embedding, slide): its rollouts decode through transformers, and its decoder's parts
    fail the lean step's own checks too."""
    path = str(build_tiny("gemma3"))
    model = load_model(path, dtype=torch.float32)
    template = get_template("gemma3", load_processor(path))
    assert not lean_applies(model, template)
    assert SharedPrefixRollout(model, template).lean is None
    ok, reason = LeanDecoder.supports(model.model.language_model)
    assert not ok and reason


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3.5"])
def test_lora_projections_decode_lean_as_peft_runs_them(family):
    """A LoRA layer adds its adapters in its forward; the lean step adds them the same way (every
    projection wrapped, Qwen3.5's Gated DeltaNet ones too, two adapters active at once): tokens and
    log-probs equal to transformers' step. Merged adapters (in the base weights) are not added twice."""
    from peft import LoraConfig, get_peft_model

    path = str(build_tiny(family))
    model = load_model(path, dtype=torch.float32)
    template = get_template(family, load_processor(path))
    config = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=r".*language_model.*_proj.*")  # dropout: eval mode
    peft_model = get_peft_model(model, LoraConfig(**config))
    peft_model.add_adapter("second", LoraConfig(**{**config, "r": 2}))
    peft_model.base_model.set_adapter(["default", "second"])
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make the adapters change the outputs
            param.data = torch.randn(param.shape, generator=generator) * 0.2
    eos = [template.tokenizer.eos_token_id, *template.stop_token_ids]
    kwargs = dict(eos_token_ids=eos, suppress_token_ids=[*template.suppress_token_ids, *eos])
    backends = {lean: SharedPrefixRollout(model, template, **kwargs, lean=lean) for lean in (False, True)}
    assert backends[True].lean is not None, LeanDecoder.supports(backends[True].decoder)
    wrapped = [m for m in model.modules() if hasattr(m, "lora_A") and "second" in m.lora_A]
    assert len(wrapped) >= 7 * len(backends[True].decoder.layers)  # every projection of every layer
    batch = template.collate([template.encode_prompt(_media_sample(template))] * 2)
    params = SamplingParams(num_generations=2, max_new_tokens=12, greedy=False)
    for merged in (False, True):
        if merged:
            peft_model.base_model.merge_adapter()
        results = {}
        for lean, backend in backends.items():
            torch.manual_seed(0)
            results[lean] = backend.sample(batch, params)
        (reference, ref_logps), (lean, lean_logps) = results[False], results[True]
        assert torch.equal(reference.completion_ids, lean.completion_ids)
        torch.testing.assert_close(lean_logps, ref_logps, atol=1e-5, rtol=0)
        if not merged:
            unadapted = _adapters_off(peft_model, backends[True], batch, params)
            assert not torch.equal(unadapted, lean.completion_ids)  # the adapters changed the rollout


def _adapters_off(peft_model, backend, batch, params):
    with peft_model.disable_adapter():
        torch.manual_seed(0)
        return backend.sample(batch, params)[0].completion_ids


def test_dora_projections_decode_through_transformers(tiny_qwen2_vl_path):
    """DoRA rescales the adapted weight by a learned magnitude: not the step's B(A(x)) sum, so the
    rollout decodes through transformers and equals HF generate on the adapted model."""
    from peft import LoraConfig, get_peft_model

    from mmgrpo.rollout.hf import HFRollout

    model = load_model(tiny_qwen2_vl_path, dtype=torch.float32)
    template = get_template("qwen2-vl", load_processor(tiny_qwen2_vl_path))
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0, use_dora=True))
    kwargs = dict(eos_token_ids=[template.tokenizer.eos_token_id])
    shared = SharedPrefixRollout(model, template, **kwargs)
    assert shared.lean is None and "DoRA" in LeanDecoder.supports(shared.decoder)[1]
    prompts = [template.encode_prompt(_media_sample(template))]
    params = SamplingParams(num_generations=2, max_new_tokens=12, greedy=True)
    hf = HFRollout(model, template, **kwargs)
    assert torch.equal(shared.generate(prompts, params).completion_ids, hf.generate(prompts, params).completion_ids)


@pytest.mark.parametrize("precision", ["bf16_weights", "bf16_autocast"])
def test_lean_step_in_bfloat16(precision, tiny_qwen2_vl_path):
    """Training with --bf16 rolls out under autocast (fp32 weights); bf16 checkpoints run in bf16.
    The lean step's dtypes follow transformers' op for op: the same tokens and log-probs."""
    weights = torch.bfloat16 if precision == "bf16_weights" else torch.float32
    model = load_model(tiny_qwen2_vl_path, dtype=weights)
    template = get_template("qwen2-vl", load_processor(tiny_qwen2_vl_path))
    eos = [template.tokenizer.eos_token_id, *template.stop_token_ids]
    kwargs = dict(eos_token_ids=eos, suppress_token_ids=[*template.suppress_token_ids, *eos])
    text = LoadedSample(id="t/0", messages=[{"role": "user", "content": "Hi."}])
    batch = template.collate([template.encode_prompt(s) for s in (_media_sample(template), text)])
    batch = {k: v.to(weights) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    params = SamplingParams(num_generations=3, max_new_tokens=16, greedy=True)
    results = []
    for lean in (False, True):
        backend = SharedPrefixRollout(model, template, **kwargs, lean=lean)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16_autocast"):
            results.append(backend.sample(batch, params))
    (reference, ref_logps), (lean, lean_logps) = results
    assert torch.equal(reference.completion_ids, lean.completion_ids)
    # one SDPA call per prompt instead of one per row, so bf16 rounds at other places:
    # log-probs of about -7 agree to 4e-3 (a bf16 step there is 3e-2)
    torch.testing.assert_close(lean_logps, ref_logps, atol=1e-2, rtol=0)


def test_wide_linear_runs_in_blocks_with_the_same_numbers():
    """A few rows through a weight far wider than deep (an LM head) run in blocks of its rows on the CPU:
    the same outputs, bias included, in the input's shape; one row, many rows and narrow weights run whole."""
    from unittest import mock

    import torch.nn.functional as F

    from mmgrpo.rollout.lean_decode import WIDE_BLOCK_BYTES, wide_linear

    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(8200, 1024, generator=generator), torch.randn(8200, generator=generator)  # 33.6 MB
    x = torch.randn(8, 1, 1024, generator=generator)
    with mock.patch("mmgrpo.rollout.lean_decode.F.linear", wraps=F.linear) as linear:
        got = wide_linear(x, weight, bias)
    assert linear.call_count == -(-8200 * 1024 * 4 // WIDE_BLOCK_BYTES) == 5  # equal blocks of 1,640 rows
    assert got.shape == (8, 1, 8200)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-6, atol=1e-5)  # (bit for bit on this CPU)
    for whole in (x[:1], torch.randn(65, 1024), torch.randn(8, 8200)):  # one row, many rows, a narrowing weight
        narrowing = whole.shape[-1] == 8200
        with mock.patch("mmgrpo.rollout.lean_decode.F.linear", wraps=F.linear) as linear:
            wide_linear(whole, weight.T.contiguous() if narrowing else weight)
        assert linear.call_count == 1
