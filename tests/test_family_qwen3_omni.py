"""Qwen3-Omni's thinker (tiny:qwen3-omni): its build, parity with Qwen3OmniMoeProcessor for every
medium (video with its sound track included), log-probs equal to generate's, a GRPO step that moves
every weight (towers, router, experts), the full checkpoint's thinker, and SFT / eval / resume.
"""

import filecmp
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.forward.policy import Policy
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.templates import Template, get_template
from mmgrpo.templates.hooks import sampled_fps, video_metadata
from mmgrpo.templates.qwen3_omni import aut_audio_tokens

FAMILY = "qwen3-omni"


@pytest.fixture(scope="module")
def path():
    return str(build_tiny(FAMILY))


@pytest.fixture(scope="module")
def processor(path):
    return load_processor(path)


@pytest.fixture(scope="module")
def model(path):
    return load_model(path)


def _image(width, height, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def _audio(seconds, seed=0):
    t = np.arange(int(16000 * seconds)) / 16000
    noise = np.random.RandomState(seed).randn(t.size) * 0.05
    return (0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + noise).astype(np.float32)


def _video(num_frames=4, width=84, height=56, fps=2.0, sound_seconds=None):
    frames = np.random.RandomState(7).randint(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    metadata = {"fps": fps, "total_num_frames": 2 * num_frames, "frames_indices": list(range(0, 2 * num_frames, 2)),
                "duration": 2 * num_frames / fps, "width": width, "height": height}  # fmt: skip
    video = Video(frames=frames, metadata=metadata)
    if sound_seconds:
        video.audio = _audio(sound_seconds, seed=5)  # the video's sound track
    return video


def _sample(sample_id, messages, images=(), videos=(), audios=()):
    if isinstance(messages, str):
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": messages}]
    return LoadedSample(id=sample_id, messages=messages, images=list(images), videos=list(videos), audios=list(audios))


# ---------------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------------


def test_build_is_byte_identical_with_the_real_structure(tmp_path, path, processor, model):
    first, second = build_tiny(FAMILY, cache_dir=tmp_path / "a"), build_tiny(FAMILY, cache_dir=tmp_path / "b")
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second))
    assert filecmp.cmpfiles(first, second, names, shallow=False)[1:] == ([], [])

    assert type(model).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert json.loads(open(os.path.join(path, "config.json")).read())["model_type"] == "qwen3_omni_moe_thinker"
    assert 0.4e6 < sum(p.numel() for p in model.parameters()) < 2e6
    text = model.config.text_config
    assert (text.num_experts, text.num_experts_per_tok, text.mlp_only_layers) == (4, 2, [])
    for layer in model.model.language_model.layers:  # every decoder layer is sparse: router and experts
        assert type(layer.mlp).__name__ == "Qwen3OmniMoeThinkerTextSparseMoeBlock"
        assert layer.mlp.experts.gate_up_proj.shape[0] == 4
    assert type(model.model.audio_tower).__name__ == "Qwen3OmniMoeAudioEncoder"
    assert len(model.model.visual.merger_list) == len(model.config.vision_config.deepstack_visual_indexes) == 1
    assert model.config.position_id_per_seconds == processor.position_id_per_seconds == 13

    tokenizer = processor.tokenizer
    assert len(tokenizer) == text.vocab_size and tokenizer.padding_side == "left"
    template = get_template(FAMILY, processor)
    for module_path in template.components.values():
        model.get_submodule(module_path)
    suppressed = set(tokenizer.convert_ids_to_tokens(template.suppress_token_ids))
    assert {"<|image_pad|>", "<|video_pad|>", "<|audio_pad|>", "<|audio_start|>", "<|vision_start|>"} <= suppressed
    assert set(template.stop_token_ids).isdisjoint(template.suppress_token_ids)
    assert not template.lean_decode  # MoE layers are not the lean step's SwiGLU


def test_the_model_type_is_inferred_from_the_thinker_and_the_full_checkpoint(path, tmp_path):
    from mmgrpo.models.loading import infer_model_type

    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    assert infer_model_type(path) == infer_model_type(str(full)) == FAMILY


