"""Real model sizes at full width on the CPU: `random:` checkpoints (mmgrpo/models/real_configs.py)
with the published Qwen2.5-VL-3B/7B and Qwen3-VL-8B configurations at reduced depth.

    .venv/bin/python -m pytest -q -p no:xdist tests/test_real_size.py

The configurations (no weights, meta device): the published parameter counts, window size,
full-attention blocks, mRoPE sections, deepstack taps, tied and untied heads; bad names.
At full width (3B: hidden 2048, a 1280-wide vision tower, the 151,936-token vocabulary; one decoder
layer, vision blocks [window, full]): window attention confines a block to its 112-pixel windows and
a full-attention block does not; shared-prefix log-probs and gradients equal the naive forward's
(tied head: the embedding's gradient comes from both uses); the lean decode step's greedy tokens
equal HF generate's; a GRPO step trains every trainable weight (full training with the LLM frozen:
the fp32 optimizer state of the whole 3B width would be 7 GB, over what a CI test may hold) and
LoRA with --freeze_vit trains its adapters only. Qwen3-VL-30B-A3B at one layer (its 128 experts,
1.3B parameters) and Qwen3.5-9B at one group of its hybrid pattern (2.9B parameters, 12 GB in fp32):
a LoRA step trains every adapter. The untied 7B head (slow): greedy decode and
log-probs at 3584 wide.

The heavy tests share one xdist group, so at most one full-width model is in memory at a time
(each holds 2-6 GB).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.errors import ConfigError
from mmgrpo.models.real_configs import REAL_SIZES, parse_random_name, real_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_worker  # noqa: E402  (fixed completions and image prompts)
from test_shared_prefix import (  # noqa: E402  (the naive-vs-shared-prefix checks of the tiny families)
    GROUP,
    _assert_grads_equal,
    _assert_greedy_equals_hf_generate,
    _backend,
    _completions,
    _image,
    _logps_and_grads,
    _naive_hidden,
    _sampled_logps_and_naive,
)

MODEL_3B = "random:qwen2.5-vl-3b?num_hidden_layers=1&vision_depth=2"
MODEL_7B = "random:qwen2.5-vl-7b?num_hidden_layers=1&vision_depth=1"
MODEL_MOE = "random:qwen3-vl-30b-a3b?num_hidden_layers=1&vision_depth=1"
MODEL_HYBRID = "random:qwen3.5-9b?num_hidden_layers=4&vision_depth=1"  # 3 Gated DeltaNet layers + 1 full attention
heavy = pytest.mark.xdist_group("real_size")  # one full-width model in memory at a time

# The published totals of the checkpoints (safetensors), in billions.
PUBLISHED_BILLIONS = {"qwen2.5-vl-3b": 3.75, "qwen2.5-vl-7b": 8.29, "qwen3-vl-8b": 8.77, "qwen3-vl-30b-a3b": 31.07}


def _meta_model(size, overrides=None):
    import transformers

    from mmgrpo.models.tiny_recipes import RECIPES

    with torch.device("meta"):
        return getattr(transformers, RECIPES[REAL_SIZES[size].family].model_class)(real_config(size, overrides))


# ---------------------------------------------------------------------------------------------
# The configurations (no weights)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", list(PUBLISHED_BILLIONS))  # other sizes are tested by their family's file
def test_published_configurations(size):
    model = _meta_model(size)
    total = sum(p.numel() for p in model.parameters())
    assert round(total / 1e9, 2) == PUBLISHED_BILLIONS[size]
    real = REAL_SIZES[size]
    text, vision = model.config.get_text_config(), model.config.vision_config
    assert model.get_input_embeddings().weight.shape == (real.text["vocab_size"], real.text["hidden_size"])
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == real.tie_word_embeddings == (size == "qwen2.5-vl-3b")
    assert text.rope_parameters["mrope_section"] == real.text["mrope_section"]
    assert len(model.model.visual.blocks) == vision.depth == real.vision["depth"]
    if real.family == "qwen2.5-vl":
        assert (vision.window_size, vision.fullatt_block_indexes, vision.out_hidden_size) == (112, [7, 15, 23, 31], text.hidden_size)
    else:
        assert vision.deepstack_visual_indexes == [8, 16, 24] and len(model.model.visual.deepstack_merger_list) == 3


def test_bad_random_names_list_the_choices(capsys):
    from mmgrpo.cli import main

    with pytest.raises(ConfigError, match="unknown size 'qwen2.5-vl-9b'; known: qwen2.5-vl-3b, qwen2.5-vl-7b, qwen3-vl-8b"):
        parse_random_name("random:qwen2.5-vl-9b")
    with pytest.raises(ConfigError, match="known: num_hidden_layers, vision_depth, seed"):
        parse_random_name("random:qwen2.5-vl-3b?hidden_size=128")
    with pytest.raises(ConfigError, match="is not KEY=INTEGER"):
        parse_random_name("random:qwen2.5-vl-3b?num_hidden_layers=two")
    with pytest.raises(ConfigError, match="num_hidden_layers=40 must be 1 to 36"):
        parse_random_name("random:qwen2.5-vl-3b?num_hidden_layers=40")
    with pytest.raises(SystemExit):  # `mmgrpo train` names it in one line, before anything loads
        main(["train", "--model", "random:qwen9-vl", "--max_steps", "1"])
    assert "unknown size 'qwen9-vl'; known: qwen2.5-vl-3b" in capsys.readouterr().err


def test_an_upgrade_leaves_one_build_of_each_size(tmp_path):
    """A new build removes the earlier builds of the same size and overrides (unreachable after a
    builder or library upgrade), not other overrides, and not a build used in the last hour."""
    import json
    import os

    from mmgrpo.models.real_configs import remove_stale_builds

    def build(name, overrides, age_s):
        folder = tmp_path / f"random-qwen2.5-vl-3b-{name}"
        folder.mkdir()
        (folder / "mmgrpo_random.json").write_text(json.dumps({"size": "qwen2.5-vl-3b", "overrides": overrides}))
        os.utime(folder / "mmgrpo_random.json", (0, os.path.getmtime(folder) - age_s))
        return folder

    depth = {"num_hidden_layers": 1}
    new, old, other, recent = build("new", depth, 0), build("old", depth, 7200), build("other", {}, 7200), build("recent", depth, 60)
    assert remove_stale_builds(new, "qwen2.5-vl-3b", depth) == [old]
    assert new.exists() and other.exists() and recent.exists() and not old.exists()


@pytest.mark.parametrize("size", ["qwen2.5-vl-3b", "qwen3-vl-8b"])
def test_mrope_sections(size):
    """The decoder's rotary angles: each published section of the 64 rotary frequencies follows its
    own position axis (time, height, width), in blocks for Qwen2.5-VL and interleaved for Qwen3-VL."""
    config = real_config(size)
    rotary = type(_meta_model(size, {"num_hidden_layers": 1, "vision_depth": 1}).model.language_model.rotary_emb)
    rotary = rotary(config.get_text_config())
    x = torch.zeros(1, 1, dtype=torch.float32)

    def angles(t, h, w):
        cos, _ = rotary(x, torch.tensor([t, h, w]).view(3, 1, 1))
        return cos[0, 0, :64]  # the second half repeats the first

    P = 1_000_003  # far enough that the slowest frequency (1e-6 rad per position) turns in fp32
    moved = {axis: set(torch.nonzero(angles(*pos) != angles(0, 0, 0)).flatten().tolist())
             for axis, pos in (("t", (P, 0, 0)), ("h", (0, P, 0)), ("w", (0, 0, P)))}  # fmt: skip
    t, h, w = REAL_SIZES[size].text["mrope_section"]
    if size == "qwen2.5-vl-3b":  # [16, 24, 24] in blocks
        expected = {"t": set(range(t)), "h": set(range(t, t + h)), "w": set(range(t + h, 64))}
    else:  # [24, 20, 20] interleaved: h and w take every third frequency from 1 and 2, t the rest
        h_dims, w_dims = set(range(1, 3 * h, 3)), set(range(2, 3 * w, 3))
        expected = {"t": set(range(64)) - h_dims - w_dims, "h": h_dims, "w": w_dims}
    assert moved == expected


# ---------------------------------------------------------------------------------------------
# Full width, reduced depth
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def model_3b():
    """The 3B width (one decoder layer, vision blocks [window, full]) in fp32 and its template."""
    from mmgrpo.models import load_model, load_processor
    from mmgrpo.templates import get_template

    model = load_model(MODEL_3B, dtype=torch.float32)
    assert model.model.visual.fullatt_block_indexes == [1]
    return model, get_template("qwen2.5-vl", load_processor(MODEL_3B))


def _image_prompt(template, image, text="<image>Describe this."):
    from mmgrpo.data.sample import LoadedSample

    return template.encode_prompt(LoadedSample(id="r/0", messages=[{"role": "user", "content": text}], images=[image]))


def _prompts_3b(template):
    """Left-padded prompts: an image of 2 x 3 windows (one partial), two small images, text only."""
    from mmgrpo.data.sample import LoadedSample

    return [
        _image_prompt(template, _image(252, 196, seed=4)),
        template.encode_prompt(LoadedSample(id="r/1", messages=[{"role": "user", "content": "Is <image> redder than <image>?"}],
                                            images=[_image(112, 84, seed=5), _image(56, 56, seed=6)])),
        template.encode_prompt(LoadedSample(id="r/2", messages=[{"role": "user", "content": "Hi."}])),
    ]  # fmt: skip


@heavy
def test_video_frames_get_the_library_budget_not_the_tiny_one():
    """A real size's video processor keeps transformers' Qwen2-VL budget: 128 to 768 merged 28-pixel
    patches a frame (a 448 x 448 frame stays 448 x 448), where the tiny models' is 4 to 16."""
    from mmgrpo.models import load_processor

    video = load_processor(MODEL_3B).video_processor
    assert (video.size.shortest_edge, video.size.longest_edge) == (128 * 28 * 28, 768 * 28 * 28)
    assert video.patch_size == 14 and video.merge_size == 2


