"""GLM-4.1V (`glm4v`), GLM-4.5V (`glm4v-moe`: MoE with a shared expert) and GLM-4.6V (`glm46v`) on their
tiny checkpoints (the real transformers classes):
  - builds are byte-identical, have the family's structure and infer their template from config.json;
  - the template gives Glm4vProcessor's / Glm46VProcessor's ids and tensors for text, images, a video
    (timestamped frames), a multi-turn row and a row without media, and `get_rope_index` positions
    for batches with and without media;
  - the engine's log-probs equal generate's scores on left-padded batches of 2, and a GRPO-like step
    reaches the vision tower, the merger, the LLM and, for the MoE, the router, the shared expert and
    every routed expert that got tokens; a batch mixing images and videos is refused (transformers'
    forward cannot take it, shown here);
  - `mmgrpo train` changes every trainable weight, `--freeze_vit` freezes the tower, LoRA finds the
    linear layers, and `mmgrpo sft`, `mmgrpo eval` and resume run end to end (cheap, tiny:glm4v).
"""

import filecmp
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mmgrpo.errors import DataError
from mmgrpo.forward.policy import Policy
from mmgrpo.models import load_model, load_processor
from mmgrpo.models.loading import infer_model_type
from mmgrpo.models.tiny import build_tiny
from mmgrpo.templates import Template, get_template, templates_for_hf_type
from mmgrpo.templates.hooks import video_metadata
from tests.test_families import _image, _sample, _video

FAMILIES = ["glm4v", "glm4v-moe", "glm46v"]
MODEL_CLASS = {
    "glm4v": "Glm4vForConditionalGeneration",
    "glm4v-moe": "Glm4vMoeForConditionalGeneration",
    "glm46v": "Glm46VForConditionalGeneration",
}
HF_TYPE = {"glm4v": "glm4v", "glm4v-moe": "glm4v_moe", "glm46v": "glm46v"}


@pytest.fixture(scope="module")
def paths():
    return {family: str(build_tiny(family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def processors(paths):
    return {family: load_processor(path) for family, path in paths.items()}


@pytest.fixture(scope="module")
def models(paths):
    return {family: load_model(path) for family, path in paths.items()}


# ---------------------------------------------------------------------------------------------
# Builds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_byte_identical_with_the_real_structure(family, tmp_path, paths, processors, models):
    first, second = build_tiny(family, cache_dir=tmp_path / "a"), build_tiny(family, cache_dir=tmp_path / "b")
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second))
    assert filecmp.cmpfiles(first, second, names, shallow=False)[1:] == ([], [])

    model, processor = models[family], processors[family]
    assert type(model).__name__ == MODEL_CLASS[family] and model.config.model_type == HF_TYPE[family]
    assert 0.4e6 < sum(p.numel() for p in model.parameters()) < 2e6
    assert len(processor.tokenizer) == model.config.get_text_config().vocab_size
    assert type(processor).__name__ == ("Glm46VProcessor" if family == "glm46v" else "Glm4vProcessor")
    template = get_template(family, processor)
    for path in template.components.values():
        model.get_submodule(path)
    suppressed = set(processor.tokenizer.convert_ids_to_tokens(template.suppress_token_ids))
    assert {"<|image|>", "<|video|>", "<|begin_of_video|>", "[gMASK]"} <= suppressed
    assert set(template.stop_token_ids).isdisjoint(template.suppress_token_ids)
    # the stop tokens are the checkpoint's eos ids (GLM-4.1V's generation_config: endoftext, user, observation)
    assert set(template.eos_token_ids) == set(model.generation_config.eos_token_id)
    # --model_type is inferred from config.json (a copy without the tiny: name)
    copy = shutil.copytree(paths[family], tmp_path / "copy")
    assert infer_model_type(str(copy)) == family and templates_for_hf_type(HF_TYPE[family]) == [family]
    layers = model.model.language_model.layers
    if family == "glm4v-moe":  # GLM-4.5V: the first layer dense, then routed experts, top-k, a shared expert
        moe = layers[1].mlp
        assert type(layers[0].mlp).__name__ == "Glm4vMoeTextMLP"
        assert moe.experts.num_experts == 4 and moe.gate.top_k == 2 and moe.shared_experts is not None
        assert moe.gate.weight.abs().sum() > 0  # transformers zero-initialises the router
    else:  # GLM's decoder layer norms the attention and MLP outputs again
        assert hasattr(layers[0], "post_self_attn_layernorm") and hasattr(layers[0], "post_mlp_layernorm")


# ---------------------------------------------------------------------------------------------
# Parity with the HF processor
# ---------------------------------------------------------------------------------------------

CASES = {
    "text_only": ("What is seven plus five?", [], []),
    "one_image": ("<image>What colour is the shape?", [(84, 56)], []),
    "two_images": ("Compare <image> with <image>: which is bigger?", [(90, 60), (50, 120)], []),
    "big_image": ("<image>Where is it?", [(300, 100)], []),
    "video": ("<video>What moves?", [], [4]),
    "odd_frames": ("<video>What moves?", [], [5]),
}


def _messages(case):
    content, image_sizes, frame_counts = CASES[case]
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(image_sizes)]
    videos = [_video(num_frames=n) for n in frame_counts]
    return content, images, videos


