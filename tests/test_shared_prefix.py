"""Shared-prefix forward and rollout: equal to the naive paths, for every family: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, the Qwen2.5-Omni thinker (with and without use_audio_in_video), Qwen2
(text), Qwen2-Audio, LLaVA-OneVision and Gemma3 (and Gemma3 with a sliding window shorter than
prompt + completion).

Naive reference: every prompt repeated G times with its media, prompt + completion in one
forward (`template.forward_inputs`), as HF generate (`num_return_sequences=G`) and the plain
log-prob forward do. All fp32, tolerance 1e-5.
"""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.forward.shared_prefix import model_parts, shared_prefix_hidden, supports_shared_prefix
from mmgrpo.grpo.logprobs import completion_logprobs
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.rollout.base import SamplingParams
from mmgrpo.rollout.shared_prefix_engine import SharedPrefixRollout
from mmgrpo.rollout.token_sampler import filter_logits
from mmgrpo.templates import get_template

FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen2.5-omni", "qwen2.5-omni+sound",
            "qwen2", "qwen2-audio", "llava-onevision", "gemma3"]  # fmt: skip
FAMILIES += ["qwen3-omni", "qwen3-omni+sound"]  # MoE thinker: its router and experts act per token
FAMILIES += ["glm4v", "glm4v-moe"]  # their video batches: tests/test_family_glm4v.py
FAMILIES += ["internvl"]
FAMILIES += ["qwen3.5", "qwen3.5-moe"]  # hybrid decoders: Gated DeltaNet states shared as K/V are
FAMILIES += ["gemma4"]  # KV-shared layers, per-layer inputs, sliding windows, bidirectional image blocks
GROUP = 3  # G completions per prompt


