"""Qwen3-VL-MoE (`tiny:qwen3-vl-moe`): the family's real structure at tiny size, HF parity,
log-prob parity, a GRPO step that trains every expert that got tokens and the router.

The tiny model is Qwen3VLMoeForConditionalGeneration built from its config: every decoder layer a
sparse MoE block (4 experts, top-2, the two weights renormalised, no shared experts, as the real
30B-A3B's 128 experts, top-8), Qwen3-VL's vision tower with its deepstack tap.
"""

import filecmp
import os

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.forward.policy import Policy
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.templates import Template, get_template, templates_for_hf_type
from mmgrpo.templates.hooks import sampled_fps, video_metadata

FAMILY = "qwen3-vl-moe"


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


def _video(num_frames=4, width=84, height=56, fps=2.0):
    frames = np.random.RandomState(7).randint(0, 256, (num_frames, height, width, 3), dtype=np.uint8)
    metadata = {"fps": fps, "total_num_frames": 2 * num_frames, "frames_indices": list(range(0, 2 * num_frames, 2))}
    return Video(frames=list(frames), metadata=metadata)


def _sample(sample_id, messages, images=(), videos=()):
    return LoadedSample(id=sample_id, messages=messages, images=list(images), videos=list(videos))


def test_build_is_byte_identical_with_the_real_moe_structure(tmp_path, path, processor, model):
    first, second = build_tiny(FAMILY, cache_dir=tmp_path / "a"), build_tiny(FAMILY, cache_dir=tmp_path / "b")
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second))
    _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert mismatch == [] and errors == []

    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    assert model.config.model_type == "qwen3_vl_moe" and templates_for_hf_type("qwen3_vl_moe") == [FAMILY]
    assert 0.4e6 < sum(p.numel() for p in model.parameters()) < 2e6
    text = model.config.text_config
    assert (text.num_experts, text.num_experts_per_tok) == (4, 2)
    for layer in model.model.language_model.layers:  # every layer sparse (decoder_sparse_step 1), no shared expert
        assert {name for name, _ in layer.mlp.named_children()} == {"experts", "gate"}
        assert layer.mlp.experts.gate_up_proj.shape[0] == 4 and layer.mlp.gate.weight.shape[0] == 4
    assert model.config.vision_config.deepstack_visual_indexes == [0]
    template = get_template(FAMILY, processor)
    for module_path in template.components.values():
        model.get_submodule(module_path)
    assert template.box_convention == "rel1000" and not template.lean_decode
    assert template.stop_tokens == ("<|im_end|>", "<|endoftext|>")


# Rows of the parity check: text only (the `get_rope_index` rows without media), an image, a video,
# and a multi-turn conversation with an image in an earlier turn.
ROWS = {
    "text_only": ([{"role": "user", "content": "What is seven plus five?"}], 0, 0),
    "one_image": ([{"role": "system", "content": "Answer briefly."},
                   {"role": "user", "content": "<image>What colour is the shape?"}], 1, 0),
    "video": ([{"role": "user", "content": "<video>What moves?"}], 0, 1),
    "multi_turn": ([{"role": "user", "content": "<image>What is this?"},
                    {"role": "assistant", "content": "A red square."},
                    {"role": "user", "content": "And its size?"}], 1, 0),
}  # fmt: skip


@pytest.mark.parametrize("row", sorted(ROWS))
def test_parity_with_hf_processor(row, processor):
    messages, num_images, num_videos = ROWS[row]
    template = get_template(FAMILY, processor)
    images = [_image(84, 56, seed=i) for i in range(num_images)]
    videos = [_video() for _ in range(num_videos)]
    sample = _sample(f"parity/{row}", messages, images, videos)
    prompt = template.encode_prompt(sample)

    hf_messages = [{"role": m["role"], "content": Template.content_parts(m["content"])} for m in messages]
    hf_text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    assert hf_text == prompt.prompt_text
    kwargs = {"images": images} if images else {}
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["videos_kwargs"] = {"video_metadata": [video_metadata(v) for v in videos], "do_sample_frames": False,
                                   "size": template.media["video"].videos.size, "fps": sampled_fps(videos[0])}
    expected = processor(text=[hf_text], return_tensors="pt", **kwargs)
    assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist()
    keys = {k for k in expected if k not in ("input_ids", "attention_mask")}
    assert set(prompt.mm) == keys
    for key in keys:
        want = torch.as_tensor(expected[key])
        want = want[0] if key in template.token_keys else want
        assert torch.equal(prompt.mm[key], want.to(prompt.mm[key].dtype)), key


def _two_prompts(template):
    """Two prompts of different lengths (left padding): an image, and a video with an image."""
    first = _sample("lp/0", [{"role": "user", "content": "<image>Hi."}], [_image(84, 56)])
    second = _sample("lp/1", [{"role": "user", "content": "Think: <image> and <video> which is red?"}],
                     [_image(140, 112, seed=1)], [_video()])
    return [template.encode_prompt(first), template.encode_prompt(second)]


