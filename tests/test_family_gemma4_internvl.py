"""Gemma 4 and InternVL: tiny builds, HF parity, log-prob parity, a GRPO step, SFT, eval, resume, LoRA.

For each family (a tiny random checkpoint of the real transformers classes):
  - the build is byte-identical, its config's model_type picks the template, and it has the
    family's structure (Gemma 4: sliding and full layers, KV sharing, per-layer embeddings, vision and
    audio towers; InternVL: the InternViT tower, pixel-shuffle projector, a Qwen LLM);
  - the template gives the HF processor's input_ids and tensors for every medium it takes, a
    multi-turn row and a text-only row; a medium it does not take is a DataError naming the row;
  - completion log-probs of the engine's Policy path equal generate(output_logits=True) scores for a
    left-padded batch of 2, and a backward reaches every tower and the LLM;
  - `mmgrpo train` for one step changes every trainable parameter; `mmgrpo sft`, `mmgrpo eval` and
    LoRA run on the family.
"""

import filecmp
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.errors import DataError
from mmgrpo.forward.policy import Policy
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.templates import Template, get_template, templates_for_hf_type
from mmgrpo.templates.hooks import video_metadata

FAMILIES = ["gemma4", "internvl"]
TAKES = {"gemma4": {"image", "video", "audio"}, "internvl": {"image"}}
TOWERS = {"gemma4": ["vision", "aligner", "audio"], "internvl": ["vision", "aligner"]}  # must get gradient, with "llm"
MODEL_CLASS = {"gemma4": "Gemma4ForConditionalGeneration", "internvl": "InternVLForConditionalGeneration"}
HF_TYPE = {"gemma4": "gemma4", "internvl": "internvl"}
# A dataset of each medium the family takes: one GRPO step over them reaches every tower.
DATASETS = {"gemma4": ["shapes-color", "tones-pitch"], "internvl": ["shapes-color"]}


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


def _audio(seconds, seed=0):
    t = np.arange(int(16000 * seconds)) / 16000
    noise = np.random.RandomState(seed).randn(t.size) * 0.05
    return (0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + noise).astype(np.float32)


def _video(num_frames=4, width=84, height=56, fps=2.0):
    frames = np.random.RandomState(7).randint(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    metadata = {"fps": fps, "total_num_frames": 2 * num_frames, "frames_indices": list(range(0, 2 * num_frames, 2)),
                "duration": 2 * num_frames / fps, "width": width, "height": height}  # fmt: skip
    return Video(frames=frames, metadata=metadata)


def _sample(sample_id, messages, images=(), audios=(), videos=()):
    return LoadedSample(id=sample_id, messages=messages, images=list(images), videos=list(videos), audios=list(audios))


# ---------------------------------------------------------------------------------------------
# Builds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_byte_identical_and_has_the_family_structure(family, tmp_path, processors, models):
    first, second = build_tiny(family, cache_dir=tmp_path / "a"), build_tiny(family, cache_dir=tmp_path / "b")
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second))
    _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert mismatch == [] and errors == []
    config = json.loads((first / "config.json").read_text())
    assert config["model_type"] == HF_TYPE[family] and templates_for_hf_type(config["model_type"]) == [family]

    model, tokenizer = models[family], processors[family].tokenizer
    assert type(model).__name__ == MODEL_CLASS[family] and not model.training
    assert 0.4e6 < sum(p.numel() for p in model.parameters()) < 2e6
    assert len(tokenizer) == model.config.get_text_config().vocab_size
    template = get_template(family, processors[family])
    for path in template.components.values():
        model.get_submodule(path)
    suppressed = set(tokenizer.convert_ids_to_tokens(template.suppress_token_ids))
    assert {hook.placeholder for hook in template.media.values()} <= suppressed
    assert set(template.stop_token_ids).isdisjoint(template.suppress_token_ids)
    assert set(template.eos_token_ids) == set(model.generation_config.eos_token_id)
    # the fast paths: the shared prefix for both (tests/test_shared_prefix.py), the lean step for InternVL's Qwen
    # decoder (tests/test_lean_decode.py; Gemma 4's layers norm four times and share K/V)
    assert template.shared_prefix and template.lean_decode == (family == "internvl")
    text = model.config.get_text_config()
    assert getattr(text, "final_logit_softcapping", None) is None  # a capped copy: tests/test_softcap.py
    if family == "gemma4":
        assert text.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
        assert text.kv_sharing_modes == [None, "store", "store", "reuse", "reuse", "reuse"]
        assert text.hidden_size_per_layer_input and text.use_bidirectional_attention == "vision"
        layers = model.model.language_model.layers
        assert not hasattr(layers[4].self_attn, "k_proj")  # a KV-shared layer has no key / value weights
        assert layers[2].self_attn.v_proj is None  # full layers: values are the keys (attention_k_eq_v)
        assert layers[2].self_attn.head_dim == 2 * layers[0].self_attn.head_dim
        assert all(layer.enable_moe_block and layer.experts.num_experts == 4 for layer in layers)  # beside the MLP
        assert text.top_k_experts == 2
        assert model.model.audio_tower is not None and template.modalities == ("image", "video", "audio")
    if family == "internvl":
        assert text.model_type == "qwen3" and model.config.downsample_ratio == 0.5
        assert model.config.vision_feature_select_strategy == "default"  # the CLS token is dropped