def _image(width, height, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def _video(num_frames=4, width=56, height=56, fps=2.0):
    frames = np.random.RandomState(7).randint(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    metadata = {"fps": fps, "total_num_frames": num_frames, "frames_indices": list(range(num_frames)),
                "duration": num_frames / fps, "width": width, "height": height}  # fmt: skip
    return Video(frames=frames, metadata=metadata, audio=_audio(num_frames / fps, seed=5))  # sound: Omni only


def _audio(seconds, seed=0):
    t = np.arange(int(16000 * seconds)) / 16000
    noise = np.random.RandomState(seed).randn(t.size) * 0.05
    return (0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + noise).astype(np.float32)


@pytest.fixture(scope="module")
def setups(tiny_qwen2_vl_path, tiny_qwen2_5_vl_path):
    """family -> (model, template), fp32, eval mode."""
    paths = {"qwen2-vl": tiny_qwen2_vl_path, "qwen2.5-vl": tiny_qwen2_5_vl_path}
    others = ("qwen3-vl", "qwen3-vl-moe", "qwen2.5-omni", "qwen2", "qwen2-audio", "llava-onevision", "gemma3", "qwen3-omni",
              "internvl", "qwen3.5", "qwen3.5-moe", "gemma4")
    paths |= {family: str(build_tiny(family)) for family in others}
    paths |= {family: str(build_tiny(family)) for family in ("glm4v", "glm4v-moe")}
    out = {}
    for family, path in paths.items():
        model = load_model(path, dtype=torch.float32)  # Qwen2.5-Omni: its thinker
        out[family] = (model, get_template(family, load_processor(path)))
    # Qwen2.5-Omni with use_audio_in_video: each video's sound track interleaved with its frames
    model, _ = out["qwen2.5-omni"]
    out["qwen2.5-omni+sound"] = (
        model,
        get_template("qwen2.5-omni", load_processor(paths["qwen2.5-omni"]), use_audio_in_video=True),
    )
    model, _ = out["qwen3-omni"]  # Qwen3-Omni's thinker with its videos' sound
    out["qwen3-omni+sound"] = (model, get_template("qwen3-omni", load_processor(paths["qwen3-omni"]), use_audio_in_video=True))
    return out


# A prompt kind a family does not take is read as one it takes, of another length.
READS = {
    "qwen2.5-omni": {"text": "audio"},  # the thinker hears: an audio prompt instead of the text one
    "qwen3-omni": {"text": "audio"},
    "qwen2": {"image": "question", "two_images": "long_text", "video": "story"},
    "qwen2-audio": {"image": "audio", "two_images": "two_audios", "video": "late_audio"},
    # the tiny Gemma3 answers "Which is red, <image> or <image>? ..." with one token repeated: no
    # EOS would end rows at different steps in the greedy test
    "gemma3": {"two_images": "images_first", "video": "late_image"},
    # transformers' GLM forward takes images and videos in separate batches only
    "glm4v": {"video": "late_image"},
    "glm4v-moe": {"video": "late_image"},
    "internvl": {"video": "late_image"},
    "gemma4": {"text": "audio"},  # the tiny Gemma 4 has E2B's audio tower
}


def _prompt_batch(template, kinds=("image", "two_images", "text", "video")):
    return template.collate(_prompts(template, kinds))


def _prompts(template, kinds=("image", "two_images", "text", "video")):
    """Left-padded prompts of different lengths: one image, two images of other sizes, text only (an
    audio for Qwen2.5-Omni), a video (with its sound where the template uses it); see READS for the
    families without some of these. LLaVA-OneVision: the one image is tiled (anyres), the two are
    base views only, in one batch."""
    samples = {
        "image": LoadedSample(id="s/0", messages=[{"role": "user", "content": "<image>Describe this."}],
                              images=[_image(84, 56)]),
        "two_images": LoadedSample(
            id="s/1", messages=[{"role": "user", "content": "Which is red, <image> or <image>? Think step by step."}],
            images=[_image(140, 112, seed=1), _image(56, 56, seed=2)]),
        "text": LoadedSample(id="s/2", messages=[{"role": "user", "content": "Hi."}]),
        "audio": LoadedSample(id="s/4", messages=[{"role": "user", "content": "<audio>What is it?"}],
                              audios=[_audio(1.1)]),
        "video": LoadedSample(id="s/3", messages=[{"role": "user", "content": "What happens? <video>"}],
                              videos=[_video()]),
        "two_audios": LoadedSample(id="s/5", messages=[{"role": "user", "content": "<audio>Louder than <audio>?"}],
                                   audios=[_audio(0.6, seed=1), _audio(1.5, seed=2)]),  # two clips, one row
        "late_audio": LoadedSample(id="s/6", messages=[{"role": "user", "content": "Say it word for word: <audio>"}],
                                   audios=[_audio(2.0, seed=3)]),
        "images_first": LoadedSample(
            id="s/11", messages=[{"role": "user", "content": "<image><image>Which is red? Think step by step."}],
            images=[_image(140, 112, seed=1), _image(56, 56, seed=2)]),
        "late_image": LoadedSample(id="s/7", messages=[{"role": "user", "content": "What is this, step by step? <image>"}],
                                   images=[_image(56, 84, seed=3)]),
        "question": LoadedSample(id="s/8", messages=[{"role": "user", "content": "What is 2 + 3? Answer briefly."}]),
        "long_text": LoadedSample(id="s/9", messages=[{"role": "user", "content":
                                  "Which is red, a circle or a square? Think step by step, then answer in a word."}]),
        "story": LoadedSample(id="s/10", messages=[{"role": "user", "content": "Tell a story about a cat."}]),
    }  # fmt: skip
    reads = READS.get(template.name, {})
    return [template.encode_prompt(samples[reads.get(kind, kind)]) for kind in kinds]


def _completions(num_prompts, length=7, seed=0):
    """Random completion ids (no special tokens) and right-padded masks of varied lengths."""
    generator = torch.Generator().manual_seed(seed)
    num_rows = num_prompts * GROUP
    ids = torch.randint(0, 1400, (num_rows, length), generator=generator)  # [N, T]
    lengths = torch.randint(1, length + 1, (num_rows,), generator=generator)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()  # [N, T]
    return ids, mask


def _naive_hidden(model, template, batch, ids, mask):
    inputs = template.forward_inputs(batch, ids, mask, model=model)
    prompt_len = batch["input_ids"].shape[1]
    return model.model(**inputs, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]  # [N, T, H]


def _logps_and_grads(model, hidden_fn, ids, mask, weights):
    model.zero_grad(set_to_none=True)
    hidden = hidden_fn()
    logps, _ = completion_logprobs(hidden, model.lm_head.weight, ids, chunk_size=16)
    logps = logps * mask
    (logps * weights).sum().backward()
    # the gradient tensors themselves (set_to_none leaves them to us): no copy, which at a real
    # vocabulary is 1.2 GB for the embedding alone (tests/test_real_size.py)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logps.detach(), grads


TOWER_INPUTS = {"vision": ("pixel_values", "pixel_values_videos"), "audio": ("input_features",)}


def _assert_grads_equal(expected, got, template, batch):
    assert expected.keys() == got.keys()
    for tower, keys in TOWER_INPUTS.items():  # through the shared K/V into each media tower the batch uses
        if any(key in batch for key in keys):
            assert any(name.startswith(template.components[tower] + ".") for name in got), tower
    for name in expected:
        # in slices: a real vocabulary's 311M-element embedding gradient, compared whole, makes
        # several 1.2 GB temporaries (tests/test_real_size.py)
        expected_flat, got_flat = expected[name].flatten(), got[name].flatten()
        # float32 rounding of sums scales with the gradient's size: the tiny Gemma 4's reach 700 (its
        # soft-capped, four-norm layers), and its two forwards then differ by up to 2e-5 of that
        scale = 5e-5 if template.name == "gemma4" else 1e-5
        atol = scale * max(1.0, float(expected_flat.abs().max()))
        for start in range(0, expected_flat.numel(), 1 << 22):
            part = slice(start, start + (1 << 22))
            torch.testing.assert_close(got_flat[part], expected_flat[part], atol=atol, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------
# Training forward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logps_and_gradients_match_naive(family, setups):
    model, template = setups[family]
    batch = _prompt_batch(template)
    assert batch["attention_mask"][:, 0].tolist().count(0) == 3  # left padding, mixed lengths
    ids, mask = _completions(4)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    expected, expected_grads = _logps_and_grads(
        model, lambda: _naive_hidden(model, template, batch, ids, mask), ids, mask, weights
    )
    got, grads = _logps_and_grads(
        model, lambda: shared_prefix_hidden(model, template, batch, ids, mask, GROUP), ids, mask, weights
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    _assert_grads_equal(expected_grads, grads, template, batch)  # Omni, Qwen2-Audio: the audio tower too
    if family == "llava-onevision":  # one tiled image and two base views in one batch
        assert batch["batch_num_images"].tolist() == [1, 2, 0, 0]
    if family == "qwen2-audio":  # clips of the rows: 1, 2 (one prompt holds two), 0, 1
        assert batch["input_features"].shape[0] == 4


def test_unequal_groups(setups):
    """Per-prompt row counts (a micro-batch that splits groups) = the selected rows of equal groups."""
    model, template = setups["qwen2.5-vl"]
    batch = _prompt_batch(template, ("image", "two_images", "text"))
    ids, mask = _completions(3, seed=4)  # G = 3 rows per prompt
    keep = torch.tensor([0, 3, 4, 5, 7])  # 1, 3 and 1 rows of prompts 0, 1, 2
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(5))
    weights_kept = torch.zeros_like(weights)
    weights_kept[keep] = weights[keep]
    expected, expected_grads = _logps_and_grads(
        model, lambda: shared_prefix_hidden(model, template, batch, ids, mask, GROUP), ids, mask, weights_kept
    )
    got, grads = _logps_and_grads(
        model,
        lambda: shared_prefix_hidden(model, template, batch, ids[keep], mask[keep], [1, 3, 1]),
        ids[keep],
        mask[keep],
        weights[keep],
    )
    torch.testing.assert_close(got, expected[keep], atol=1e-5, rtol=0)
    _assert_grads_equal(expected_grads, grads, template, batch)
    with pytest.raises(ValueError, match="do not match"):
        shared_prefix_hidden(model, template, batch, ids[keep], mask[keep], [1, 3, 2])


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing(family, setups):
    """Non-reentrant checkpointing: same grads as the naive forward without it; reentrant is refused."""
    model, template = setups[family]
    batch = _prompt_batch(template, ("image", "two_images"))
    ids, mask = _completions(2, seed=3)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    expected, expected_grads = _logps_and_grads(
        model, lambda: _naive_hidden(model, template, batch, ids, mask), ids, mask, weights
    )
    model.train()
    try:
        model.activation_checkpointing_enable({"use_reentrant": False})
        assert supports_shared_prefix(model, template) == (True, "")
        got, grads = _logps_and_grads(
            model, lambda: shared_prefix_hidden(model, template, batch, ids, mask, GROUP), ids, mask, weights
        )
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        _assert_grads_equal(expected_grads, grads, template, batch)

        model.activation_checkpointing_enable({"use_reentrant": True})
        ok, reason = supports_shared_prefix(model, template)
        assert not ok and "reentrant" in reason
        with pytest.raises(ValueError, match="reentrant"):
            shared_prefix_hidden(model, template, batch, ids, mask, GROUP)
    finally:
        model.activation_checkpointing_disable()
        model.eval()


def test_single_token_completions(setups):
    model, template = setups["qwen2-vl"]
    batch = _prompt_batch(template, ("image", "text"))
    ids, mask = _completions(2, length=1)
    with torch.no_grad():
        expected = _naive_hidden(model, template, batch, ids, mask)
        got = shared_prefix_hidden(model, template, batch, ids, mask, GROUP)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_supports_shared_prefix(setups):
    for family in FAMILIES:
        assert supports_shared_prefix(*setups[family]) == (True, ""), family
    model, template = setups["qwen2-vl"]
    undeclared = type("Undeclared", (type(template),), {"shared_prefix": False, "name": "undeclared"})
    ok, reason = supports_shared_prefix(model, undeclared(template.processor))
    assert not ok and "does not declare shared_prefix" in reason
    elsewhere = type("Elsewhere", (type(template),), {"components": {**template.components, "llm": "model.nowhere"}})
    ok, reason = supports_shared_prefix(model, elsewhere(template.processor))
    assert not ok and "nowhere" in reason
    # what the paths do not handle is refused, with the reason
    for family, key, value, words in [
        ("qwen2", "layer_types", ["sliding_attention", "full_attention"], "sliding_attention"),
        ("gemma3", "use_bidirectional_attention", True, "bidirectional"),
    ]:
        config = setups[family][0].config.get_text_config()
        saved = getattr(config, key)
        setattr(config, key, value)
        try:
            ok, reason = supports_shared_prefix(*setups[family])
            assert not ok and words in reason, reason
        finally:
            setattr(config, key, saved)


# ---------------------------------------------------------------------------------------------
# Rollout
# ---------------------------------------------------------------------------------------------


def _backend(model, template, eos_token_ids):
    return SharedPrefixRollout(model, template, eos_token_ids=eos_token_ids, check_every=3)


def _first_new_token(rows: list[list[int]], start: int) -> int:
    """A token of row 0 (else of the first row that has one) at index >= start that no row has
    before that index: as EOS, that row ends there (a tiny random model repeats itself, so most
    tokens would end rows at once)."""
    for tokens in rows:
        for index in range(start, len(tokens)):
            if all(tokens[index] not in row[:index] for row in rows):
                return tokens[index]
    raise AssertionError(f"no fresh token in {rows}")


def _assert_greedy_equals_hf_generate(model, template, prompts, attention):
    batch = template.collate(prompts)
    # EOS ids that some rows produce early, so rows stop at different steps
    probe = _backend(model, template, [template.pad_token_id]).generate(
        prompts, SamplingParams(num_generations=1, max_new_tokens=8, greedy=True)
    )
    eos = [template.pad_token_id, _first_new_token(probe.completion_ids.tolist(), start=2)]
    params = SamplingParams(num_generations=GROUP, max_new_tokens=10, greedy=True)
    decoder = model_parts(model, template)[1]  # the decoder's attention (Gemma 4's audio tower has no sdpa)
    try:
        decoder.set_attn_implementation(attention)
        rollout = _backend(model, template, eos).generate(prompts, params)
        # HF generate refuses num_return_sequences > 1 when greedy: repeat the rows instead (same thing)
        with torch.no_grad():
            output = model.generate(
                **template.repeat_rows(batch, GROUP), do_sample=False, max_new_tokens=10,
                eos_token_id=eos, pad_token_id=template.pad_token_id, suppress_tokens=template.suppress_token_ids,
            )  # fmt: skip
    finally:
        decoder.set_attn_implementation("sdpa")
    expected = output[:, batch["input_ids"].shape[1] :]
    assert rollout.completion_ids.tolist() == expected.tolist()
    # EOS is a token row 0 first makes at index >= 2: at least 3 tokens, some rows end early
    assert int(rollout.lengths.min()) >= 3 and rollout.truncated.sum() < len(rollout.truncated)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(
    # "single": one prompt whose greedy continuation does not repeat itself from its first token in
    # any family (two images: LLaVA-OneVision and Gemma3 alternate two tokens, and no EOS could end them at 3+)
    "kinds", [("image", "two_images", "video"), ("image",)], ids=["padded", "single"]
)
def test_greedy_rollout_equals_hf_generate(family, attention, kinds, setups):
    model, template = setups[family]
    _assert_greedy_equals_hf_generate(model, template, _prompts(template, kinds), attention)


def _sampled_logps_and_naive(model, template, batch, eos=tuple(range(0, 1500, 9))):
    """A sampled rollout's log-probs, as the decode loop computed them, and the naive forward's.
    eos: about one token in 9 of the tiny vocabulary ends a row, so lengths vary."""
    eos = list(eos)
    params = SamplingParams(num_generations=4, max_new_tokens=12, temperature=0.8, top_k=200, top_p=0.95)
    torch.manual_seed(0)
    rollout, logps = _backend(model, template, eos).sample(batch, params)
    ids, mask = rollout.completion_ids, rollout.completion_mask
    assert ids.shape[0] == 3 * 4 and len(set(rollout.lengths.tolist())) > 2
    assert (ids[mask == 0] == template.pad_token_id).all()
    assert not torch.isin(ids, torch.tensor(template.suppress_token_ids)).any()
    assert rollout.truncated.tolist() == (~torch.isin(ids, torch.tensor(eos)).any(1)).tolist()
    with torch.no_grad():
        hidden = _naive_hidden(model, template, batch, ids, mask)
        expected, _ = completion_logprobs(hidden, model.lm_head.weight, ids, temperature=0.8)
    return logps, expected * mask


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_logps_match_naive_forward(family, setups):
    model, template = setups[family]
    batch = _prompt_batch(template, ("image", "two_images", "text"))
    logps, expected = _sampled_logps_and_naive(model, template, batch)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)


class _CountedSteps:
    """A rollout's decode stepper that records how many rows each decode step feeds."""

    def __init__(self, steps, sizes: list):
        self.steps, self.sizes = steps, sizes

    def __call__(self, token, step):
        self.sizes.append(token.shape[0])
        return self.steps(token, step)

    def keep(self, rows):
        self.steps.keep(rows)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family, lean", [("qwen2-vl", True), ("qwen2-vl", False), ("qwen2.5-omni", True),
                                          ("qwen2-audio", True), ("gemma3", False), ("qwen3-omni", False),
                                          ("qwen3.5", False), ("qwen3.5", True),
                                          ("gemma4", False)])  # fmt: skip
