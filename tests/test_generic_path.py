"""The generic path (--model_type auto) on four families no template declares, built tiny offline
(tests/generic_models.py): LLaVA-NeXT, Mistral3 (Pixtral processor), Idefics3, LFM2-VL.

For each: the prompt ids are the processor's own, completion log-probs through the engine's
Policy path equal generate's scores, a GRPO-like step reaches every part and an optimizer step
moves them, and `mmgrpo eval` runs. One `mmgrpo train --model_type auto` run, its checkpoint
inferred back to the generic path. Bad input: boxes with auto, a processor without a chat
template, a class neither a template nor the generic path serves.
"""

import copy
import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.cli import main
from mmgrpo.config import TrainConfig
from mmgrpo.data.sample import LoadedSample
from mmgrpo.errors import ConfigError
from mmgrpo.forward.policy import Policy
from mmgrpo.models.loading import infer_model_type, load_model, load_template
from mmgrpo.training.startup_checks import check_train_flags

sys.path.insert(0, str(Path(__file__).parent))
from generic_models import GENERIC_FAMILIES, build_generic  # noqa: E402

PARTS = ("vision", "aligner", "llm")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("generic")


@pytest.fixture(scope="module")
def loaded(root):
    """family -> (folder, processor, template, model), built and loaded once."""
    out = {}
    for family in GENERIC_FAMILIES:
        folder = build_generic(family, root)
        path, processor, template = load_template(str(folder), "auto")
        out[family] = (folder, processor, template, load_model(path, template=template))
    return out


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _samples() -> list[LoadedSample]:
    """Two prompts of different lengths, image counts and sizes: the batch is left-padded, its media concatenated."""
    return [
        LoadedSample("g/0", [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "<image><image>Which one is red?"}],
                     images=[_image(70, 50), _image(60, 90, seed=1)]),
        LoadedSample("g/1", [{"role": "user", "content": "Look: <image> which shape is it?"}],
                     images=[_image(120, 60, seed=2)]),
    ]


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_prompt_ids_and_tensors_are_the_processors(family, loaded):
    _, processor, template, _ = loaded[family]
    for sample in _samples():
        prompt = template.encode_prompt(sample)
        parts = [{**m, "content": template.content_parts(m["content"])} for m in sample.messages]
        images = iter(sample.images)
        for part in (p for m in parts for p in m["content"] if p["type"] == "image"):
            part["image"] = next(images)
        expected = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, return_tensors="pt")
        assert prompt.prompt_ids.tolist() == expected["input_ids"][0].tolist()
        assert set(prompt.mm) == set(expected) - {"input_ids", "attention_mask"}
        for key, value in prompt.mm.items():
            torch.testing.assert_close(value, expected[key], atol=0, rtol=0)
        image_token = template.media["image"].placeholder
        assert prompt.prompt_text.count(image_token) == len(sample.images)  # one placeholder per image: the rollout payload


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_policy_logprobs_equal_generate_scores_and_a_step_moves_every_part(family, loaded):
    _, _, template, model = loaded[family]
    assert set(PARTS) <= set(template.components), template.components
    prompts = [template.encode_prompt(s) for s in _samples()]
    batch = template.collate(prompts)  # as the rollout engine samples: G=2 rows per prompt from num_return_sequences
    assert (batch["attention_mask"][:, 0] == 0).any()  # one row is left-padded
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, top_k=0, max_new_tokens=6, min_new_tokens=6,
                             num_return_sequences=2, suppress_tokens=template.suppress_token_ids,
                             output_logits=True, return_dict_in_generate=True)
    completion_ids = out.sequences[:, batch["input_ids"].shape[1]:]  # [4, 6]
    assert not torch.isin(completion_ids, torch.tensor(template.suppress_token_ids)).any()
    logits = torch.stack(out.logits, dim=1).float()  # [4, 6, vocab]
    expected = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]  # [4, 6]
    mask = torch.ones_like(completion_ids)

    policy = Policy(model, template)  # shared prefix asked for, the generic path runs naive
    assert not policy.shared_prefix and "shared_prefix" in policy.naive_reason
    forward_batch = policy.forward_batch(prompts, [2, 2])  # each prompt and its images repeated, then collated
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
    torch.testing.assert_close(logps, expected, atol=1e-4, rtol=0)

    # a GRPO-like step: every part gets gradient, and an optimizer step moves it
    model.train()
    before = {part: [p.detach().clone() for p in policy.component(part).parameters()] for part in PARTS}
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=1e-2)
    logps, _ = policy.completion_logprobs(forward_batch, completion_ids, mask)
    (-(logps * torch.tensor([[1.0], [-1.0], [0.5], [-0.5]])).sum()).backward()  # advantages [4, 1]
    optimizer.step()
    for part in PARTS:
        after = list(policy.component(part).parameters())
        assert any(not torch.equal(a, b) for a, b in zip(after, before[part])), f"{family}: {part} did not move"
    model.eval()  # (no later test reads this model's weights)


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_mmgrpo_eval_runs(family, root, tmp_path):
    folder = build_generic(family, root)
    main(["eval", "--model", str(folder), "--model_type", "auto", "--dataset", "shapes-color:test", "--limit", "2",
          "--max_completion_length", "4", "--output_dir", str(tmp_path / "eval")])
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["counts"]["all"] == 2 and set(result["metrics"]) == {"answer_format", "vqa_accuracy"}


