"""Qwen3.5, dense (`qwen3.5`) and MoE (`qwen3.5-moe`): tiny builds of the real transformers classes with
the real hybrid decoder (Gated DeltaNet layers, linear, linear, linear, full), HF processor parity,
positions of rows without media and of multi-turn rows, log-prob parity with `generate`, rollouts
through `generate`'s own hybrid cache, and a GRPO step that trains every part (MoE: every expert
that got tokens, the router).

    .venv/bin/python -m pytest -q -p no:randomly tests/test_family_qwen3_5.py
"""

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.forward.policy import Policy
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.rollout import HFRollout, SamplingParams
from mmgrpo.templates import Template, get_template, templates_for_hf_type
from mmgrpo.templates.hooks import sampled_fps, video_metadata

FAMILIES = ["qwen3.5", "qwen3.5-moe"]
MODEL_CLASS = {"qwen3.5": "Qwen3_5ForConditionalGeneration", "qwen3.5-moe": "Qwen3_5MoeForConditionalGeneration"}
HF_TYPE = {"qwen3.5": "qwen3_5", "qwen3.5-moe": "qwen3_5_moe"}
PATTERN = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
ROOT = Path(__file__).resolve().parents[1]


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


def _video(num_frames=4, width=84, height=56, fps=2.0):
    frames = np.random.RandomState(7).randint(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    metadata = {"fps": fps, "total_num_frames": 2 * num_frames, "frames_indices": list(range(0, 2 * num_frames, 2)),
                "duration": 2 * num_frames / fps, "width": width, "height": height}  # fmt: skip
    return Video(frames=frames, metadata=metadata)


# A conversation whose earlier assistant turn thought aloud: Qwen3.5's chat template keeps only its answer.
MULTI_TURN = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "<image>What colour is the shape?"},
    {"role": "assistant", "content": "<think>\nIt looks red.\n</think>\n\nRed."},
    {"role": "user", "content": "  And how many shapes are there?  "},
]
CASES = {  # messages, images, videos
    "text_only": ([{"role": "user", "content": "What is seven plus five?"}], [], []),
    "one_image": ([{"role": "user", "content": "<image>What colour is the shape?"}], [(84, 56)], []),
    "two_images": ([{"role": "user", "content": "Compare <image> with <image>: which is bigger?"}], [(90, 60), (50, 120)], []),
    "video": ([{"role": "user", "content": "<video>What moves?"}], [], [1]),
    "multi_turn": (MULTI_TURN, [(56, 84)], []),
    "multi_turn_text": ([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "<think>x</think>Hello."},
                         {"role": "user", "content": "Count to three."}], [], []),
}


def _sample(case):
    messages, images, videos = CASES[case]
    return LoadedSample(id=f"q35/{case}", messages=[dict(m) for m in messages],
                        images=[_image(w, h, seed=i) for i, (w, h) in enumerate(images)], videos=[_video() for _ in videos])


def _hf_inputs(processor, template, text, sample):
    """Qwen3VLProcessor on the rendered text and raw media, as Qwen3.5 checkpoints ship it."""
    kwargs = {}
    if sample.images:
        kwargs["images"] = sample.images
    if sample.videos:
        kwargs["videos"] = [v.frames for v in sample.videos]
        kwargs["videos_kwargs"] = {"video_metadata": [video_metadata(v) for v in sample.videos], "do_sample_frames": False,
                                   "size": template.media["video"].videos.size, "fps": sampled_fps(sample.videos[0])}
    return processor(text=[text], return_tensors="pt", **kwargs)