def test_finished_prompts_leave_the_decode_batch(family, lean, greedy, setups, monkeypatch):
    """A prompt whose G rows have all finished stops being decoded (a mixture's short answers beside
    long ones), and the rollout is the one that decodes every row to the end, token for token."""
    model, template = setups[family]
    prompts = _prompts(template, ("image", "two_images", "text", "video"))
    eos = [template.pad_token_id, *template.eos_token_ids]
    no_eos = [*template.suppress_token_ids, *eos]  # rows end at their prompt's budget only
    # prompts 0 and 2 end after 2 tokens, prompt 1 after 5, prompt 3 runs all 12
    params = SamplingParams(num_generations=GROUP, max_new_tokens=12, greedy=greedy, temperature=0.9, seed=5,
                            max_new_tokens_per_prompt=[2, 5, 2, 12])  # fmt: skip
    sizes = []
    stepper = SharedPrefixRollout._stepper
    monkeypatch.setattr(SharedPrefixRollout, "_stepper", lambda self, *args: _CountedSteps(stepper(self, *args), sizes))

    def rollout(drop_finished):
        sizes.clear()
        backend = SharedPrefixRollout(model, template, eos_token_ids=eos, suppress_token_ids=no_eos,
                                      check_every=2, lean=lean, drop_finished=drop_finished)  # fmt: skip
        assert (backend.lean is not None) == lean
        return backend.generate(prompts, params), list(sizes)

    full, full_sizes = rollout(drop_finished=False)  # every row decodes every step
    dropped, dropped_sizes = rollout(drop_finished=True)
    rows = 4 * GROUP
    assert full_sizes == [rows] * 11
    # checks after steps 2 and 6: prompts 0 and 2 (half the batch) leave at the first, prompt 1 at the second
    assert dropped_sizes == [rows] + [2 * GROUP] * 4 + [GROUP] * 6
    assert dropped.completion_ids.tolist() == full.completion_ids.tolist()
    assert dropped.completion_mask.tolist() == full.completion_mask.tolist()
    assert dropped.lengths.tolist() == [2] * GROUP + [5] * GROUP + [2] * GROUP + [12] * GROUP
    torch.testing.assert_close(dropped.logps, full.logps, atol=1e-5, rtol=0)


