"""The names vLLM loads weights by (mmgrpo/rollout/vllm_weights.py), without vLLM: each family's rules
(`Template.vllm_weight_names`) take the names transformers holds in memory and the names it saved in
the tiny checkpoint to one set, the original layout, and leave that layout as it is; a checkpoint
whose names they change is loaded through a renamed view with the same tensors.

vLLM itself loading the views and the synced weights: tests/test_vllm_families.py (.venv-vllm).
"""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mmgrpo.errors import CheckpointError
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.rollout.vllm_weights import safetensors_header, vllm_checkpoint, vllm_named
from mmgrpo.templates import get_template

RENAMED = ["qwen2-audio", "qwen2.5-omni", "llava-onevision", "gemma3"]
# A name of each family's original checkpoints (what vLLM's class loads), per part
ORIGINAL = {
    "qwen2-audio": ["audio_tower.layers.0.fc1.weight", "multi_modal_projector.linear.weight",
                    "language_model.model.layers.0.self_attn.q_proj.weight", "language_model.lm_head.weight"],
    "qwen2.5-omni": ["thinker.audio_tower.conv1.weight", "thinker.visual.blocks.0.attn.q.weight",
                     "thinker.model.layers.0.mlp.up_proj.weight", "thinker.lm_head.weight"],
    "llava-onevision": ["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "image_newline",
                        "multi_modal_projector.linear_1.weight", "language_model.model.norm.weight",
                        "language_model.lm_head.weight"],
    "gemma3": ["vision_tower.vision_model.embeddings.patch_embedding.weight",
               "multi_modal_projector.mm_input_projection_weight", "language_model.model.embed_tokens.weight"],
}

OMNI_SPEECH = ["talker.model.norm.weight", "token2wav.code2wav_dit_model.proj_out.weight"]


@pytest.fixture(scope="module")
def tiny():
    """family -> (checkpoint folder, template, model)"""
    out = {}
    for family in RENAMED:
        path = str(build_tiny(family))
        template = get_template(family, load_processor(path))
        out[family] = (path, template, load_model(path, template=template))
    return out


@pytest.mark.parametrize("family", RENAMED)
def test_memory_and_saved_names_meet_in_the_original_layout(family, tiny):
    path, template, model = tiny[family]
    saved = [name for name in safetensors_header(os.path.join(path, "model.safetensors")) if name != "__metadata__"]
    in_memory = [name for name, _ in model.named_parameters()]
    original = {template.vllm_weight_name(name) for name in saved}
    assert {template.vllm_weight_name(name) for name in in_memory} == original
    assert len(original) == len(saved)  # no two tensors become one
    assert {template.vllm_weight_name(name) for name in original} == original  # the layout is left as it is
    assert set(ORIGINAL[family]) <= original and all(template.vllm_weight_name(n) == n for n in ORIGINAL[family])
    if family == "qwen2.5-omni":  # a full checkpoint's other parts keep their names (vLLM skips them)
        assert [template.vllm_weight_name(n) for n in OMNI_SPEECH] == OMNI_SPEECH


def test_a_family_vllm_maps_itself_keeps_its_names_and_folder():
    path = str(build_tiny("qwen2-vl"))
    template = get_template("qwen2-vl", load_processor(path))
    assert vllm_checkpoint(path, template) == path
    assert template.vllm_weight_name("model.language_model.layers.0.mlp.up_proj.weight") == \
        "model.language_model.layers.0.mlp.up_proj.weight"


def test_the_sync_renames_lazily(tiny):
    _, template, model = tiny["qwen2-audio"]
    pairs = vllm_named(((name, param) for name, param in model.named_parameters()), template)
    first_name, first = next(pairs)
    assert first_name.startswith(("audio_tower.", "language_model.", "multi_modal_projector."))
    assert first is next(iter(model.parameters()))  # the tensor itself, not a copy