# ---------------------------------------------------------------------------------------------
# Parity with the HF processor
# ---------------------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "Answer briefly."}
CASES = {
    "text_only": ([SYSTEM, {"role": "user", "content": "What is seven plus five?"}], {}),
    "one_image": ([SYSTEM, {"role": "user", "content": "<image>What colour is the shape?"}], {"images": [(84, 56)]}),
    "two_images": (
        [{"role": "user", "content": "Compare <image> with <image>: which is bigger?"}],
        {"images": [(90, 60), (50, 120)]},
    ),
    "big_image": ([{"role": "user", "content": "<image>Where is it?"}], {"images": [(300, 100)]}),
    "multi_turn": (
        [
            SYSTEM,
            {"role": "user", "content": "<image>What shape?"},
            {"role": "assistant", "content": " A circle. "},
            {"role": "user", "content": "And <image> here?"},
        ],
        {"images": [(56, 56), (70, 42)]},
    ),
    "audio": ([SYSTEM, {"role": "user", "content": "<audio>What is the sound?"}], {"audios": [1.3]}),
    "two_audios": ([{"role": "user", "content": "Is <audio> the same as <audio>?"}], {"audios": [0.7, 2.2]}),
    "image_audio": ([{"role": "user", "content": "<image><audio>Do they match?"}], {"images": [(56, 84)], "audios": [1.1]}),
    "video": ([SYSTEM, {"role": "user", "content": "Then <video> what moves?"}], {"videos": 1}),
    "image_audio_video": (
        [{"role": "user", "content": "<image><audio>Then <video>: match?"}],
        {"images": [(56, 84)], "audios": [1.1], "videos": 1},
    ),
}
PARITY = [
    (family, case)
    for family in FAMILIES
    for case, (_, media) in CASES.items()
    if {kind[:-1] for kind in media} <= TAKES[family]
]


def _case(case):
    messages, media = CASES[case]
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(media.get("images", []))]
    audios = [_audio(s, seed=i) for i, s in enumerate(media.get("audios", []))]
    videos = [_video() for _ in range(media.get("videos", 0))]
    return messages, images, audios, videos


def _hf_inputs(family, processor, text, images, audios, videos):
    kwargs = {}
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["videos_kwargs"] = {"video_metadata": [video_metadata(v) for v in videos], "do_sample_frames": False}
    if images:
        kwargs["images"] = [images]  # nested per prompt
    if audios:
        kwargs["audio"], kwargs["sampling_rate"] = audios, 16000
    return processor(text=[text], return_tensors="pt", **kwargs)


@pytest.mark.parametrize(("family", "case"), PARITY)
def test_parity_with_hf_processor(family, case, processors):
    processor = processors[family]
    template = get_template(family, processor)
    messages, images, audios, videos = _case(case)
    sample = _sample(f"parity/{case}", messages, images, audios, videos)
    prompt = template.encode_prompt(sample)

    typed = [{"role": m["role"], "content": Template.content_parts(m["content"])} for m in messages]
    hf_text = processor.apply_chat_template(typed, add_generation_prompt=True, tokenize=False)
    assert hf_text == prompt.prompt_text  # the rollout payload is what the HF processor takes
    expected = _hf_inputs(family, processor, hf_text, images, audios, videos)
    assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist(), processor.tokenizer.decode(prompt.prompt_ids)
    expected_keys = {k for k in expected if k not in ("input_ids", "attention_mask")}
    assert set(prompt.mm) == expected_keys
    for key in expected_keys:
        want = torch.as_tensor(expected[key])
        want = want[0] if key in template.token_keys else want
        assert torch.equal(prompt.mm[key], want.to(prompt.mm[key].dtype)), key
    assert len(prompt.input_sizes) == len(images)