@heavy
class TestTiedHead3B:
    """The 3B width's tied head and [window, full] tower, one fp32 copy for these tests: released
    before the tests below load their own runs (a CI test holds one full-width model at a time)."""

    def test_window_attention_at_the_real_window_size(self, model_3b):
        """A 224 x 280 image is 8 x 10 merged tokens in windows of 112 pixels (4 x 4 tokens): pixels
        changed inside the first window move only that window's tokens through windowed blocks, and
        every token once a full-attention block (the reduced tower's last) follows."""
        model, template = model_3b
        visual = model.model.visual
        image = _image(280, 224, seed=3)
        changed = image.copy()
        changed.paste((255, 0, 0), (10, 10, 100, 100))  # inside the window of rows 0-111, columns 0-111

        def tokens(picture, full_attention_blocks):
            encoded = _image_prompt(template, picture)
            saved, visual.fullatt_block_indexes = visual.fullatt_block_indexes, full_attention_blocks
            try:
                with torch.no_grad():
                    out = visual(encoded.mm["pixel_values"], grid_thw=encoded.mm["image_grid_thw"])
            finally:
                visual.fullatt_block_indexes = saved
            return out.pooler_output.reshape(8, 10, -1)  # the merger's output [rows, columns, 2048], raster order

        windowed = (tokens(changed, []) - tokens(image, [])).abs().amax(-1)  # [8, 10]
        assert windowed[:4, :4].min() > 1e-3  # the first window's 16 tokens moved
        outside = windowed.clone()
        outside[:4, :4] = 0
        assert outside.max() < 1e-5, outside  # no other token did
        full = (tokens(changed, [1]) - tokens(image, [1])).abs().amax(-1)
        assert full.min() > 1e-4  # a full-attention block spreads it to every token

    def test_shared_prefix_logps_and_gradients_at_full_width(self, model_3b):
        """The tied head: the embedding's gradient adds the LM head's (every vocabulary row) and the
        prompt tokens' lookups; both paths give the same, at 151,936 x 2048."""
        from mmgrpo.forward.shared_prefix import shared_prefix_hidden

        model, template = model_3b
        batch = template.collate(_prompts_3b(template)[::2])  # an image of 2 x 3 windows; text only
        ids, mask = _completions(2)
        weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
        expected, expected_grads = _logps_and_grads(model, lambda: _naive_hidden(model, template, batch, ids, mask), ids, mask, weights)
        got, grads = _logps_and_grads(
            model, lambda: shared_prefix_hidden(model, template, batch, ids, mask, GROUP), ids, mask, weights
        )
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert "model.language_model.embed_tokens.weight" in grads and "lm_head.weight" not in grads  # tied
        _assert_grads_equal(expected_grads, grads, template, batch)

    def test_lean_decode_equals_hf_generate_at_full_width(self, model_3b):
        model, template = model_3b
        assert _backend(model, template, [template.pad_token_id]).lean is not None  # the lean step decodes
        _assert_greedy_equals_hf_generate(model, template, _prompts_3b(template), "sdpa")