def test_a_sharded_checkpoint_is_loaded_through_a_renamed_view(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "cache"))
    _, template, model = tiny["llava-onevision"]
    folder = tmp_path / "checkpoint-7"
    model.save_pretrained(folder, max_shard_size="300KB")
    template.processor.save_pretrained(folder)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()

    view = vllm_checkpoint(str(folder), template)
    assert view != str(folder) and view.startswith(str(tmp_path / "cache" / "vllm"))
    tensors = {}
    for shard in sorted(os.listdir(view)):
        if shard.endswith(".safetensors"):
            with safe_open(os.path.join(view, shard), "pt") as f:  # a valid file, the tensors by their new names
                tensors.update({name: f.get_tensor(name) for name in f.keys()})
    originals = {name: tensor for shard in shards for name, tensor in load_file(shard).items()}
    assert tensors.keys() == {template.vllm_weight_name(name) for name in originals}
    assert all(torch.equal(tensors[template.vllm_weight_name(name)], t) for name, t in originals.items())
    index = json.loads(open(os.path.join(view, "model.safetensors.index.json")).read())
    assert set(index["weight_map"]) == set(tensors)
    assert os.path.islink(os.path.join(view, "config.json"))  # the rest is the checkpoint's own files

    written = os.path.getmtime(os.path.join(view, shards[0].name))
    assert vllm_checkpoint(str(folder), template) == view  # written once per checkpoint
    assert os.path.getmtime(os.path.join(view, shards[0].name)) == written
    assert vllm_checkpoint(view, template) == view  # names already vLLM's: used as they are


def test_omnis_thinker_is_loaded_as_a_full_model_without_speech_output(tiny, tmp_path, monkeypatch):
    """vLLM registers Qwen2.5-Omni's thinker only inside the full model: a thinker checkpoint gets a
    view with the full model's config and `thinker.` names; a full checkpoint is used as it is."""
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "cache"))
    path, template, _ = tiny["qwen2.5-omni"]
    view = vllm_checkpoint(path, template)
    config = json.loads(open(os.path.join(view, "config.json")).read())
    thinker = json.loads(open(os.path.join(path, "config.json")).read())
    assert config["architectures"] == ["Qwen2_5OmniModel"] and config["enable_audio_output"] is False
    assert config["thinker_config"]["text_config"]["hidden_size"] == thinker["text_config"]["hidden_size"]
    assert all(name.startswith("thinker.") for name in safetensors_header(os.path.join(view, "model.safetensors"))
               if name != "__metadata__")
    assert vllm_checkpoint(view, template) == view  # a full model's folder: nothing to change


def test_two_tensors_that_would_get_one_name_are_an_error(tiny, tmp_path):
    _, template, _ = tiny["gemma3"]
    tensor = torch.zeros(2)
    (tmp_path / "config.json").write_text("{}")
    save_file({"vision_tower.encoder.x": tensor, "vision_tower.vision_model.encoder.x": tensor.clone()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="vision_tower.encoder.x.*both become vision_tower.vision_model.encoder.x"):
        vllm_checkpoint(str(tmp_path), template)


def test_qwen3_vl_moe_expert_banks_reach_vllm_in_the_published_layout(tmp_path, monkeypatch):
    """vLLM loads Qwen3-VL-MoE's fused expert banks as the published checkpoints store them, the last two
    dims swapped from transformers': the sync sends them transposed (views), and a checkpoint transformers
    saved starts vLLM from a view with them transposed, the other tensors as they are. Told apart by a
    layer's two shapes, also where gate_up_proj is square (the tiny model: hidden 128, 2 x width 128)."""
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "cache"))
    path = str(build_tiny("qwen3-vl-moe"))
    template = get_template("qwen3-vl-moe", load_processor(path))
    saved = load_file(os.path.join(path, "model.safetensors"))
    gate_up, down = "model.language_model.layers.0.mlp.experts.gate_up_proj", "model.language_model.layers.0.mlp.experts.down_proj"
    assert saved[gate_up].shape == (4, 128, 128) and saved[down].shape == (4, 128, 64)  # [experts, hidden, width]

    view = vllm_checkpoint(path, template)
    assert view != path
    published = load_file(os.path.join(view, "model.safetensors"))
    assert published.keys() == saved.keys()
    for name, tensor in saved.items():
        expected = tensor.transpose(-1, -2) if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) else tensor
        assert torch.equal(published[name], expected), name
    assert published[down].shape == (4, 64, 128)
    assert vllm_checkpoint(view, template) == view  # the published layout: used as it is

    sent = dict(vllm_named(((name, tensor) for name, tensor in saved.items()), template))
    assert torch.equal(sent[gate_up], published[gate_up]) and sent[gate_up].data_ptr() == saved[gate_up].data_ptr()
    assert torch.equal(sent["lm_head.weight"], saved["lm_head.weight"])