NOT_TAKEN = {"internvl": ("audio", {"audios": [_audio(0.5)]})}


@pytest.mark.parametrize("family", sorted(NOT_TAKEN))
def test_a_medium_not_taken_is_a_data_error_naming_the_row(family, processors):
    kind, media = NOT_TAKEN[family]
    sample = _sample("ds/train/9", [{"role": "user", "content": f"<{kind}>What is it?"}], **media)
    with pytest.raises(DataError, match=rf"ds/train/9.*{kind}.*{family}"):
        get_template(family, processors[family]).encode_prompt(sample)


def test_gemma4_rejects_a_clip_too_short_for_one_token(processors):
    sample = _sample("a/1", [{"role": "user", "content": "<audio>?"}], audios=[np.zeros(100, dtype=np.float32)])
    with pytest.raises(DataError, match="a/1.*too short"):
        get_template("gemma4", processors["gemma4"]).encode_prompt(sample)


def test_gemma4_says_what_vllm_cannot_run_as_the_policy(processors):
    template = get_template("gemma4", processors["gemma4"])
    assert "id 1500 in this vocabulary" in template.vllm_mismatch  # tests/test_vllm_families.py measures it
    prompt = template.encode_prompt(_sample("v/1", [{"role": "user", "content": "<audio>?"}], audios=[_audio(0.5)]))
    if not torch.cuda.is_available():
        assert "audio tower stops on CPU" in template.vllm_prompt_problem(prompt)
    image = template.encode_prompt(_sample("v/2", [{"role": "user", "content": "<image>?"}], [_image(56, 56)]))
    assert template.vllm_prompt_problem(image) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_box_convention(family, processors):
    template = get_template(family, processors[family])
    prompt = template.encode_prompt(_sample("b/0", [{"role": "user", "content": "<image>Where?"}], [_image(200, 100)]))
    assert template.box_mapper(prompt)([100, 200, 500, 1000]) == [20.0, 20.0, 100.0, 100.0]  # 0-1000 of the image


# ---------------------------------------------------------------------------------------------
# Log-probs of the engine's path equal generate's scores; a backward reaches every tower
# ---------------------------------------------------------------------------------------------


def _batch_samples(family):
    """Two prompts of different lengths and media sizes (left padding), with every medium the family takes."""
    takes = TAKES[family]
    first = dict(images=[_image(84, 56)], audios=[_audio(1.0)] if "audio" in takes else [])
    second = dict(images=[_image(140, 112, seed=1)], audios=[_audio(2.1, seed=1)] if "audio" in takes else [],
                  videos=[_video()] if "video" in takes else [])
    text0 = "<image>" + "<audio>" * len(first["audios"]) + "Hi."
    text1 = ("Think: <image> and " + "<audio> and " * len(second["audios"]) + "<video> and " * len(second["videos"])
             + "which is the red one?")
    return [
        _sample("lp/0", [{"role": "user", "content": text0}], **first),
        _sample("lp/1", [SYSTEM, {"role": "user", "content": text1}], **second),
    ]


def _sequence_logps(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_logprobs_match_generate_and_reach_every_tower(family, processors, models):
    template, model = get_template(family, processors[family]), models[family]
    prompts = [template.encode_prompt(s) for s in _batch_samples(family)]
    batch = template.collate(prompts)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][1].all()  # left padding
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=6, do_sample=True, suppress_tokens=template.suppress_token_ids,
            output_logits=True, return_dict_in_generate=True,
        )
    prompt_len = batch["input_ids"].shape[1]
    completion_ids = out.sequences[:, prompt_len:]  # [2, T]
    expected = _sequence_logps(torch.stack(out.logits, dim=1), completion_ids)  # [2, T]
    mask = torch.ones_like(completion_ids)

    policy = Policy(model, template)
    forward_batch = policy.forward_batch(prompts, [2, 2])  # G = 2: rows and media repeated
    grouped_ids = completion_ids.repeat_interleave(2, dim=0)  # [4, T]
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(forward_batch, grouped_ids, torch.ones_like(grouped_ids))
    # 2e-5: Gemma 4's row 0 is left-padded by ~250 columns (row 1 has a video), fp32 noise reaches 1.4e-5
    torch.testing.assert_close(logps, expected.repeat_interleave(2, dim=0), atol=2e-5, rtol=0)

    model.zero_grad(set_to_none=True)
    forward_batch = policy.forward_batch(prompts, [1, 1])
    logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
    (-(logps * torch.tensor([1.0, -1.0])[:, None]).sum()).backward()
    for part in [*TOWERS[family], "llm"]:
        grads = [p.grad for p in policy.component(part).parameters() if p.grad is not None]
        assert grads and sum(g.abs().sum() for g in grads) > 0, f"{family}: no gradient in {part}"
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# The commands on the family
# ---------------------------------------------------------------------------------------------