@pytest.mark.parametrize("family", ["qwen3-omni", "qwen2.5-omni"])
def test_a_transformers_that_holds_the_towers_elsewhere_stops_the_run(family, monkeypatch):
    """transformers 5.19 (vLLM's venv; tests/test_vllm_families.py meets it for real) has no thinker
    model class holding the towers: the policy's forward would skip them, so training and evaluation
    stop at start-up naming the family and the version to install."""
    from mmgrpo.errors import ConfigError
    from mmgrpo.models.loading import load_template
    from mmgrpo.templates.base import template_class

    assert not load_template(f"tiny:{family}", None)[2].transformers_problem  # 5.23 here: it runs
    module, _ = template_class(family).thinker_model
    monkeypatch.setattr(template_class(family), "thinker_model", (module, "AThinkerModelThisVersionLacks"))
    with pytest.raises(ConfigError, match=rf"--model_type {family}: transformers .* towers .*'transformers>=5\.23'"):
        load_template(f"tiny:{family}", None)


def test_a_full_checkpoint_loads_its_thinker(tmp_path, path, model, processor):
    """A user's checkpoint is the whole Qwen3-Omni (thinker + talker + code2wav, `thinker.*` beside
    `talker.*` and `code2wav.*`): its thinker loads, the rest is left on disk."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3OmniMoeConfig

    from mmgrpo.models.loading import model_skeleton

    thinker = AutoConfig.from_pretrained(path)
    Qwen3OmniMoeConfig(thinker_config=thinker.to_dict(), enable_audio_output=False).save_pretrained(tmp_path)
    weights = load_file(os.path.join(path, "model.safetensors"))  # the original layout: experts one by one
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in weights
    template = get_template(FAMILY, processor)
    # vllm_weight_names: the names a sync sends (transformers 5.23's) become the checkpoint's, which vLLM loads
    # (the experts leave fused, [experts, 2 * moe_intermediate, hidden], a layout vLLM takes too)
    renamed = {template.vllm_weight_name(name) for name, _ in model.named_parameters()}
    assert {n for n in renamed if ".experts." not in n} == {n for n in weights if ".experts." not in n}
    assert all(template.vllm_weight_name(name) == name for name in weights)  # the original layout stays as it is
    full = {"thinker." + k: v for k, v in weights.items()}
    full["talker.codec_head.weight"] = torch.zeros(2, 2)  # a speech part GRPO does not train
    save_file(full, str(tmp_path / "model.safetensors"), {"format": "pt"})
    loaded = load_model(str(tmp_path), template=template)
    assert type(loaded).__name__ == type(model_skeleton(str(tmp_path), template)).__name__ == type(model).__name__
    reference = model.state_dict()
    assert loaded.state_dict().keys() == reference.keys()
    assert all(torch.equal(value, reference[name]) for name, value in loaded.state_dict().items())


# ---------------------------------------------------------------------------------------------
# Parity with Qwen3OmniMoeProcessor
# ---------------------------------------------------------------------------------------------

MULTI_TURN = [
    {"role": "user", "content": "<audio>What is the sound?"},
    {"role": "assistant", "content": "A tone."},
    {"role": "user", "content": "<image>And the colour here?"},
]
CASES = {
    "text_only": ("What is seven plus five?", {}),
    "one_image": ("<image>What colour is the shape?", {"images": [(84, 56)]}),
    "two_images": ("Compare <image> with <image>: which is bigger?", {"images": [(90, 60), (50, 120)]}),
    "video": ("<video>What moves?", {"videos": [None]}),
    "audio": ("<audio>What is the sound?", {"audios": [1.3]}),
    "two_audios": ("Is <audio> the same as <audio>?", {"audios": [0.7, 2.2]}),  # padded to the longer clip
    "long_audio": ("<audio>Transcribe.", {"audios": [4.7]}),  # several AuT chunks and attention windows
    "image_audio_video": ("<image><audio>Then <video>: match?", {"images": [(56, 84)], "audios": [1.1], "videos": [None]}),
    "multi_turn": (MULTI_TURN, {"images": [(84, 56)], "audios": [0.8]}),
    # with use_audio_in_video: 3 s of sound against two temporal patches (at 0 and 2 s = 26 position ids)
    "video_with_sound": ("<video>What do you hear?", {"videos": [3.0]}),
    "audio_then_video_with_sound": ("<audio>Listen, then <video>: same sound?", {"audios": [0.9], "videos": [3.0]}),
}
WITH_SOUND = {"video_with_sound", "audio_then_video_with_sound"}


def _case(case):
    messages, spec = CASES[case]
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(spec.get("images", []))]
    videos = [_video(sound_seconds=s) for s in spec.get("videos", [])]
    audios = [_audio(s, seed=i) for i, s in enumerate(spec.get("audios", []))]
    return _sample(f"parity/{case}", messages, images, videos, audios)


def _hf_inputs(processor, template, text, sample, with_sound):
    """Qwen3OmniMoeProcessor on the rendered text and the raw media, the sound tracks as `audio` slots."""
    kwargs = {}
    if sample.images:
        kwargs["images"] = sample.images
    if sample.videos:
        kwargs["videos"] = [v.frames for v in sample.videos]
        kwargs["videos_kwargs"] = {"video_metadata": [video_metadata(v) for v in sample.videos],
                                   "do_sample_frames": False, "size": template.media["video"].size,
                                   "fps": sampled_fps(sample.videos[0])}  # fmt: skip
    tracks = [v.audio for v in sample.videos] if with_sound else []
    if sample.audios or tracks:
        kwargs["audio"] = list(sample.audios) + tracks
        kwargs["sampling_rate"] = 16000
    if tracks:  # the standalone clips, then the video's track: the order they take in this prompt
        kwargs["audio_from_video_indices"] = [None] * len(sample.audios) + [0]
        kwargs["load_audio_from_video"] = True
    return processor(text=[text], return_tensors="pt", **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_the_hf_processor(case, processor):
    with_sound = case in WITH_SOUND
    template = get_template(FAMILY, processor, **({"use_audio_in_video": True} if with_sound else {}))
    sample = _case(case)
    prompt = template.encode_prompt(sample)

    messages = [{"role": m["role"], "content": Template.content_parts(m["content"])} for m in sample.messages]
    hf_text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_text == prompt.prompt_text  # the rollout payload is what the HF processor takes
    expected = _hf_inputs(processor, template, hf_text, sample, with_sound)
    assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist(), processor.tokenizer.decode(prompt.prompt_ids)
    expected_keys = {k for k in expected if k not in ("input_ids", "attention_mask")}
    assert set(prompt.mm) == expected_keys
    for key in expected_keys:
        assert torch.equal(prompt.mm[key], torch.as_tensor(expected[key]).to(prompt.mm[key].dtype)), key


def test_a_video_with_sound_keeps_every_audio_token_interleaved_by_time(processor):
    """The sound track's tokens are all in the prompt (none dropped), between the video's audio start
    and end, the second temporal patch after the first 26 of them (2 s at 13 position ids per second)."""
    template = get_template(FAMILY, processor, use_audio_in_video=True)
    prompt = template.encode_prompt(_case("video_with_sound"))
    ids = prompt.prompt_ids.tolist()
    tokenizer = processor.tokenizer
    start, end = ids.index(tokenizer.convert_tokens_to_ids("<|audio_start|>")), ids.index(tokenizer.convert_tokens_to_ids("<|audio_end|>"))
    inside = tokenizer.convert_ids_to_tokens(ids[start + 1 : end])
    frames = int(prompt.mm["feature_attention_mask"].sum())
    assert inside.count("<|audio_pad|>") == aut_audio_tokens(frames) == 39  # 3 s of sound
    patch = int(prompt.mm["video_grid_thw"][0, 1:].prod()) // 4  # tokens of one temporal patch
    assert inside == ["<|video_pad|>"] * patch + ["<|audio_pad|>"] * 26 + ["<|video_pad|>"] * patch + ["<|audio_pad|>"] * 13
    assert tokenizer.convert_ids_to_tokens(ids[start - 1 : start]) == ["<|vision_start|>"]  # inside the video's pair


# ---------------------------------------------------------------------------------------------
# Log-probs of the engine's path equal generate's; one step reaches every part
# ---------------------------------------------------------------------------------------------


def _batch_samples(sound):
    first = _sample("lp/0", "<image><audio>Hi.", images=[_image(84, 56)], audios=[_audio(1.0)])
    second = _sample("lp/1", "Think: <image> and <video> and <audio> which is the red one?", images=[_image(140, 112, seed=1)],
                     videos=[_video(sound_seconds=2.5 if sound else None)], audios=[_audio(2.1, seed=1)])  # fmt: skip
    text_only = _sample("lp/2", "Only words here.")
    return [first, second, text_only]


def _sequence_logps(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("sound", [False, True], ids=["plain", "use_audio_in_video"])
def test_logprobs_match_generate_and_every_part_gets_gradient(sound, processor, model):
    template = get_template(FAMILY, processor, **({"use_audio_in_video": True} if sound else {}))
    prompts = [template.encode_prompt(s) for s in _batch_samples(sound)]
    batch = template.collate(prompts)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][1].all()  # left padding
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=True, suppress_tokens=template.suppress_token_ids,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    prompt_len = batch["input_ids"].shape[1]
    completion_ids = out.sequences[:, prompt_len:]  # [3, T]
    expected = _sequence_logps(torch.stack(out.logits, dim=1), completion_ids)  # [3, T]
    mask = torch.ones_like(completion_ids)

    policy = Policy(model, template)
    forward_batch = policy.forward_batch(prompts, [1, 1, 1])
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)  # the engine's path
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)

    # G=2 completions per prompt (rows and media repeated), with the positions generate used
    grouped_ids = completion_ids.repeat_interleave(2, dim=0)  # [6, T]
    inputs = template.forward_inputs(batch, grouped_ids, torch.ones_like(grouped_ids), model=model)
    with torch.no_grad():
        hidden = model.get_submodule(template.components["backbone"])(**inputs, use_cache=False).last_hidden_state
        grouped = _sequence_logps(model.lm_head(hidden[:, prompt_len - 1 : -1]), grouped_ids)
    torch.testing.assert_close(grouped, expected.repeat_interleave(2, dim=0), atol=1e-5, rtol=0)

    model.zero_grad(set_to_none=True)
    logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
    (-(logps * torch.tensor([1.0, -1.0, 0.5])[:, None]).sum()).backward()
    for part in ("vision", "aligner", "audio", "llm"):
        grads = [p.grad for p in policy.component(part).parameters() if p.grad is not None]
        assert grads and sum(g.abs().sum() for g in grads) > 0, f"no gradient in {part}"
    for layer in model.model.language_model.layers:  # the router and every expert that got tokens
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
        assert (layer.mlp.experts.gate_up_proj.grad.flatten(1).abs().sum(1) > 0).all()
    assert model.model.visual.merger_list[0].mlp[0].weight.grad.abs().sum() > 0  # the deepstack tap
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# Training, SFT, evaluation and resume through the commands, on images, audio and videos with sound
# ---------------------------------------------------------------------------------------------

REWARD = "def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n"
RUN = ["--model", "tiny:qwen3-omni", "--use_audio_in_video", "--video_nframes", "4", "--num_generations", "2",
       "--per_device_train_batch_size", "4", "--max_completion_length", "6", "--dataloader_num_workers", "0",
       "--torch_threads", "1", "--report_to", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def omni_data(tmp_path_factory):
    """Four rows, each with an image, an audio clip and a video with its sound track, or text alone."""
    import wave

    from test_audio_in_video import clip, write_mp4_with_sound

    folder = tmp_path_factory.mktemp("omni_data")
    rows = []
    for i in range(4):
        frames, samples = clip(i % 2)
        write_mp4_with_sound(folder / f"{i}.mp4", frames, samples)
        _image(56 + 28 * i, 56, seed=i).save(folder / f"{i}.png")
        with wave.open(str(folder / f"{i}.wav"), "wb") as sound:
            sound.setnchannels(1), sound.setsampwidth(2), sound.setframerate(16000)
            sound.writeframes((_audio(0.6 + 0.3 * i, seed=i) * 32767).astype(np.int16).tobytes())
        media = {"images": [f"{i}.png"], "audios": [f"{i}.wav"], "videos": [f"{i}.mp4"]}
        row = {"query": "<image><audio>Then <video>: which colour?", **media} if i != 2 else {"query": "Say a colour."}
        rows.append({**row, "solution": ["red", "blue"][i % 2]})
    (folder / "omni.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "reward.py").write_text(REWARD)
    return folder


def _metrics(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "cpu/", "samples_per_s", "memory/", "rollout/"))}
            for row in rows]  # fmt: skip


def test_a_grpo_step_changes_every_weight_and_resumes_exactly(omni_data, tmp_path, path):
    """One `mmgrpo train` step moves every weight: both towers (deepstack mergers too), the router and
    the experts of every layer. Then a 2-step run killed after its first save and resumed with
    --resume_from_checkpoint logs and ends as the uninterrupted run."""
    import shutil

    from safetensors.torch import load_file

    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    def run(out, *extra):
        args = [*RUN, "--dataset", str(omni_data / "omni.jsonl"), "--reward_funcs", f"{omni_data / 'reward.py'}:length",
                "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--beta", "0", "--save_steps", "1",
                "--output_dir", str(out), *extra]  # fmt: skip
        return train(TrainConfig.from_args(args))

    whole = run(tmp_path / "whole", "--max_steps", "2")
    before = load_file(os.path.join(path, "model.safetensors"))
    after = load_file(str(whole / "checkpoint-1" / "model.safetensors"))
    assert after.keys() == before.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"weights that did not train: {unchanged}"
    assert any(n.startswith("audio_tower.") for n in before) and any(".mlp.experts.3." in n for n in before)

    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copytree(whole / "checkpoint-1", killed / "checkpoint-1")
    lines = (whole / "metrics.jsonl").read_text().splitlines(keepends=True)
    (killed / "metrics.jsonl").write_text(lines[0])
    run(killed, "--max_steps", "2", "--resume_from_checkpoint", "latest")
    assert _metrics(killed) == _metrics(whole)
    final_whole, final_killed = (load_file(str(out / "checkpoint-2" / "model.safetensors")) for out in (whole, killed))
    assert all(torch.equal(final_whole[name], final_killed[name]) for name in final_whole)


def test_sft_and_eval_run_on_every_medium(omni_data, tmp_path):
    from mmgrpo.cli import main

    out = tmp_path / "sft"
    main(["sft", *[a for a in RUN if a not in ("--num_generations", "2", "--max_completion_length", "6")],
          "--dataset", str(omni_data / "omni.jsonl"), "--max_steps", "1", "--output_dir", str(out)])  # fmt: skip
    sft_metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert sft_metrics["step"] == 1 and np.isfinite(sft_metrics["loss"])

    main(["eval", "--model", "tiny:qwen3-omni", "--use_audio_in_video", "--video_nframes", "4", "--dataset",
          str(omni_data / "omni.jsonl"), "--metrics", "vqa_accuracy", "--max_completion_length", "4", "--batch_size", "2",
          "--output_dir", str(tmp_path / "eval")])  # fmt: skip
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["counts"]["all"] == 4 and "vqa_accuracy" in result["metrics"]


def test_freeze_vit_vit_lr_and_aligner_lr_find_the_towers(path, processor):
    """--freeze_vit freezes the vision tower with its deepstack mergers and the audio tower (the
    merger, the aligner, trains on); --vit_lr takes both towers, --aligner_lr the merger."""
    from mmgrpo.config.schema import ModelConfig
    from mmgrpo.models.loading import model_skeleton
    from mmgrpo.models.train_type import freeze
    from mmgrpo.training.optim import parameter_groups

    template = get_template(FAMILY, processor)
    skeleton = model_skeleton(path, template)  # no weights: names and shapes only
    groups = parameter_groups(list(skeleton.parameters()), skeleton, template.components, 1e-5, {"vit": 2e-6, "aligner": 3e-6})
    members = {g["name"]: ({n for n, p in skeleton.named_parameters() if any(p is q for q in g["params"])}, g["lr"]) for g in groups}
    assert members["vit"][1] == 2e-6 and members["aligner"][1] == 3e-6 and members["llm"][1] == 1e-5
    assert {n.split(".")[1] for n in members["vit"][0]} == {"visual", "audio_tower"}
    assert "model.visual.merger_list.0.mlp.0.weight" in members["vit"][0]
    assert {n for n in members["aligner"][0]} == {n for n, _ in skeleton.named_parameters() if n.startswith("model.visual.merger.")}
    assert "model.language_model.layers.1.mlp.gate.weight" in members["llm"][0] and "lm_head.weight" in members["llm"][0]

    freeze(skeleton, template.components, ModelConfig(freeze_vit=True))
    frozen = {n for n, p in skeleton.named_parameters() if not p.requires_grad}
    assert frozen == members["vit"][0]


def test_lora_finds_the_linear_layers_of_every_part(path, processor):
    """--train_type lora: all-linear takes attention of the MoE layers and both towers; the experts
    and the router are 3-D and 2-D parameters, not linear layers, so they train only in full training."""
    from mmgrpo.config.schema import ModelConfig
    from mmgrpo.models.loading import model_skeleton
    from mmgrpo.models.train_type import lora_targets

    template = get_template(FAMILY, processor)
    targets = lora_targets(model_skeleton(path, template), template.components, ModelConfig(train_type="lora"))
    for name in ("model.language_model.layers.1.self_attn.q_proj", "model.audio_tower.layers.0.fc1",
                 "model.audio_tower.proj2", "model.visual.blocks.0.attn.qkv", "model.visual.merger.mlp.0"):  # fmt: skip
        assert name in targets
    assert "lm_head" not in targets and not any(".mlp.experts" in t or t.endswith(".mlp.gate") for t in targets)