def _run(tmp_path, *flags, model: str = MODEL_3B):
    from mmgrpo.config import TrainConfig

    cfg = TrainConfig.from_args([
        "--model", model, "--dataset", "shapes-color", "--reward_funcs", f"{dist_worker.WORKER}:length_reward",
        "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "6",
        "--learning_rate", "1e-3", "--dataloader_num_workers", "0", "--output_dir", str(tmp_path), "--max_steps", "1",
        *flags,
    ])  # fmt: skip
    return dist_worker.prepared_run(cfg, fixed_completions=True)


def _step_changes(run) -> tuple[set[str], set[str]]:
    """One GRPO step on two image prompts: (names of the weights it changed, names of the trainable ones)."""
    from mmgrpo.engine import grpo_step

    trainable = {name for name, param in run.model.named_parameters() if param.requires_grad}
    before = {name: param.detach().clone() for name, param in run.model.named_parameters() if name in trainable}
    frozen_sums = {name: _exact_sum(param) for name, param in run.model.named_parameters() if name not in trainable}
    grpo_step(run, dist_worker.image_prompts(run.template, 2), step=1)
    after = dict(run.model.named_parameters())
    assert all(_exact_sum(after[name]) == value for name, value in frozen_sums.items())  # frozen stay
    return {name for name in trainable if not torch.equal(after[name], before[name])}, trainable