VARYING = ("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s")  # wall-clock figures (as tests/test_resume.py)
LENGTH_REWARD = "def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n"


def _common(family):
    return ["--model", f"tiny:{family}", "--dataset", *DATASETS[family], "--dataloader_num_workers", "0",
            "--report_to", "none", "--torch_threads", "1"]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_grpo_step_changes_every_trainable_parameter(family, tmp_path, models):
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    plugin = tmp_path / "length.py"
    plugin.write_text(LENGTH_REWARD)  # rewards that differ within a group: non-zero advantages
    cfg = TrainConfig.from_args([
        *_common(family), "--reward_funcs", f"{plugin}:length", "--num_generations", "4",
        "--per_device_train_batch_size", "16", "--max_completion_length", "8", "--max_steps", "1",
        "--learning_rate", "1e-3", "--beta", "0", "--output_dir", str(tmp_path / "run"),
    ])
    out = train(cfg)
    before = dict(models[family].named_parameters())  # the tiny checkpoint as loaded: not its buffers
    after = dict(load_model(str(out / "checkpoint-1")).named_parameters())
    assert before.keys() == after.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters that did not train: {unchanged}"
    for name in [n for n in before if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:  # MoE: every expert
        idle = [e for e in range(before[name].shape[0]) if torch.equal(before[name][e], after[name][e])]
        assert not idle, f"{name}: experts {idle} did not train"


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_then_eval_run_on_the_family(family, tmp_path):
    from mmgrpo.cli import main as cli_main
    from mmgrpo.config import SFTConfig
    from mmgrpo.sft import sft

    final = sft(SFTConfig.from_args([*_common(family), "--per_device_train_batch_size", "4", "--max_steps", "2",
                                     "--output_dir", str(tmp_path / "sft")]))
    losses = [json.loads(line)["loss"] for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))
    out = tmp_path / "eval"
    # the SFT checkpoint's config.json names its family: --model_type is inferred
    cli_main(["eval", "--model", str(final), "--dataset", "shapes-color:test", "--limit", "4",
              "--max_completion_length", "8", "--output_dir", str(out)])
    result = json.loads((out / "eval.json").read_text())
    assert result["counts"]["all"] == 4 and set(result["metrics"]) == {"answer_format", "vqa_accuracy"}


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_finds_the_linear_layers_of_every_part_and_trains_them(family, tmp_path):
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    plugin = tmp_path / "length.py"
    plugin.write_text(LENGTH_REWARD)
    out = train(TrainConfig.from_args([
        *_common(family), "--reward_funcs", f"{plugin}:length", "--num_generations", "4",
        "--per_device_train_batch_size", "16", "--max_completion_length", "8", "--max_steps", "1",
        "--learning_rate", "1e-2", "--beta", "0", "--train_type", "lora", "--target_modules", "all-linear",
        "--output_dir", str(tmp_path / "run"),
    ]))
    adapter = load_file(str(next((out / "checkpoint-1").rglob("adapter_model.safetensors"))))
    components = get_template(family, load_processor(str(build_tiny(family)))).components
    for part in [p for p in ("vision", "audio", "aligner", "llm") if p in components]:
        prefix = components[part].removeprefix("model.")
        assert any(prefix in name and "lora_B" in name and bool(value.abs().sum() > 0) for name, value in adapter.items()), part


@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_resumed_from_a_checkpoint_logs_the_uninterrupted_run(family, tmp_path):
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    plugin = tmp_path / "length.py"
    plugin.write_text(LENGTH_REWARD)
    flags = [*_common(family), "--reward_funcs", f"{plugin}:length", "--num_generations", "2",
             "--per_device_train_batch_size", "4", "--max_completion_length", "6", "--max_steps", "3",
             "--save_steps", "1", "--learning_rate", "1e-3", "--seed", "3"]

    def metrics(folder):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not any(part in k for part in VARYING)} for row in rows]

    whole = tmp_path / "whole"
    train(TrainConfig.from_args([*flags, "--output_dir", str(whole)]))
    resumed = tmp_path / "resumed"
    train(TrainConfig.from_args([*flags, "--output_dir", str(resumed),
                                 "--resume_from_checkpoint", str(whole / "checkpoint-2")]))
    assert metrics(resumed)[-1] == metrics(whole)[-1] and metrics(resumed)[-1]["step"] == 3