def _sequence_logps(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def test_forward_logprobs_match_generate_and_grpo_step_trains_every_routed_expert(processor, model):
    template = get_template(FAMILY, processor)
    prompts = _two_prompts(template)
    batch = template.collate(prompts)
    assert batch["attention_mask"][0, 0] == 0  # left padding
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=True, suppress_tokens=template.suppress_token_ids,
                             output_logits=True, return_dict_in_generate=True)
    completion_ids = out.sequences[:, batch["input_ids"].shape[1]:]  # [2, T]
    expected = _sequence_logps(torch.stack(out.logits, dim=1), completion_ids)  # [2, T]
    mask = torch.ones_like(completion_ids)
    for shared_prefix in (False, True):
        policy = Policy(model, template, shared_prefix=shared_prefix)
        assert policy.shared_prefix == shared_prefix
        with torch.no_grad():
            logps, _ = policy.completion_logprobs(policy.forward_batch(prompts, [1, 1]), completion_ids, mask)
        torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)

    # one GRPO-like step: the vision tower, the LLM, every expert that got a token and every router get gradient
    routed = {}  # layer index -> the experts its router picked

    def record(layer):
        return lambda module, args, output: routed.setdefault(layer, set()).update(output[2].flatten().tolist())

    layers = model.model.language_model.layers
    handles = [layer.mlp.gate.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        model.zero_grad(set_to_none=True)
        logps, _ = policy.completion_logprobs(policy.forward_batch(prompts, [1, 1]), completion_ids, mask)
        (-(logps * torch.tensor([1.0, -1.0])[:, None]).sum()).backward()
    finally:
        for handle in handles:
            handle.remove()
    for part in ("vision", "llm"):
        assert sum(p.grad.abs().sum() for p in policy.component(part).parameters() if p.grad is not None) > 0
    for i, layer in enumerate(layers):
        assert layer.mlp.gate.weight.grad.abs().sum(1).gt(0).all(), f"layer {i}: a router row got no gradient"
        for expert in routed[i]:
            for weights in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                assert weights.grad[expert].abs().sum() > 0, f"layer {i}: expert {expert} got tokens but no gradient"
    model.zero_grad(set_to_none=True)


def test_published_30b_a3b_counts_and_estimate(capsys):
    """`random:qwen3-vl-30b-a3b` on the meta device: the published 31.1B parameters, 3.9B active per
    token (3.35B in the language model: its "A3B"), and `mmgrpo estimate` names the expert weights."""
    from mmgrpo.config import TrainConfig
    from mmgrpo.config.flags import config_from_namespace
    from mmgrpo.estimate import active_parameters, build_estimate_parser, main, model_shape

    argv = ["--model", "random:qwen3-vl-30b-a3b", "--bf16", "--gradient_checkpointing"]
    shape = model_shape(config_from_namespace(TrainConfig, build_estimate_parser().parse_args(argv)))
    assert (shape.experts, shape.experts_per_token, shape.intermediate) == (128, 8, 8 * 768)
    assert round(shape.params["total"] / 1e9, 1) == 31.1
    assert round(active_parameters(shape) / 1e9, 2) == 3.89
    language_active = active_parameters(shape) - shape.params["vision"] - shape.params["aligner"]
    assert round(language_active / 1e9, 2) == 3.35
    main(argv + ["--parallel", "fsdp2", "--world_size", "8", "--device_memory_gb", "1000"])  # fits: no advice to search
    out = capsys.readouterr().out
    assert "31.07B parameters, 3.89B active per token (8 of 128 experts)" in out
    assert "expert weights 28.99B = 14.5 GB fp32 per device, sharded over 8 devices by fsdp2" in out


# ---------------------------------------------------------------------------------------------
# SFT, eval and resume through the command line (one cheap run each)
# ---------------------------------------------------------------------------------------------

CLI = ["--model", "tiny:qwen3-vl-moe", "--dataset", "shapes-color", "--per_device_train_batch_size", "4",
       "--dataloader_num_workers", "0", "--report_to", "none", "--max_completion_length", "6"]


def _metrics(out):
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft_and_eval_run(tmp_path):
    from mmgrpo.cli import main

    main(["sft", *CLI, "--max_steps", "2", "--output_dir", str(tmp_path / "sft")])
    assert [m["step"] for m in _metrics(tmp_path / "sft")] == [1, 2]
    main(["eval", "--model", str(tmp_path / "sft" / "final"), "--dataset", "shapes-color:test", "--limit", "4",
          "--max_completion_length", "6", "--output_dir", str(tmp_path / "eval")])
    assert (tmp_path / "eval" / "eval.json").is_file()


def test_a_resumed_run_logs_the_uninterrupted_runs_step(tmp_path):
    """Two GRPO steps (routing replay on) against one step then a resume from its checkpoint."""
    import shutil

    from mmgrpo.cli import main

    reward = tmp_path / "reward.py"  # a reward random completions differ in, so the steps train
    reward.write_text("def length(completions, **columns):\n    return [len(c) / 100 for c in completions]\n")
    flags = [*CLI, "--reward_funcs", f"{reward}:length", "--num_generations", "2", "--max_steps", "2",
             "--save_steps", "1", "--routing_replay", "rollout"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    main(["train", *flags, "--output_dir", str(whole)])
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoint-2")
    main(["train", *flags, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    expected, got = _metrics(whole), _metrics(resumed)
    assert [m["step"] for m in got] == [1, 2] and expected[-1]["grad_norm"] > 0 and expected[-1]["kl"] > 0
    for key, value in expected[-1].items():
        if not (key.startswith(("time/", "cpu/", "memory/")) or key.endswith(("_s", "per_s"))):  # seconds differ
            assert got[-1][key] == value, key