# ---------------------------------------------------------------------------------------------
# Builds: the real structure at tiny size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_byte_identical_with_the_real_structure(family, tmp_path, paths, processors, models):
    first, second = build_tiny(family, cache_dir=tmp_path / "a"), build_tiny(family, cache_dir=tmp_path / "b")
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second))
    _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert mismatch == [] and errors == []

    model, processor = models[family], processors[family]
    assert type(model).__name__ == MODEL_CLASS[family] and model.config.model_type == HF_TYPE[family]
    assert templates_for_hf_type(HF_TYPE[family]) == [family]  # --model_type is inferred from the checkpoint
    assert 0.4e6 < sum(p.numel() for p in model.parameters()) < 2e6
    assert type(processor).__name__ == "Qwen3VLProcessor"  # what the Qwen3.5 checkpoints ship
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    assert len(processor.tokenizer) == model.config.get_text_config().vocab_size

    text = model.config.get_text_config()
    layers = model.model.language_model.layers
    assert text.layer_types == PATTERN
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, True, True, False]  # Gated DeltaNet
    assert [hasattr(layer, "self_attn") for layer in layers] == [False, False, False, True]
    assert text.linear_num_value_heads == 2 * text.linear_num_key_heads  # grouped as in Qwen3.5-9B
    assert text.rope_parameters["partial_rotary_factor"] == 0.25 and text.rope_parameters["mrope_interleaved"]
    assert not hasattr(model.model.visual, "deepstack_merger_list")  # Qwen3.5's tower has no deepstack taps
    if family == "qwen3.5-moe":
        for layer in layers:
            assert layer.mlp.experts.gate_up_proj.shape[0] == 4 and layer.mlp.gate.top_k == 2
            assert hasattr(layer.mlp, "shared_expert") and hasattr(layer.mlp, "shared_expert_gate")
            assert layer.mlp.gate.weight.abs().sum() > 0  # a random router spreads the tokens

    template = get_template(family, processor)
    for path in template.components.values():
        model.get_submodule(path)
    # shared prefix: attention K/V and Gated DeltaNet states (tests/test_shared_prefix.py); the lean step: the
    # dense decoder (tests/test_lean_decode.py), not MoE blocks
    assert template.shared_prefix and template.linear_attention_layers
    assert template.lean_decode == (family == "qwen3.5")
    suppressed = set(processor.tokenizer.convert_ids_to_tokens(template.suppress_token_ids))
    assert {"<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"} <= suppressed
    think = processor.tokenizer("<think>\nx\n</think>\n\nRed.", add_special_tokens=False)["input_ids"]
    assert processor.tokenizer.convert_ids_to_tokens(think[:1]) == ["<think>"]  # one token, as in the real vocabulary
    assert processor.tokenizer.decode(think, skip_special_tokens=True) == "<think>\nx\n</think>\n\nRed."  # kept


def test_the_shared_prefix_takes_linear_attention_where_the_template_declares_it(models, processors):
    from mmgrpo.forward.shared_prefix import supports_shared_prefix

    template = get_template("qwen3.5", processors["qwen3.5"])
    assert supports_shared_prefix(models["qwen3.5"], template) == (True, "")
    assert Policy(models["qwen3.5"], template).shared_prefix
    undeclared = type("Undeclared", (type(template),), {"linear_attention_layers": False})(processors["qwen3.5"])
    ok, reason = supports_shared_prefix(models["qwen3.5"], undeclared)
    assert not ok and "linear_attention" in reason, reason
    assert not Policy(models["qwen3.5"], undeclared).shared_prefix


# ---------------------------------------------------------------------------------------------
# The HF processor's ids and tensors; the chat format's thinking tags
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_hf_processor(family, case, processors):
    processor = processors[family]
    template = get_template(family, processor)
    sample = _sample(case)
    prompt = template.encode_prompt(sample)
    messages = [{"role": m["role"], "content": Template.content_parts(m["content"])} for m in sample.messages]
    hf_text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_text == prompt.prompt_text
    expected = _hf_inputs(processor, template, hf_text, sample)
    assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist(), processor.tokenizer.decode(prompt.prompt_ids)
    expected_keys = {k for k in expected if k not in ("input_ids", "attention_mask")}
    assert set(prompt.mm) == expected_keys
    for key in expected_keys:
        want = torch.as_tensor(expected[key])
        want = want[0] if key in template.token_keys else want
        assert torch.equal(prompt.mm[key], want.to(prompt.mm[key].dtype)), key