def _hf_inputs(processor, template, text, images, videos):
    kwargs = {"images": images} if images else {}
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["videos_kwargs"] = {
            "video_metadata": [video_metadata(v) for v in videos],
            "do_sample_frames": False,
            "size": template.media["video"].videos.size,
        }
    return processor(text=[text], return_tensors="pt", **kwargs)


def _check_parity(processor, template, sample):
    prompt = template.encode_prompt(sample)
    messages = [{"role": m["role"], "content": Template.content_parts(m["content"])} for m in sample.messages]
    hf_text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_text == prompt.prompt_text
    expected = _hf_inputs(processor, template, hf_text, sample.images, sample.videos)
    assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist(), processor.tokenizer.decode(prompt.prompt_ids)
    keys = {k for k in expected if k not in ("input_ids", "attention_mask")}
    assert set(prompt.mm) == keys and "mm_token_type_ids" in keys
    for key in keys:
        want = torch.as_tensor(expected[key])
        want = want[0] if key == "mm_token_type_ids" else want
        assert torch.equal(prompt.mm[key], want.to(prompt.mm[key].dtype)), key
    return prompt


@pytest.mark.parametrize("family", ["glm4v", "glm46v"])  # glm4v-moe has glm4v's processor and template
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_hf_processor(family, case, processors):
    content, images, videos = _messages(case)
    template = get_template(family, processors[family])
    _check_parity(processors[family], template, _sample(f"p/{case}", content, images, videos, system="Answer briefly."))


@pytest.mark.parametrize("family", ["glm4v", "glm46v"])
def test_multi_turn_parity(family, processors):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "<image>How many shapes?"},
        {"role": "assistant", "content": "<think>I count them.</think><answer>3</answer>"},
        {"role": "user", "content": "And in <image>?"},
    ]
    sample = _sample("p/multi", "", [_image(84, 56), _image(56, 112, seed=1)])
    sample.messages = messages
    prompt = _check_parity(processors[family], get_template(family, processors[family]), sample)
    assert prompt.prompt_text.startswith("[gMASK]<sop><|system|>\nAnswer briefly.<|user|>\n<|begin_of_image|>")
    assert "<|assistant|>\n<think>I count them.</think><answer>3</answer><|user|>\nAnd in " in prompt.prompt_text


