"""Tiny random checkpoints: deterministic, loadable with Auto classes, able to generate."""

import filecmp
import os

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmgrpo.data.drawing import COLOURS
from mmgrpo.errors import ConfigError
from mmgrpo.models.tiny import BPE_VOCAB_SIZE, QWEN2_5_VL_SPECIAL_TOKENS, build_tiny, resolve_model_path


def _files(folder):
    return sorted(name for name in os.listdir(folder))


def test_build_is_byte_identical(tmp_path):
    first = build_tiny("qwen2-vl", cache_dir=tmp_path / "a")
    second = build_tiny("qwen2-vl", cache_dir=tmp_path / "b")
    assert first.name == second.name  # same recipe, same hash
    assert _files(first) == _files(second)
    assert "model.safetensors" in _files(first) and "chat_template.jinja" in _files(first)
    match, mismatch, errors = filecmp.cmpfiles(first, second, _files(first), shallow=False)
    assert mismatch == [] and errors == []
    assert build_tiny("qwen2-vl", cache_dir=tmp_path / "a") == first  # cached: no rebuild
    assert [p.name for p in (tmp_path / "a").iterdir()] == [first.name]  # no temp folder left


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_loads_and_generates(family, tiny_qwen2_vl_path, tiny_qwen2_5_vl_path):
    path = {"qwen2-vl": tiny_qwen2_vl_path, "qwen2.5-vl": tiny_qwen2_5_vl_path}[family]
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    tokenizer = processor.tokenizer
    assert len(tokenizer) == model.config.text_config.vocab_size
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    # the special tokens sit at fixed ids right after the trained BPE vocab, in Qwen's order
    for offset, token in enumerate(QWEN2_5_VL_SPECIAL_TOKENS[: 14 if family == "qwen2-vl" else None]):
        assert tokenizer.convert_tokens_to_ids(token) == BPE_VOCAB_SIZE + offset
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    messages = [{"role": "user", "content": [{"type": "text", "text": "What colour is the circle?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat colour is the circle?<|im_end|>\n<|im_start|>assistant\n"
    )
    inputs = processor(text=[text], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 5)


def test_tokenizer_knows_the_corpus_words(tiny_qwen2_vl_path):
    tokenizer = AutoProcessor.from_pretrained(tiny_qwen2_vl_path).tokenizer
    for word in [" red", " circle", " three", " answer", "<think>", "</answer>"]:
        assert len(tokenizer.tokenize(word)) <= 3, word
    assert (
        tokenizer.decode(tokenizer.encode("The red square is at (12, 345)."))
        == "The red square is at (12, 345)."
    )


def test_each_colour_answer_is_one_token(tiny_qwen2_vl_path):
    """As in a real tokenizer's vocabulary: a colour answer split into letters is often misspelt when sampled."""
    tokenizer = AutoProcessor.from_pretrained(tiny_qwen2_vl_path).tokenizer
    for colour in COLOURS:
        pieces = [tokenizer.convert_tokens_to_string([p]) for p in tokenizer.tokenize(f"<answer>{colour}</answer>")]
        assert any(colour in piece for piece in pieces), (colour, pieces)


def test_vocab_override_pads_with_unused_tokens(tmp_path):
    path = build_tiny(
        "qwen2-vl", cache_dir=tmp_path, vocab_size=2048, hidden_size=64, head_dim=16, num_attention_heads=4
    )
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert len(processor.tokenizer) == 2048 == model.config.text_config.vocab_size
    assert model.config.text_config.hidden_size == 64
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == BPE_VOCAB_SIZE + 12


def test_resolve_model_path(tiny_qwen2_vl_path):
    assert resolve_model_path("tiny:qwen2-vl") == tiny_qwen2_vl_path
    assert resolve_model_path("Qwen/Qwen2-VL-2B-Instruct") == "Qwen/Qwen2-VL-2B-Instruct"
    with pytest.raises(ConfigError, match="qwen2-vl"):
        resolve_model_path("tiny:no-such-family")
    with pytest.raises(ConfigError, match="hidden_size"):
        build_tiny("qwen2-vl", hidden=3)


def test_load_model_and_processor(tiny_qwen2_vl_path):
    from mmgrpo.models import load_model, load_processor

    model = load_model("tiny:qwen2-vl")
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert load_processor(tiny_qwen2_vl_path).tokenizer.padding_side == "left"
    with pytest.raises(ConfigError, match="no checkpoint"):
        load_model("/nonexistent/model")


@pytest.mark.parametrize("family", ["qwen2-vl", "llava-onevision"])
def test_vision_init_gain_redraws_the_vision_tower_only(tmp_path, family):
    from safetensors.torch import load_file

    plain = load_file(build_tiny(family, cache_dir=tmp_path) / "model.safetensors")
    wide = load_file(build_tiny(family, cache_dir=tmp_path, vision_init_gain=3) / "model.safetensors")
    redrawn = [name for name in plain if not torch.equal(plain[name], wide[name])]
    assert redrawn and all(("visual." in n or "vision_tower." in n or "multi_modal_projector." in n) for n in redrawn)
    for name in redrawn:  # weight matrices only, each at std 3 / sqrt(fan_in); norms and biases unchanged
        weight = wide[name].float()
        assert weight.dim() >= 2 and name.endswith("weight")
        assert weight.std().item() == pytest.approx(3 / weight[0].numel() ** 0.5, rel=0.1)
    assert any("visual.blocks" in n or "vision_tower" in n for n in redrawn)


def test_a_tiny_name_takes_dimension_overrides(tmp_path, monkeypatch):
    from mmgrpo.config import SFTConfig
    from mmgrpo.training.startup_checks import check_sft_flags

    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path))
    name = "tiny:qwen2-vl?vision_init_gain=3&seed=1"
    assert resolve_model_path(name) == str(build_tiny("qwen2-vl", vision_init_gain=3, seed=1))
    assert resolve_model_path(name) != resolve_model_path("tiny:qwen2-vl")
    cfg = SFTConfig.from_args(["--model", name])
    check_sft_flags(cfg)  # what sft() runs first: --model_type from the tiny: name
    assert cfg.model.model_type == "qwen2-vl"
    for bad in ("tiny:qwen2-vl?vision_gain=3", "tiny:qwen2-vl?seed=one"):
        with pytest.raises(ConfigError, match="not DIM=INTEGER.*vision_init_gain"):
            resolve_model_path(bad)


@pytest.mark.parametrize("family, default_theta", [("qwen2-vl", 1e6), ("qwen3-vl", 5e6)])
def test_rope_theta_sets_the_language_models_rotary_base_only(tmp_path, family, default_theta):
    import json

    from safetensors.torch import load_file

    plain, low = build_tiny(family, cache_dir=tmp_path), build_tiny(family, cache_dir=tmp_path, rope_theta=10)
    plain_weights, low_weights = (load_file(p / "model.safetensors") for p in (plain, low))
    assert plain_weights.keys() == low_weights.keys()
    assert all(torch.equal(plain_weights[name], low_weights[name]) for name in plain_weights)
    thetas = [json.loads((p / "config.json").read_text())["text_config"]["rope_parameters"]["rope_theta"]
              for p in (plain, low)]
    assert thetas == [default_theta, 10.0]
    # The lowest rotary frequency, radians per position: at the family's base a visual token's
    # column barely turns it; at 10 it does (the reason for the option).
    slowest = [AutoModelForImageTextToText.from_pretrained(p).model.language_model.rotary_emb.inv_freq[-1].item()
               for p in (plain, low)]
    assert slowest[0] < 1e-5 and slowest[1] > 0.1
    with pytest.raises(ConfigError, match="gemma3 takes no rope_theta"):
        build_tiny("gemma3", cache_dir=tmp_path, rope_theta=10)
    with pytest.raises(ConfigError, match="rope_theta -1 must be positive"):
        build_tiny(family, cache_dir=tmp_path, rope_theta=-1)