def test_prompts_leave_together_a_quarter_of_the_batch_at_least():
    """Dropping copies the K/V of the prompts that stay, so prompts leave in bunches: once at least
    a quarter of the decoding prompts have finished all their rows."""
    finished = torch.zeros(8, 2, dtype=torch.bool)  # 8 prompts, G = 2
    finished[0] = True  # prompt 0 done
    finished[1, 0] = finished[3, 1] = True  # one row of prompts 1 and 3: not done
    assert SharedPrefixRollout._drop_finished(finished.flatten(), group=2) is None  # 1 of 8
    finished[5] = True
    kept = SharedPrefixRollout._drop_finished(finished.flatten(), group=2)  # 2 of 8
    assert kept.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15]


def test_gemma3_sliding_window(setups):
    """A sliding window shorter than prompt + completion (the tiny Gemma3's layer 0 slides, layer 1
    is full): forward, gradients, greedy rollouts (with and without padding) and sampled log-probs
    equal the naive ones, which differ from those under the checkpoint's 512-token window."""
    model, template = setups["gemma3"]
    config = model.config.get_text_config()
    batch = _prompt_batch(template, ("image", "two_images", "text"))
    ids, mask = _completions(3, length=12, seed=6)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(7))
    naive = lambda: _naive_hidden(model, template, batch, ids, mask)  # noqa: E731
    wide, _ = _logps_and_grads(model, naive, ids, mask, weights)
    saved, config.sliding_window = config.sliding_window, 16
    try:
        assert batch["input_ids"].shape[1] > config.sliding_window
        expected, expected_grads = _logps_and_grads(model, naive, ids, mask, weights)
        assert (expected - wide).abs().max() > 1e-3  # the window applies
        got, grads = _logps_and_grads(
            model, lambda: shared_prefix_hidden(model, template, batch, ids, mask, GROUP), ids, mask, weights
        )
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        _assert_grads_equal(expected_grads, grads, template, batch)
        for attention in ("sdpa", "eager"):
            # padded: a 4D mask at every step; single: none until the window is passed
            for kinds in [("image", "two_images", "video"), ("two_images",)]:
                _assert_greedy_equals_hf_generate(model, template, _prompts(template, kinds), attention)
        logps, expected = _sampled_logps_and_naive(model, template, batch)
        torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
    finally:
        config.sliding_window = saved


def test_filter_logits_matches_transformers():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    for top_k, top_p in [(5, 1.0), (0, 0.7), (10, 0.5), (0, 1.0)]:
        expected = logits / 0.7
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(None, expected)
        torch.testing.assert_close(filter_logits(logits, 0.7, top_k, top_p), expected)