def test_a_tool_turn_follows_the_models_observation_token(processors):
    """A model turn that calls a tool ends with `<|observation|>` (a stop token); the tool results and the next
    model turn follow it, as a dataset row of the same conversation renders them."""
    template = get_template("glm4v", processors["glm4v"])
    results = [[{"type": "text", "text": "42"}], [{"type": "image"}]]
    assert template.render_tool_turn(results) == "\n42<|observation|>\n<|begin_of_image|><|image|><|end_of_image|><|assistant|>\n"
    messages = [{"role": "user", "content": "Ask."}, {"role": "assistant", "content": "call"}]
    tools = [{"role": "tool", "content": parts} for parts in results]
    assert template.render(messages + tools) == (
        template.render(messages, add_generation_prompt=False) + "<|observation|>" + template.render_tool_turn(results)
    )
    hf_text = processors["glm4v"].apply_chat_template(messages + tools, add_generation_prompt=True, tokenize=False)
    assert hf_text == template.render(messages + tools)  # the tiny chat template renders tool turns the same


def test_video_timestamps(processors):
    """Each temporal patch's first frame: frames 0, 2, 4, 6 of a 2 fps clip are patches at 0 s and 2 s."""
    video = _video(num_frames=4, fps=2.0)
    texts = {}
    for family in ("glm4v", "glm46v"):
        prompt = get_template(family, processors[family]).encode_prompt(_sample("ts", "<video>?", [], [video]))
        texts[family] = processors[family].tokenizer.decode(prompt.prompt_ids)
    assert "<|end_of_image|>0<|begin_of_image|>" in texts["glm4v"] and "<|end_of_image|>2<|end_of_video|>" in texts["glm4v"]
    assert "<|end_of_image|>0.0 seconds<|begin_of_image|>" in texts["glm46v"]
    assert "<|end_of_image|>2.0 seconds<|end_of_video|>" in texts["glm46v"]


def test_positions_for_rows_with_and_without_media(processors, models):
    """get_rope_index positions on a text-only batch (no grids at all) and on a batch whose second row
    has no media: text rows count 0, 1, 2 ... over their tokens; the forward runs with them."""
    template, model = get_template("glm4v", processors["glm4v"]), models["glm4v"]
    for samples in (
        [_sample("t/0", "Hi."), _sample("t/1", "What is seven plus five?")],
        [_sample("m/0", "<image>Hi.", [_image(84, 56)]), _sample("m/1", "What is seven plus five?")],
    ):
        batch = template.collate([template.encode_prompt(s) for s in samples])
        positions = template.position_ids(model, batch)  # [3, 2, L]
        text_row = batch["attention_mask"][1].bool()
        length = int(text_row.sum())
        assert positions.shape == (3, 2, batch["input_ids"].shape[1])
        assert (positions[:, 1, text_row] == torch.arange(length)).all()
        with torch.no_grad():
            model(**batch, position_ids=positions)


def test_video_tokens_are_typed_inside_video_spans_only(processors):
    template = get_template("glm4v", processors["glm4v"])
    sample = _sample("v/1", "<video>then", [], [_video()])
    prompt = template.encode_prompt(sample)
    image_id = template.token_id("<|image|>")
    types = prompt.mm["mm_token_type_ids"]
    assert bool((types[prompt.prompt_ids == image_id] == 2).all()) and int((types == 1).sum()) == 0
    # a completion holding a tool turn's image: its tokens are typed 1 (forward_inputs' completion types)
    completion = torch.tensor([[template.token_id("<|begin_of_image|>"), image_id, image_id, 5]])
    assert template.token_type_inputs(completion)["mm_token_type_ids"].tolist() == [[0, 1, 1, 0]]


# ---------------------------------------------------------------------------------------------
# Log-probs of the engine's path equal generate's scores; one GRPO step reaches every part
# ---------------------------------------------------------------------------------------------


def _batches():
    """Left-padded batches of 2, each with a row without media: an image batch and a video batch
    (transformers' forward takes images and videos in separate batches only)."""
    images = [_sample("lp/0", "<image>Hi.", [_image(84, 56)]), _sample("lp/1", "Think: which of them is the red one?")]
    videos = [_sample("lp/2", "Hi."), _sample("lp/3", "<video>Which one moves?", [], [_video()])]
    return {"images": images, "videos": videos}