def test_train_changes_the_weights_and_its_checkpoint_infers_auto(root, tmp_path, caplog):
    folder = build_generic("idefics3", root)
    reward = tmp_path / "distinct.py"  # varies across a group, so advantages are not zero
    reward.write_text("def distinct(completions, **columns):\n    return [float(len(set(c))) for c in completions]\n")
    out = tmp_path / "run"
    main(["train", "--model", str(folder), "--model_type", "auto", "--dataset", "shapes-color", "--max_steps", "1",
          "--num_generations", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "6",
          "--beta", "0", "--weight_decay", "0", "--learning_rate", "1e-2", "--dataloader_num_workers", "0",
          "--reward_funcs", f"{reward}:distinct", "--output_dir", str(out)])
    from safetensors.torch import load_file

    start, trained = load_file(folder / "model.safetensors"), load_file(out / "checkpoint-1" / "model.safetensors")
    moved = {name for name in start if not torch.equal(start[name], trained[name])}
    assert any(name.startswith("model.text_model.") for name in moved)
    assert any(name.startswith("model.vision_model.") for name in moved)
    with caplog.at_level(logging.WARNING):
        assert infer_model_type(str(out / "checkpoint-1")) == "auto"  # recorded by the run
        assert infer_model_type(str(folder)) == "auto"  # no template declares idefics3: picked, with one line
    assert [r.message for r in caplog.records].count(caplog.records[-1].message) == 1
    assert "idefics3" in caplog.records[-1].message and "--model_type auto" in caplog.records[-1].message


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto_flags(root) -> TrainConfig:
    """`mmgrpo train --model_type auto` flags (parsed once: building the parser reads every field's docstring)."""
    return TrainConfig.from_args(["--model", str(build_generic("llava_next", root)), "--model_type", "auto",
                                  "--reward_funcs", "answer_format", "--eval_dataset", "shapes-color", "--eval_steps", "1"])


@pytest.mark.parametrize(("changes", "named"), [
    ({("data", "dataset"): ["shapes-ground"], ("algo", "reward_funcs"): []}, "--dataset shapes-ground"),
    ({("algo", "reward_funcs"): ["answer_format", "iou"]}, "--reward_funcs"),
    ({("algo", "reward_funcs"): ["shapes-color:giou"]}, "--reward_funcs"),
    ({("eval", "eval_metrics"): ["iou"]}, "--eval_metrics"),
])
def test_boxes_with_auto_are_refused_at_start_up(changes, named, auto_flags):
    check_train_flags(copy.deepcopy(auto_flags))  # no box anywhere: fine
    cfg = copy.deepcopy(auto_flags)
    for (section, field), value in changes.items():
        setattr(getattr(cfg, section), field, value)
    with pytest.raises(ConfigError, match="no box convention") as err:
        check_train_flags(cfg)
    assert str(err.value).startswith(named) and "docs/custom_template.md" in str(err.value)


def test_a_box_read_on_the_generic_path_names_the_way_out(loaded):
    _, _, template, _ = loaded["mistral3"]
    to_pixels = template.box_mapper(template.encode_prompt(_samples()[0]))
    with pytest.raises(ConfigError, match=r"no box convention.*template file"):
        to_pixels([1, 2, 3, 4])


def test_a_video_row_is_a_data_error_naming_the_sample(loaded):
    from mmgrpo.data.sample import Video
    from mmgrpo.errors import DataError

    _, _, template, _ = loaded["idefics3"]
    video = Video(frames=np.zeros((2, 28, 28, 3), dtype=np.uint8), metadata={"fps": 1.0})
    with pytest.raises(DataError, match=r"sample v/0: has video input, but template 'auto' takes only image"):
        template.encode_prompt(LoadedSample("v/0", [{"role": "user", "content": "<video>Hi"}], videos=[video]))


def test_a_processor_without_a_chat_template_is_refused(root):
    folder = build_generic("llava_next", root, chat_template=False)
    with pytest.raises(ConfigError, match="no chat template") as err:
        load_template(str(folder), "auto")
    assert str(folder) in str(err.value) and "chat_template.jinja" in str(err.value)


def test_a_class_neither_path_serves_is_one_line_naming_it(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    with pytest.raises(ConfigError, match="'llama' is not one a template declares nor an image-text-to-text") as err:
        infer_model_type(str(folder))
    assert "qwen2-vl" in str(err.value) and "\n" not in str(err.value)
    from mmgrpo.templates.generic import GenericTemplate

    with pytest.raises(ConfigError, match="LlamaConfig .*not an image-text-to-text model") as err:
        GenericTemplate.model_class(LlamaConfig())
    assert "gemma3" in str(err.value) and "--model_type auto" in str(err.value)


def test_freeze_vit_and_vit_lr_use_the_parts_found(loaded):
    from mmgrpo.config import ModelConfig
    from mmgrpo.models.loading import model_skeleton
    from mmgrpo.models.train_type import freeze
    from mmgrpo.training.optim import group_of

    folder, _, template, _ = loaded["lfm2_vl"]
    skeleton = model_skeleton(str(folder), template)
    freeze(skeleton, template.components, ModelConfig(freeze_vit=True))
    frozen = {name for name, p in skeleton.named_parameters() if not p.requires_grad}
    assert frozen and all(name.startswith("model.vision_tower.") for name in frozen)
    groups = {group_of(name, template.components) for name, _ in skeleton.named_parameters()}  # --vit_lr, --aligner_lr
    assert groups == {"vit", "aligner", "llm"}


def test_pixel_budgets_and_vllm_are_refused(loaded):
    _, processor, template, _ = loaded["llava_next"]
    from mmgrpo.templates import get_template

    with pytest.raises(ConfigError, match="--max_pixels: the generic path"):
        get_template("auto", processor, max_pixels=1000)
    assert "template file" in template.vllm_unsupported()
