"""Every model family beyond Qwen2-VL / Qwen2.5-VL: tiny builds, HF parity, log-prob parity, a GRPO step.

For each family (tiny random checkpoint of the real transformers classes):
  - the build is byte-identical and loads with the Auto classes (and mmgrpo.models.load_model);
  - the template gives the HF processor's input_ids and tensors, for every modality it takes;
  - completion log-probs through template.forward_inputs + backbone + chunked LM head (the engine's
    Policy path) equal generate(output_logits=True) scores for a left-padded batch of 2;
  - one GRPO-like step sends non-zero gradients to the media tower(s) and the language model.
"""

import filecmp
import os

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.forward.policy import Policy
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.templates import Template, get_template
from mmgrpo.templates.hooks import sampled_fps, video_metadata

FAMILIES = ["qwen3-vl", "qwen2-audio", "qwen2.5-omni", "llava-onevision", "gemma3", "qwen2"]

# What each family takes; a parity case runs for a family when it takes every medium the case has.
TAKES = {
    "qwen3-vl": {"image", "video"},
    "qwen2-audio": {"audio"},
    "qwen2.5-omni": {"image", "video", "audio"},
    "llava-onevision": {"image", "video"},
    "gemma3": {"image"},
    "qwen2": set(),
}
# The towers that must receive gradient in a GRPO step (component names of the template).
TOWERS = {
    "qwen3-vl": ["vision"],
    "qwen2-audio": ["audio"],
    "qwen2.5-omni": ["vision", "audio"],
    "llava-onevision": ["vision"],
    "gemma3": ["vision"],
    "qwen2": [],
}
MODEL_CLASS = {
    "qwen3-vl": "Qwen3VLForConditionalGeneration",
    "qwen2-audio": "Qwen2AudioForConditionalGeneration",
    "qwen2.5-omni": "Qwen2_5OmniThinkerForConditionalGeneration",
    "llava-onevision": "LlavaOnevisionForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
}