def _sequence_logps(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def _routed_experts(model, run):
    """Run `run()` and return {MoE layer name: set of routed expert indices that got tokens}."""
    routed, handles = {}, []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopkRouter"):
            def record(mod, args, out, name=name):
                routed.setdefault(name, set()).update(out[-1].flatten().tolist())  # (logits, weights, indices)

            handles.append(module.register_forward_hook(record))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return routed


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("media", ["images", "videos"])
def test_forward_logprobs_match_generate_and_grpo_step(family, media, processors, models):
    template, model = get_template(family, processors[family]), models[family]
    prompts = [template.encode_prompt(s) for s in _batches()[media]]
    batch = template.collate(prompts)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][1].all()  # left padding
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=True, suppress_tokens=template.suppress_token_ids,
                             output_logits=True, return_dict_in_generate=True)
    prompt_len = batch["input_ids"].shape[1]
    completion_ids = out.sequences[:, prompt_len:]  # [2, T]
    expected = _sequence_logps(torch.stack(out.logits, dim=1), completion_ids)  # [2, T]
    mask = torch.ones_like(completion_ids)

    policy = Policy(model, template)
    forward_batch = policy.forward_batch(prompts, [1, 1])
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)  # the engine's path
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)

    # the exact positions generate used, G=2 completions per prompt (rows and media repeated)
    grouped_ids = completion_ids.repeat_interleave(2, dim=0)  # [4, T]
    inputs = template.forward_inputs(batch, grouped_ids, torch.ones_like(grouped_ids), model=model)
    with torch.no_grad():
        hidden = model.get_submodule("model")(**inputs, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]
        grouped = _sequence_logps(model.lm_head(hidden), grouped_ids)
    torch.testing.assert_close(grouped, expected.repeat_interleave(2, dim=0), atol=1e-5, rtol=0)

    # one GRPO-like step: tower, merger, LLM (MoE: router, shared expert, every expert that got tokens)
    model.zero_grad(set_to_none=True)

    def step():
        logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
        (-(logps * torch.tensor([1.0, -1.0])[:, None]).sum()).backward()

    routed = _routed_experts(model, step)
    for part in ("vision", "aligner", "llm"):
        grads = [p.grad for p in policy.component(part).parameters() if p.grad is not None]
        assert grads and sum(g.abs().sum() for g in grads) > 0, f"{family}: no gradient in {part}"
    if family == "glm4v-moe":
        moe = model.model.language_model.layers[1].mlp
        (name,) = routed  # the one MoE layer
        assert moe.gate.weight.grad.abs().sum() > 0
        assert all(p.grad.abs().sum() > 0 for p in moe.shared_experts.parameters())
        per_expert = moe.experts.gate_up_proj.grad.abs().flatten(1).sum(1)  # [experts]
        assert {i for i, g in enumerate(per_expert.tolist()) if g > 0} == routed[name] and len(routed[name]) >= 2
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_on_video_batches(family, processors, models):
    """The group-shared prefix (forward, greedy and sampled rollouts) equals the naive paths on the
    batches tests/test_shared_prefix.py cannot mix into its image batches: a text row beside videos."""
    from mmgrpo.forward.shared_prefix import shared_prefix_hidden, supports_shared_prefix
    from tests.test_shared_prefix import (
        GROUP,
        _assert_grads_equal,
        _assert_greedy_equals_hf_generate,
        _completions,
        _logps_and_grads,
        _naive_hidden,
        _prompts,
        _sampled_logps_and_naive,
    )

    template, model = get_template(family, processors[family]), models[family]
    assert supports_shared_prefix(model, template) == (True, "")
    batch = template.collate(_prompts(template, ("text", "video", "question")))
    ids, mask = _completions(3)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    expected, expected_grads = _logps_and_grads(model, lambda: _naive_hidden(model, template, batch, ids, mask), ids, mask, weights)
    got, grads = _logps_and_grads(
        model, lambda: shared_prefix_hidden(model, template, batch, ids, mask, GROUP), ids, mask, weights
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    _assert_grads_equal(expected_grads, grads, template, batch)
    _assert_greedy_equals_hf_generate(model, template, _prompts(template, ("text", "video", "video")), "sdpa")
    logps, expected = _sampled_logps_and_naive(model, template, batch)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)