def _exact_sum(param) -> float:
    """A float64 sum of a weight, 16M values at a time (a float64 copy of a 248,320-row embedding is 8 GB)."""
    return sum(chunk.double().sum().item() for chunk in param.detach().flatten().split(1 << 24))


def activate_adapters(model) -> None:
    """peft starts lora_B at zero, where lora_A gets no gradient: give B small random values so every adapter acts."""
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.05


@heavy
def test_one_grpo_step_trains_every_trainable_weight_at_full_width(tmp_path):
    """Full training with the LLM frozen (its fp32 AdamW state at this width would not fit a CI
    test): the vision tower's windowed and full blocks and the merger all move, through the
    frozen 2048-wide decoder and tied 151,936-row head; the reference holds only their copy."""
    run = _run(tmp_path, "--freeze_llm", "--beta", "0.04")
    changed, trainable = _step_changes(run)
    assert trainable and all(name.startswith("model.visual.") for name in trainable)
    assert changed == trainable, f"did not train: {sorted(trainable - changed)}"
    shared = {id(p) for p in run.model.parameters() if not p.requires_grad}
    assert sum(p.numel() for p in run.policy.ref_model.parameters() if id(p) not in shared) == sum(
        run.model.get_parameter(name).numel() for name in trainable)  # a copy of what trains, no more