def test_thinking_tags(processors):
    """The dense template answers (an empty think block closes the prompt), the MoE one thinks (the
    prompt opens the block); an earlier assistant turn keeps its answer, a later one its reasoning."""
    dense, moe = (get_template(f, processors[f]) for f in FAMILIES)
    messages = [{"role": "user", "content": "Hi."}]
    assert dense.render(messages).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert moe.render(messages).endswith("<|im_start|>assistant\n<think>\n")
    text = dense.render(MULTI_TURN)
    assert "<|im_start|>assistant\nRed.<|im_end|>" in text and "It looks red" not in text
    assert "<|im_start|>user\nAnd how many shapes are there?<|im_end|>" in text  # trimmed
    for family, thinking in (("qwen3.5", True), ("qwen3.5-moe", False)):  # the other mode, as enable_thinking says
        hf = processors[family].apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                    enable_thinking=thinking)
        other = type("Other", (type(get_template(family, processors[family])),), {"thinking": thinking})
        assert other(processors[family]).render(messages) == hf
    # a model turn that called a tool keeps its (empty) think block before the tool's result, as the chat template does
    tool_turn = dense.render_tool_turn([[{"type": "text", "text": "4"}]])
    assert tool_turn == ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---------------------------------------------------------------------------------------------
# Positions: rows without media and multi-turn rows (get_rope_index)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_index_of_rows_without_media_and_multi_turn_rows(family, processors, models):
    template, model = get_template(family, processors[family]), models[family]
    text_only = template.collate([template.encode_prompt(_sample("multi_turn_text"))])
    positions = template.position_ids(model, text_only)  # [3, 1, L]: a batch without any media
    length = text_only["input_ids"].shape[1]
    assert torch.equal(positions, torch.arange(length).expand(3, 1, length))

    prompts = [template.encode_prompt(_sample(case)) for case in ("text_only", "multi_turn")]
    batch = template.collate(prompts)
    positions = template.position_ids(model, batch)  # [3, 2, L], the text-only row left-padded
    mask = batch["attention_mask"].bool()
    n = int(mask[0].sum())
    assert torch.equal(positions[:, 0, mask[0]], torch.arange(n).expand(3, n))
    image = batch["mm_token_type_ids"][1] == 1
    grid = batch["image_grid_thw"][0].tolist()
    image_positions = positions[:, 1, image]  # the image block of the multi-turn row: 3-D positions
    assert image_positions[1].unique().numel() == grid[1] // 2 and image_positions[2].unique().numel() == grid[2] // 2
    after = positions[0, 1, mask[1]][int(image.nonzero().max()) - (~mask[1]).sum() + 1:]
    assert torch.equal(after, after[0] + torch.arange(after.numel()))  # text after the image runs on by one
    # the template's positions are the ones the model computes itself (a forward without position_ids)
    with torch.no_grad():
        own = model(**batch, use_cache=False).logits
        ours = model(**batch, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(ours[mask], own[mask], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Log-probs of the engine's path equal generate's; rollouts through the hybrid cache
# ---------------------------------------------------------------------------------------------


def _logps(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def _batch_samples():
    """A text-only prompt and a longer multi-turn one with an image and a video (left padding)."""
    first = LoadedSample(id="lp/0", messages=[{"role": "user", "content": "Hi."}])
    second = LoadedSample(id="lp/1", messages=[*MULTI_TURN[:3], {"role": "user", "content": "<video> and this one?"}],
                          images=[_image(140, 112, seed=1)], videos=[_video()])
    return [first, second]


def _routed_experts(model, run) -> dict[int, set[int]]:
    """{layer: the experts its router picked} while `run()` runs ({} for a model without experts)."""
    picked, hooks = {}, []
    for index, layer in enumerate(model.model.language_model.layers):
        if not hasattr(layer.mlp, "gate") or not hasattr(layer.mlp, "experts"):
            continue
        def record(module, args, output, index=index):
            picked.setdefault(index, set()).update(output[2].flatten().tolist())  # (logits, scores, indices)
        hooks.append(layer.mlp.gate.register_forward_hook(record))
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return picked


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_without_media_scores_as_generate(family, processors, models):
    """No media in the whole batch: `generate` then numbers positions itself (0, 1, ... from the first
    column, padding included), the template from the first real token (`get_rope_index`); the
    log-probs agree (RoPE sees relative positions only), a multi-turn row included."""
    template, model = get_template(family, processors[family]), models[family]
    prompts = [template.encode_prompt(_sample(case)) for case in ("text_only", "multi_turn_text")]
    batch = template.collate(prompts)
    assert batch["attention_mask"][0, 0] == 0 and "pixel_values" not in batch
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=5, do_sample=True, suppress_tokens=template.suppress_token_ids,
                             output_logits=True, return_dict_in_generate=True)
    completion_ids = out.sequences[:, batch["input_ids"].shape[1]:]
    policy = Policy(model, template)
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(policy.forward_batch(prompts, [1, 1]), completion_ids,
                                              torch.ones_like(completion_ids))
    torch.testing.assert_close(logps, _logps(torch.stack(out.logits, dim=1), completion_ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_logprobs_match_generate_and_every_part_gets_gradient(family, processors, models):
    template, model = get_template(family, processors[family]), models[family]
    prompts = [template.encode_prompt(s) for s in _batch_samples()]
    batch = template.collate(prompts)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][1].all()  # left padding
    torch.manual_seed(0)
    with torch.no_grad():  # generate with the model's own hybrid cache (conv and recurrent states, K/V)
        out = model.generate(**batch, max_new_tokens=6, do_sample=True, suppress_tokens=template.suppress_token_ids,
                             output_logits=True, return_dict_in_generate=True)
    completion_ids = out.sequences[:, batch["input_ids"].shape[1]:]  # [2, T]
    expected = _logps(torch.stack(out.logits, dim=1), completion_ids)
    mask = torch.ones_like(completion_ids)

    policy = Policy(model, template)
    forward_batch = policy.forward_batch(prompts, [1, 1])
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)

    model.zero_grad(set_to_none=True)

    def backward():
        logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
        (-(logps * torch.tensor([1.0, -1.0])[:, None]).sum()).backward()

    picked = _routed_experts(model, backward)  # {} for the dense family: no router
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    for part in ("vision", "aligner", "llm"):
        prefix = template.components[part] + "."
        assert any(name.startswith(prefix) for name in grads), f"{family}: no gradient in {part}"
    for kind in ("linear_attn.in_proj_qkv", "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d",
                 "self_attn.q_proj", "self_attn.q_norm"):  # both token mixers learn
        assert any(kind in name for name in grads), f"{family}: no gradient in {kind}"
    for index, experts in picked.items():
        mlp = f"model.language_model.layers.{index}.mlp."
        assert mlp + "gate.weight" in grads and mlp + "shared_expert.up_proj.weight" in grads  # router, shared expert
        per_expert = grads[mlp + "experts.gate_up_proj"].abs().sum(dim=(1, 2))  # [experts]
        assert {int(e) for e in per_expert.nonzero().flatten()} == experts  # every expert that got tokens, no other
    assert not picked or any(len(experts) > 2 for experts in picked.values())  # the router spreads the tokens
    model.zero_grad(set_to_none=True)


def _greedy_without_cache(model, template, prompts, steps: int) -> torch.Tensor:
    """Greedy tokens [B, steps] by whole forwards over prompt + tokens so far, no cache."""
    batch = template.collate(prompts)
    ids = torch.empty(len(prompts), 0, dtype=torch.long)
    suppress = torch.tensor(template.suppress_token_ids)
    for _ in range(steps):
        inputs = template.forward_inputs(batch, ids, torch.ones_like(ids), model=model)
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits[:, -1].float()
        logits[:, suppress] = -float("inf")
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_rollout_through_the_hybrid_cache_equals_decoding_without_one(family, processors, models):
    """The rollout engine samples through `generate` with the model's own cache (a recurrent state and a
    convolution window per Gated DeltaNet layer, K/V per attention layer): its greedy tokens equal
    decoding by whole forwards with no cache, for G rows per prompt; and so do those of a following
    rollout of another number of prompts without media (the model keeps the last batch's mRoPE offsets
    between calls: they must not leak into it)."""
    template, model = get_template(family, processors[family]), models[family]
    engine = HFRollout(model, template)
    greedy = SamplingParams(num_generations=2, max_new_tokens=5, greedy=True)
    for prompts in ([template.encode_prompt(s) for s in _batch_samples()],
                    [template.encode_prompt(_sample(case)) for case in ("text_only", "multi_turn_text", "text_only")]):
        rollout = engine.generate(prompts, greedy)
        assert rollout.completion_ids.shape == (2 * len(prompts), 5)
        expected = _greedy_without_cache(model, template, prompts, 5).repeat_interleave(2, dim=0)
        expected = expected.masked_fill(rollout.completion_mask == 0, template.completion_pad_id)
        assert torch.equal(rollout.completion_ids, expected)


# ---------------------------------------------------------------------------------------------
# A GRPO step of the engine: rollout (shared prefix), rewards, loss, optimizer step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_one_grpo_step_changes_every_trainable_weight(family, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dist_worker

    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import grpo_step

    cfg = TrainConfig.from_args([
        "--model", f"tiny:{family}", "--dataset", "shapes-color", "--reward_funcs", f"{dist_worker.WORKER}:length_reward",
        "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "6",
        "--learning_rate", "1e-3", "--dataloader_num_workers", "0", "--output_dir", str(tmp_path), "--max_steps", "1",
    ])  # fmt: skip
    run = dist_worker.prepared_run(cfg, fixed_completions=False)  # the real rollout: each prompt's prefill once
    assert type(run.rollout).__name__ == "SharedPrefixRollout"
    model = run.model
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    picked = _routed_experts(model, lambda: grpo_step(run, dist_worker.image_prompts(run.template, 2), step=1))
    changed = {name for name, p in model.named_parameters() if name in before and not torch.equal(p, before[name])}
    assert changed == set(before), f"did not train: {sorted(set(before) - changed)}"
    for index, experts in picked.items():  # AdamW's weight decay moves every expert: the moments say which learnt
        state = run.optimizer.state[model.get_parameter(f"model.language_model.layers.{index}.mlp.experts.down_proj")]
        learnt = state["exp_avg"].abs().sum(dim=(1, 2)).nonzero().flatten().tolist()
        assert set(learnt) == experts


# ---------------------------------------------------------------------------------------------
# The real size: random:qwen3.5-9b (no weights, meta device)
# ---------------------------------------------------------------------------------------------


def test_the_published_9b_configuration():
    """Qwen3.5-9B's config.json (mmgrpo/models/real_configs.py): 9.41B parameters in transformers (the
    checkpoint's multi-token-prediction layer, which transformers does not load, not counted), 24 Gated
    DeltaNet and 8 full-attention layers, the 248,320-token vocabulary with an untied head. A GRPO
    step at full width is not run on the CPU: its embedding and head alone are 2.0B parameters
    (8 GB in fp32) at any depth."""
    import transformers

    from mmgrpo.models.real_configs import REAL_SIZES, parse_random_name, random_family, real_config

    assert random_family("random:qwen3.5-9b?num_hidden_layers=4") == "qwen3.5"
    assert parse_random_name("random:qwen3.5-9b?num_hidden_layers=4&vision_depth=1")[1] == {"num_hidden_layers": 4,
                                                                                            "vision_depth": 1}
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(real_config("qwen3.5-9b"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 9.41
    text = model.config.get_text_config()
    assert text.layer_types == PATTERN * 8 and text.linear_num_value_heads == 32 and text.head_dim == 256
    assert text.rope_parameters["partial_rotary_factor"] == 0.25 and text.rope_parameters["mrope_section"] == [11, 11, 10]
    assert model.lm_head.weight.shape == (248320, 4096) and model.lm_head.weight is not model.get_input_embeddings().weight
    assert len(model.model.visual.blocks) == 27 and model.config.vision_config.out_hidden_size == 4096
    assert REAL_SIZES["qwen3.5-9b"].processor_class == "Qwen3VLProcessor"
    reduced = real_config("qwen3.5-9b", {"num_hidden_layers": 4, "vision_depth": 1})
    assert reduced.get_text_config().layer_types == PATTERN  # a reduced depth keeps the pattern from the first layer


# ---------------------------------------------------------------------------------------------
# The commands with the family: LoRA targets, SFT then eval, kill-and-resume exactness
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_finds_both_token_mixers_and_the_shared_expert(family, models, processors):
    from mmgrpo.config import ModelConfig
    from mmgrpo.models.train_type import lora_targets

    template = get_template(family, processors[family])
    targets = lora_targets(models[family], template.components,
                           ModelConfig(train_type="lora", target_modules=["all-linear"], freeze_vit=True))
    leaves = {name.rsplit(".", 1)[-1] for name in targets}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "o_proj"} <= leaves
    assert not any(".visual.blocks." in name for name in targets) and "lm_head" not in targets
    if family == "qwen3.5-moe":  # the routed experts are 3-D weights, the router one matrix: no adapters there
        assert any(".shared_expert." in name for name in targets)
        assert not any(name.endswith((".mlp.gate", ".experts")) for name in targets)


def _metrics(out):
    varying = ("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(varying)} for row in rows]


def _cli(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "mmgrpo", *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_sft_then_eval_infers_the_family(tmp_path):
    """`mmgrpo sft` on tiny Qwen3.5, then `mmgrpo eval` of its checkpoint without --model_type."""
    sft_out, eval_out = tmp_path / "sft", tmp_path / "eval"
    _cli("sft", "--model", "tiny:qwen3.5", "--dataset", "shapes-color", "--per_device_train_batch_size", "4",
         "--max_steps", "2", "--dataloader_num_workers", "0", "--report_to", "none", "--output_dir", str(sft_out))
    final = sorted(p.parent for p in sft_out.rglob("model.safetensors"))[-1]
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3_5"
    _cli("eval", "--model", str(final), "--dataset", "shapes-color:test", "--limit", "4", "--max_completion_length", "8",
         "--output_dir", str(eval_out))
    result = json.loads((eval_out / "eval.json").read_text())
    assert result["counts"]["all"] == 4 and set(result["metrics"]) == {"answer_format", "vqa_accuracy"}


@pytest.mark.slow
def test_a_resumed_run_logs_the_uninterrupted_run(tmp_path):
    """Four GRPO steps straight, and the same run restarted from its checkpoint-2 (as a kill after that
    save leaves it): the same metrics, step for step (the MoE router and experts included)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run = ["train", "--model", "tiny:qwen3.5-moe", "--dataset", "shapes-color", "--num_generations", "2",
           "--per_device_train_batch_size", "4", "--max_completion_length", "6", "--learning_rate", "1e-3",
           "--beta", "0.04", "--save_steps", "2", "--dataloader_num_workers", "0", "--report_to", "none"]
    _cli(*run, "--max_steps", "4", "--output_dir", str(whole))
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    lines = (whole / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= 2))
    _cli(*run, "--max_steps", "4", "--output_dir", str(resumed), "--resume_from_checkpoint", "latest")
    assert _metrics(resumed) == _metrics(whole) and [row["step"] for row in _metrics(whole)] == [1, 2, 3, 4]