def test_a_batch_of_images_and_videos_is_refused(processors, models):
    """transformers' GLM forward fills every <|image|> token from the images: with a video beside them
    it fails (shown), so collate names the samples instead."""
    template, model = get_template("glm4v", processors["glm4v"]), models["glm4v"]
    prompts = [template.encode_prompt(_sample("mix/0", "<image>?", [_image(56, 56)])),
               template.encode_prompt(_sample("mix/1", "<video>?", [], [_video()]))]
    with pytest.raises(DataError, match=r"mix/0 \(images\) and mix/1 \(videos\).*not both"):
        template.collate(prompts)
    batch = Template.collate(template, prompts)  # the base collation, as transformers would get it
    with pytest.raises(Exception, match="Image features and image tokens do not match"):
        with torch.no_grad():
            model(**batch)


def test_vllm_requests_say_glm_video_frames_come_sampled(processors):
    """vLLM 0.32's GLM-4V processor reads do_sample_frames from each video's metadata (a KeyError without it)
    and, where False, the frames_indices beside it: the requests carry both (vLLM itself:
    tests/test_vllm_prompts.py). GLM-4.1V and GLM-4.5V have nothing left that vLLM runs otherwise."""
    from mmgrpo.rollout.vllm_requests import prompt_media, vllm_prompt

    template = get_template("glm4v-moe", processors["glm4v-moe"])
    prompt = template.encode_prompt(_sample("v", "<video>?", [], [_video()]))
    request = vllm_prompt(prompt.prompt_text, prompt_media(prompt), template.rollout_processor_kwargs(), None,
                          template.vllm_video_metadata)
    ((frames, metadata),) = request["multi_modal_data"]["video"]
    assert metadata["do_sample_frames"] is False and len(metadata["frames_indices"]) == len(frames)
    assert template.vllm_prompt_problem(prompt) is None
    assert not template.vllm_mismatch and not get_template("glm4v", processors["glm4v"]).vllm_mismatch


def test_boxes_are_thousandths_of_the_image(processors):
    template = get_template("glm4v", processors["glm4v"])
    assert template.box_convention == "rel1000"
    assert template.box_to_image([100, 200, 500, 1000], (1000, 500), (448, 224)) == [100.0, 100.0, 500.0, 500.0]
    ids = processors["glm4v"].tokenizer("<|begin_of_box|>[100,200,500,1000]<|end_of_box|>")["input_ids"]
    assert template.decode(torch.tensor([ids]), torch.ones(1, len(ids)))[0] == "[100,200,500,1000]"
    ids = processors["glm4v"].tokenizer("<think>so</think><answer>3</answer>")["input_ids"]
    assert template.decode(torch.tensor([ids]), torch.ones(1, len(ids)))[0] == "<think>so</think><answer>3</answer>"


# ---------------------------------------------------------------------------------------------
# The commands, cheaply, on tiny:glm4v (tiny:glm4v-moe for the GRPO step)
# ---------------------------------------------------------------------------------------------

FAST = ["--dataset", "shapes-color", "--num_generations", "4", "--per_device_train_batch_size", "4",
        "--max_completion_length", "6", "--dataloader_num_workers", "0", "--report_to", "none", "--torch_threads", "1"]
VARIED_REWARD = "def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n"