@pytest.fixture(scope="module")
def paths():
    return {family: str(build_tiny(family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def processors(paths):
    return {family: load_processor(path) for family, path in paths.items()}


@pytest.fixture(scope="module")
def models(paths):
    return {family: load_model(path) for family, path in paths.items()}


def _image(width, height, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def _video(num_frames=4, width=84, height=56, fps=2.0, sound_seconds=None):
    frames = np.random.RandomState(7).randint(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    metadata = {
        "fps": fps,
        "total_num_frames": 2 * num_frames,
        "frames_indices": list(range(0, 2 * num_frames, 2)),
        "duration": 2 * num_frames / fps,
        "width": width,
        "height": height,
    }
    video = Video(frames=frames, metadata=metadata)
    if sound_seconds:
        video.audio = _audio(sound_seconds, seed=5)  # the video's sound track (Qwen2.5-Omni)
    return video


def _audio(seconds, seed=0):
    t = np.arange(int(16000 * seconds)) / 16000
    noise = np.random.RandomState(seed).randn(t.size) * 0.05
    return (0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + noise).astype(np.float32)


def _sample(sample_id, content, images=(), videos=(), audios=(), system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    return LoadedSample(
        id=sample_id, messages=messages, images=list(images), videos=list(videos), audios=list(audios)
    )


# ---------------------------------------------------------------------------------------------
# Builds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_byte_identical_and_loads(family, tmp_path, paths, processors, models):
    first = build_tiny(family, cache_dir=tmp_path / "a")
    second = build_tiny(family, cache_dir=tmp_path / "b")
    names = sorted(os.listdir(first))
    assert first.name == second.name and names == sorted(os.listdir(second))
    _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert mismatch == [] and errors == []

    model, tokenizer = models[family], getattr(processors[family], "tokenizer", processors[family])
    assert type(model).__name__ == MODEL_CLASS[family] and not model.training
    assert 0.4e6 < sum(p.numel() for p in model.parameters()) < 2e6
    assert len(tokenizer) == model.config.get_text_config().vocab_size
    assert tokenizer.padding_side == "left"
    if family == "qwen2":
        assert type(processors[family]).__name__ == "Qwen2Tokenizer"  # a text model has no processor
    template = get_template(family, processors[family])
    for path in template.components.values():
        model.get_submodule(path)
    suppressed = set(tokenizer.convert_ids_to_tokens(template.suppress_token_ids))
    placeholders = {hook.placeholder for hook in template.media.values()}
    placeholders |= {tokenizer.convert_ids_to_tokens(hook.token_id) for hook in template.media.values()}
    assert placeholders <= suppressed
    assert set(template.stop_token_ids).isdisjoint(template.suppress_token_ids)
    # no final-logit soft-capping in the tiny builds (a capped model: tests/test_softcap.py)
    assert getattr(model.config.get_text_config(), "final_logit_softcapping", None) is None


def test_gemma3_image_projection_is_not_zero(models):
    projection = models["gemma3"].model.multi_modal_projector.mm_input_projection_weight
    assert projection.abs().sum() > 0  # transformers zero-initialises it: the image would have no effect


def test_full_qwen2_5_omni_checkpoint_loads_its_thinker(tmp_path, paths, models, processors):
    """The template says how the family's checkpoints load (`Template.model_class`): a full
    Qwen2.5-Omni folder (thinker + talker + vocoder) gives its thinker, as a skeleton too."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen2_5OmniConfig

    from mmgrpo.models.loading import model_skeleton

    thinker = AutoConfig.from_pretrained(paths["qwen2.5-omni"])
    Qwen2_5OmniConfig(thinker_config=thinker.to_dict()).save_pretrained(tmp_path)
    weights = load_file(os.path.join(paths["qwen2.5-omni"], "model.safetensors"))
    save_file(
        {"thinker." + k: v for k, v in weights.items()}, str(tmp_path / "model.safetensors"), {"format": "pt"}
    )
    template = get_template("qwen2.5-omni", processors["qwen2.5-omni"])
    loaded = load_model(str(tmp_path), template=template)
    assert type(loaded).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert type(model_skeleton(str(tmp_path), template)).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    reference = models["qwen2.5-omni"].state_dict()
    assert all(torch.equal(value, reference[name]) for name, value in loaded.state_dict().items())


# ---------------------------------------------------------------------------------------------
# Parity with the HF processor, for each modality a family takes
# ---------------------------------------------------------------------------------------------

CASES = {
    "text_only": dict(content="What is seven plus five?"),
    "one_image": dict(content="<image>What colour is the shape?", images=[(84, 56)]),
    "two_images": dict(
        content="Compare <image> with <image>: which is bigger?", images=[(90, 60), (50, 120)]
    ),
    "big_image": dict(content="<image>Where is it?", images=[(300, 100)]),
    "video": dict(content="<video>What moves?", videos=1),
    "audio": dict(content="<audio>What is the sound?", audios=[1.3]),
    "two_audios": dict(content="Is <audio> the same as <audio>?", audios=[0.7, 2.2]),
    "image_audio_video": dict(
        content="<image><audio>Then <video>: match?", images=[(56, 84)], audios=[1.1], videos=1
    ),
}
PARITY = [
    (family, case)
    for family in FAMILIES
    for case, spec in CASES.items()
    if {k[:-1] for k in ("images", "videos", "audios") if spec.get(k)} <= TAKES[family]
] + [("qwen2.5-omni", "video_with_sound")]


def _case(case):
    if case == "video_with_sound":
        return (
            "<audio>Listen, then <video>: same sound?",
            [],
            [_video(sound_seconds=2.0)],
            [_audio(0.9, seed=2)],
        )
    spec = CASES[case]
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(spec.get("images", []))]
    videos = [_video() for _ in range(spec.get("videos", 0))]
    audios = [_audio(s, seed=i) for i, s in enumerate(spec.get("audios", []))]
    return spec["content"], images, videos, audios


def _hf_inputs(family, processor, template, text, images, videos, audios):
    """The HF processor on rendered text and raw media, called as that family expects."""
    if family == "qwen2":
        return processor(text=[text], return_tensors="pt", add_special_tokens=False)
    kwargs = {}
    if images:
        kwargs["images"] = (
            [images] if family in ("llava-onevision", "gemma3") else images
        )  # nested per prompt
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        if family in ("qwen3-vl", "qwen2.5-omni"):
            kwargs["videos_kwargs"] = {
                "video_metadata": [video_metadata(v) for v in videos],
                "do_sample_frames": False,
                "size": template.media["video"].size
                if family == "qwen2.5-omni"
                else template.media["video"].videos.size,
                "fps": sampled_fps(videos[0]),
            }
    tracks = [v.audio for v in videos if getattr(v, "audio", None) is not None]
    if audios or tracks:
        kwargs["audio"] = list(audios) + tracks
        kwargs["sampling_rate"] = 16000
    if tracks:  # Qwen2.5-Omni: the standalone clips, then the video's track
        kwargs["audio_from_video_indices"] = [None] * len(audios) + [0]
        kwargs["load_audio_from_video"] = True
    return processor(text=[text], return_tensors="pt", **kwargs)


@pytest.mark.parametrize(("family", "case"), PARITY)
def test_parity_with_hf_processor(family, case, processors):
    processor = processors[family]
    options = {"use_audio_in_video": True} if case == "video_with_sound" else {}
    template = get_template(family, processor, **options)
    content, images, videos, audios = _case(case)
    sample = _sample(f"parity/{case}", content, images, videos, audios, system="Answer briefly.")
    prompt = template.encode_prompt(sample)

    messages = [{"role": m["role"], "content": Template.content_parts(m["content"])} for m in sample.messages]
    tokenizer = getattr(processor, "tokenizer", processor)
    hf_text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_text == prompt.prompt_text  # the rollout payload is what the HF processor takes
    expected = _hf_inputs(family, processor, template, hf_text, images, videos, audios)
    assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist(), tokenizer.decode(
        prompt.prompt_ids
    )
    expected_keys = {k for k in expected if k not in ("input_ids", "attention_mask")}
    assert set(prompt.mm) == expected_keys
    for key in expected_keys:
        want = torch.as_tensor(expected[key])
        want = want[0] if key in template.token_keys else want
        assert torch.equal(prompt.mm[key], want.to(prompt.mm[key].dtype)), key
    for hook in template.media.values():  # every placeholder became its expansion
        assert prompt.prompt_text.count(hook.placeholder) == len(getattr(sample, hook.modality + "s"))


def test_qwen3_vl_video_timestamps(processors):
    template = get_template("qwen3-vl", processors["qwen3-vl"])
    prompt = template.encode_prompt(_sample("ts/0", "<video>?", videos=[_video(num_frames=4, fps=2.0)]))
    text = processors["qwen3-vl"].tokenizer.decode(prompt.prompt_ids)
    # frames 0, 2, 4, 6 of a 2 fps clip: temporal patches at (0 + 1) / 2 and (2 + 3) / 2 seconds
    assert "<0.5 seconds><|vision_start|>" in text and "<2.5 seconds><|vision_start|>" in text


# ---------------------------------------------------------------------------------------------
# Log-probs of the engine's path equal generate's scores; one GRPO step reaches every tower
# ---------------------------------------------------------------------------------------------


def _batch_samples(family, sound=False):
    """Two prompts of different lengths and media sizes (left padding), using what the family takes.

    sound: the video has a sound track (Qwen2.5-Omni's use_audio_in_video).
    """
    takes = TAKES[family]
    first = dict(
        images=[_image(84, 56)] if "image" in takes else [], audios=[_audio(1.0)] if "audio" in takes else []
    )
    second = dict(
        images=[_image(140, 112, seed=1)] if "image" in takes else [],
        videos=[_video(sound_seconds=2.5 if sound else None)] if "video" in takes else [],
        audios=[_audio(2.1, seed=1)] if "audio" in takes else [],
    )
    tags = {"images": "<image>", "videos": "<video>", "audios": "<audio>"}
    text0 = "".join(tags[k] for k, v in first.items() for _ in v) + "Hi."
    text1 = (
        "Think: " + "".join(tags[k] + " and " for k, v in second.items() for _ in v) + "which is the red one?"
    )
    return [_sample("lp/0", text0, **first), _sample("lp/1", text1, **second)]


def _sequence_logps(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize(
    ("family", "options"), [(f, {}) for f in FAMILIES] + [("qwen2.5-omni", {"use_audio_in_video": True})]
)
def test_forward_logprobs_match_generate_and_grpo_step(family, options, processors, models):
    template, model = get_template(family, processors[family], **options), models[family]
    prompts = [template.encode_prompt(s) for s in _batch_samples(family, sound=bool(options))]
    batch = template.collate(prompts)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][1].all()  # left padding
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=6,
            do_sample=True,
            suppress_tokens=template.suppress_token_ids,
            output_logits=True,
            return_dict_in_generate=True,
        )
    prompt_len = batch["input_ids"].shape[1]
    completion_ids = out.sequences[:, prompt_len:]  # [2, T]
    assert not torch.isin(completion_ids, torch.tensor(template.suppress_token_ids or [-1])).any()
    expected = _sequence_logps(torch.stack(out.logits, dim=1), completion_ids)  # [2, T]
    mask = torch.ones_like(completion_ids)

    policy = Policy(model, template)
    forward_batch = policy.forward_batch(prompts, [1, 1])  # one completion per prompt
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)  # the engine's path
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)

    # with the exact positions generate used, and G=2 completions per prompt (rows and media repeated)
    grouped_ids = completion_ids.repeat_interleave(2, dim=0)  # [4, T]
    inputs = template.forward_inputs(batch, grouped_ids, torch.ones_like(grouped_ids), model=model)
    backbone = model.get_submodule(template.components["backbone"])
    lm_head = model.get_submodule(template.components["lm_head"])
    with torch.no_grad():
        hidden = backbone(**inputs, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]
        grouped = _sequence_logps(lm_head(hidden), grouped_ids)
    torch.testing.assert_close(grouped, expected.repeat_interleave(2, dim=0), atol=1e-5, rtol=0)

    # one GRPO-like step: the towers and the language model all receive gradient
    model.zero_grad(set_to_none=True)
    logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
    advantages = torch.tensor([1.0, -1.0])[:, None]
    loss = -(logps * advantages).sum()
    loss.backward()
    for part in [*TOWERS[family], "llm"]:
        grads = [p.grad for p in policy.component(part).parameters() if p.grad is not None]
        assert grads and sum(g.abs().sum() for g in grads) > 0, f"{family}: no gradient in {part}"
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# Errors, boxes, options
# ---------------------------------------------------------------------------------------------

NOT_TAKEN = {
    "qwen3-vl": ("audio", dict(audios=[_audio(0.5)])),
    "qwen2-audio": ("image", dict(images=[_image(56, 56)])),
    "llava-onevision": ("audio", dict(audios=[_audio(0.5)])),
    "gemma3": ("video", dict(videos=[_video()])),
    "qwen2": ("image", dict(images=[_image(56, 56)])),
}


@pytest.mark.parametrize("family", sorted(NOT_TAKEN))
def test_a_modality_not_taken_is_a_data_error(family, processors):
    kind, media = NOT_TAKEN[family]
    sample = _sample("ds/train/9", f"<{kind}>What is it?", **media)
    with pytest.raises(DataError, match=rf"ds/train/9.*{kind}.*{family}"):
        get_template(family, processors[family]).encode_prompt(sample)


def test_box_conventions(processors):
    image_size, input_size = (1000, 500), (448, 224)
    rel1000 = [100.0, 200.0, 500.0, 1000.0]
    assert get_template("qwen3-vl", processors["qwen3-vl"]).box_to_image(rel1000, image_size, input_size) == [
        100.0,
        100.0,
        500.0,
        500.0,
    ]
    assert get_template("gemma3", processors["gemma3"]).box_to_image(rel1000, image_size, input_size) == [
        100.0,
        100.0,
        500.0,
        500.0,
    ]
    omni = get_template("qwen2.5-omni", processors["qwen2.5-omni"])
    assert omni.box_to_image([224, 112, 448, 224], image_size, input_size) == [500.0, 250.0, 1000.0, 500.0]
    llava = get_template("llava-onevision", processors["llava-onevision"])
    assert llava.box_to_image([0.1, 0.2, 0.5, 1.0], image_size, input_size) == [100.0, 100.0, 500.0, 500.0]
    prompt = omni.encode_prompt(_sample("b/0", "<image>Where?", images=[_image(168, 112)]))
    assert prompt.input_sizes == [(168, 112)] and omni.box_mapper(prompt)([0, 0, 84, 56]) == [
        0.0,
        0.0,
        84.0,
        56.0,
    ]
    audio = get_template("qwen2-audio", processors["qwen2-audio"])
    audio_prompt = audio.encode_prompt(_sample("b/1", "<audio>?", audios=[_audio(0.5)]))
    with pytest.raises(DataError, match="b/1.*0 image"):
        audio.box_mapper(audio_prompt)([0, 0, 1, 1])
    with pytest.raises(ConfigError, match="no box convention"):
        audio.box_to_image([0, 0, 1, 1], image_size, input_size)


def test_options(processors):
    # media options of modalities a family does not take are ignored; unknown ones are errors
    get_template("qwen2", processors["qwen2"], max_pixels=28 * 28 * 4, video_fps=2.0)
    with pytest.raises(ConfigError, match="unknown option"):
        get_template("gemma3", processors["gemma3"], max_pixel=1)
    omni = get_template("qwen2.5-omni", processors["qwen2.5-omni"], use_audio_in_video=True)
    silent = _sample("o/3", "<video>?", videos=[_video()])
    with pytest.raises(DataError, match="o/3.*no sound track"):
        omni.encode_prompt(silent)
    assert omni.sampling_rate == 16000 and get_template("gemma3", processors["gemma3"]).sampling_rate is None


def test_llava_onevision_rejects_mixed_frame_counts(processors):
    template = get_template("llava-onevision", processors["llava-onevision"])
    prompts = [
        template.encode_prompt(_sample(f"v/{n}", "<video>?", videos=[_video(num_frames=n)])) for n in (2, 4)
    ]
    with pytest.raises(DataError, match="one frame count.*v/2, v/4"):
        template.collate(prompts)