@heavy
def test_lora_with_freeze_vit_at_full_width(tmp_path):
    """LoRA on every linear layer of the 2048-wide decoder and the merger (--freeze_vit: none in the
    vision blocks): one step changes every adapter and nothing else; the reference is the base."""
    run = _run(tmp_path, "--train_type", "lora", "--lora_rank", "4", "--lora_dropout", "0", "--freeze_vit", "--beta", "0.04")
    activate_adapters(run.model)
    changed, trainable = _step_changes(run)
    assert trainable and all("lora_" in name for name in trainable)
    assert not any(".visual.blocks." in name for name in trainable) and any(".visual.merger." in name for name in trainable)
    assert any(".language_model.layers.0.mlp." in name for name in trainable)
    assert changed == trainable, f"did not train: {sorted(trainable - changed)}"
    assert run.policy.ref_model is None  # the base model with its adapters off


@heavy
def test_moe_lora_step_at_full_width(tmp_path):
    """Qwen3-VL-30B-A3B's width at one layer (2048 wide, 128 experts of 768 with top-8 routing, the
    untied 151,936-row head, one 1152-wide vision block with its deepstack tap; 1.3B parameters):
    one LoRA GRPO step changes every adapter and nothing else. The fused experts are one tensor, not
    linear layers: LoRA adapts attention and the merger."""
    run = _run(tmp_path, "--train_type", "lora", "--lora_rank", "4", "--lora_dropout", "0", "--freeze_vit",
               "--beta", "0.04", model=MODEL_MOE)
    assert sum(p.numel() for p in run.model.parameters()) > 1.2e9
    activate_adapters(run.model)
    changed, trainable = _step_changes(run)
    assert trainable and all("lora_" in name for name in trainable)
    assert any(".language_model.layers.0.self_attn." in name for name in trainable)
    assert changed == trainable, f"did not train: {sorted(trainable - changed)}"


@heavy
def test_hybrid_lora_step_at_full_width(tmp_path):
    """Qwen3.5-9B's width at the depth of one group of its hybrid pattern (3 Gated DeltaNet layers of 16 key
    and 32 value heads, one gated full-attention layer, hidden 4096, the untied 248,320-row head, one
    1152-wide vision block; 2.9B parameters, 11.8 GB in fp32): one LoRA GRPO step, through the shared
    prefix, changes every adapter (both token mixers' projections, the MLPs, the merger) and nothing else."""
    run = _run(tmp_path, "--train_type", "lora", "--lora_rank", "4", "--lora_dropout", "0", "--freeze_vit",
               "--beta", "0.04", model=MODEL_HYBRID)
    assert run.policy.shared_prefix and run.model.get_output_embeddings().weight.shape == (248320, 4096)
    activate_adapters(run.model)
    changed, trainable = _step_changes(run)
    assert trainable and all("lora_" in name for name in trainable)
    for part in (".layers.0.linear_attn.in_proj_qkv.", ".layers.3.self_attn.q_proj.", ".layers.0.mlp."):
        assert any(part in name for name in trainable), part
    assert changed == trainable, f"did not train: {sorted(trainable - changed)}"


@pytest.mark.slow
@heavy
def test_untied_7b_head_decodes_and_scores_as_the_naive_paths():
    """Qwen2.5-VL-7B's width (3584, 28 query heads over 4 KV heads) and untied 152,064-row head, one
    layer: greedy lean decode equals HF generate and sampled log-probs equal the naive forward's."""
    from mmgrpo.models import load_model, load_processor
    from mmgrpo.templates import get_template

    model = load_model(MODEL_7B, dtype=torch.float32)
    template = get_template("qwen2.5-vl", load_processor(MODEL_7B))
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    assert model.lm_head.weight.shape == (152064, 3584)
    prompts = _prompts_3b(template)
    _assert_greedy_equals_hf_generate(model, template, prompts, "sdpa")
    eos = list(range(0, 152064, 9))  # about one sampled token in 9 ends a row, anywhere in the vocabulary
    logps, expected = _sampled_logps_and_naive(model, template, template.collate(prompts), eos)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