@pytest.mark.parametrize("family", ["glm4v", "glm4v-moe"])
def test_one_train_step_changes_every_trainable_weight(family, tmp_path):
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    plugin = tmp_path / "reward.py"
    plugin.write_text(VARIED_REWARD)  # rewards that differ within a group: non-zero advantages
    cfg = TrainConfig.from_args(["--model", f"tiny:{family}", *FAST, "--reward_funcs", f"{plugin}:length",
                                 "--max_steps", "1", "--learning_rate", "1e-3", "--beta", "0",
                                 "--output_dir", str(tmp_path / "run")])
    out = train(cfg)
    model = load_model(str(build_tiny(family)))
    parameters = {name for name, _ in model.named_parameters()}
    before = load_file(f"{build_tiny(family)}/model.safetensors")
    after = load_file(str(out / "checkpoint-1" / "model.safetensors"))
    unchanged = [name for name in before if name in parameters and torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters that did not train: {unchanged}"


def test_freeze_vit_and_lora_find_glm_modules(processors, models):
    from mmgrpo.config.schema import ModelConfig
    from mmgrpo.models.train_type import freeze, lora_targets

    template = get_template("glm4v", processors["glm4v"])
    model = load_model(str(build_tiny("glm4v")))
    freeze(model, template.components, ModelConfig(model="tiny:glm4v", freeze_vit=True))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith("model.visual.") and not n.startswith("model.visual.merger.") for n in frozen)
    assert {n for n, _ in model.named_parameters() if n.startswith("model.visual.blocks.")} <= frozen
    targets = lora_targets(models["glm4v"], template.components, ModelConfig(model="tiny:glm4v", target_modules=["all-linear"]))
    leaves = {t.rsplit(".", 1)[-1] for t in targets}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj", "qkv", "proj"} <= leaves
    assert "lm_head" not in targets


def test_lora_on_the_moe_wraps_the_routed_experts():
    """peft 0.21 puts adapters on transformers' fused routed experts too (a ParamWrapper, which takes no
    dropout: GLM-4.5V LoRA runs need --lora_dropout 0); a backward reaches them."""
    from mmgrpo.config.schema import ModelConfig
    from mmgrpo.models.train_type import apply_train_type

    template_components = get_template("glm4v-moe", load_processor(str(build_tiny("glm4v-moe")))).components
    model = load_model(str(build_tiny("glm4v-moe")))
    model, peft_model = apply_train_type(model, template_components, ModelConfig(model="tiny:glm4v-moe", train_type="lora", lora_dropout=0.0))
    experts = [n for n, p in model.named_parameters() if ".mlp.experts." in n and "lora_" in n and p.requires_grad]
    assert experts and peft_model is not None
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model(input_ids=ids).logits.sum().backward()
    assert all(model.get_parameter(n).grad is not None for n in experts if "lora_B" in n)


def test_sft_eval_and_resume_run(tmp_path):
    from mmgrpo.cli import main as cli_main

    cli_main(["sft", "--model", "tiny:glm4v", *FAST[:2], "--per_device_train_batch_size", "4", "--max_steps", "2",
              "--dataloader_num_workers", "0", "--report_to", "none", "--output_dir", str(tmp_path / "sft")])
    assert len((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()) == 2

    cli_main(["eval", "--model", "tiny:glm4v", "--dataset", "shapes-color:test", "--limit", "4",
              "--max_completion_length", "6", "--output_dir", str(tmp_path / "eval")])
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["counts"]["all"] == 4 and set(result["metrics"]) == {"answer_format", "vqa_accuracy"}

    # resume: a run continued from its checkpoint-2 logs steps 3 and 4 as the run that went straight through
    plugin = tmp_path / "reward.py"
    plugin.write_text(VARIED_REWARD)
    flags = ["train", "--model", "tiny:glm4v", *FAST, "--reward_funcs", f"{plugin}:length", "--max_steps", "4",
             "--save_steps", "2", "--learning_rate", "1e-3", "--beta", "0.04"]
    cli_main([*flags, "--output_dir", str(tmp_path / "straight")])
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", resumed / "checkpoint-2")
    lines = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    cli_main([*flags, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])

    def steps(folder):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith(("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s"))}
                for row in rows]

    resumed_steps, straight_steps = steps(resumed), steps(tmp_path / "straight")
    differ = {k: (a[k], b.get(k)) for a, b in zip(resumed_steps, straight_steps) for k in a if a[k] != b.get(k)}
    assert resumed_steps == straight_steps, differ
