"""Start-up refusals for the newer families, each one line before any weights load:

- GLM-V (`separate_media_batches`): a training set whose datasets hold images and videos;
- LoRA where peft 0.21 moves the targets onto fused MoE experts (tiny:glm4v-moe) with --lora_dropout
  above 0 (peft's adapter on a fused parameter takes no dropout); the other MoE families take LoRA
  with the default flags;
- the generic path (--model_type auto): --freeze_aligner / --aligner_lr where no aligner was found;
- --routing_replay / --router_aux_loss_coef on a router the replay does not drive (GLM-4.5V's
  sigmoid grouped router, Gemma 4's router module), while Qwen3.5-MoE and Qwen3-Omni replay exactly.
"""

import copy
import logging

import pytest
import torch

from mmgrpo.config import ModelConfig, OptimConfig, TrainConfig
from mmgrpo.data.catalog import DatasetView, MixedDataset
from mmgrpo.data.sample import LoadedSample
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.forward.policy import Policy
from mmgrpo.forward.routing_replay import Routing, RoutingRecorder, moe_routers
from mmgrpo.fusion.attach import check_fusion_model
from mmgrpo.models.loading import load_model, load_template, model_skeleton
from mmgrpo.models.tiny import build_tiny
from mmgrpo.models.train_type import apply_train_type, check_trainable, load_trainable_model
from mmgrpo.rollout.base import completion_mask_from_ids
from mmgrpo.training.build import check_modalities
from mmgrpo.training.startup_checks import check_train_flags


def _view(name: str, kind: str) -> DatasetView:
    rows = [{"query": f"<{kind}>What is it?", f"{kind}s": [f"{name}-{i}.mp4" if kind == "video" else f"{name}-{i}.png"],
             "solution": "a"} for i in range(3)]
    return DatasetView(name, "train", rows)


def test_glm_refuses_images_beside_videos_at_start_up():
    _, _, glm = load_template("tiny:glm4v", "glm4v")
    _, _, qwen = load_template("tiny:qwen2-vl", "qwen2-vl")
    mixture = MixedDataset([_view("pics", "image"), _view("clips", "video")], [1.0, 1.0])
    with pytest.raises(DataError) as err:
        check_modalities(mixture, glm)
    message = str(err.value)
    assert "'pics' has images (sample pics/train/0)" in message and "'clips' has videos (sample clips/train/0)" in message
    assert "separate runs" in message and "\n" not in message
    check_modalities(mixture, qwen)  # a family whose forward takes both: the same mixture is fine
    check_modalities(_view("clips", "video"), glm)  # one modality: fine
    check_modalities(MixedDataset([_view("pics", "image"), _view("more", "image")], [1.0, 1.0]), glm)


def test_lora_on_glm4v_moe_with_dropout_is_one_line_before_the_weights_load(caplog):
    path, _, template = load_template("tiny:glm4v-moe", "glm4v-moe")
    lora = ModelConfig(model="tiny:glm4v-moe", train_type="lora")  # --lora_dropout 0.05 by default
    with pytest.raises(ConfigError) as err:  # no strategy: the check must come before the weights load
        load_trainable_model(lora, OptimConfig(), str(path), template, strategy=None, seed=0)
    message = str(err.value)
    assert message.startswith("--lora_dropout 0.05: peft moves") and "--lora_dropout 0" in message
    assert "gate_up_proj" in message and "\n" not in message
    skeleton = model_skeleton(str(path), template)
    attention = ModelConfig(model="tiny:glm4v-moe", train_type="lora", target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    check_trainable(attention, skeleton, template.components)  # what the error suggests passes
    with caplog.at_level(logging.WARNING, logger="mmgrpo.models"):
        check_trainable(ModelConfig(model="tiny:glm4v-moe", train_type="lora", lora_dropout=0.0), skeleton,
                        template.components)
    assert "get no adapter" in caplog.text  # with dropout 0 it runs, and says which layers peft left out


@pytest.mark.parametrize("family", ["qwen3-vl-moe", "qwen3-omni", "qwen3.5-moe", "gemma4"])
def test_lora_with_default_flags_on_the_other_moe_families(family):
    path, _, template = load_template(f"tiny:{family}", family)
    lora = ModelConfig(model=f"tiny:{family}", train_type="lora")
    check_trainable(lora, model_skeleton(str(path), template), template.components)
    model, peft_model = apply_train_type(load_model(str(path), template=template), template.components, lora)
    assert peft_model is not None and any("lora_A" in name for name, _ in model.named_parameters())


def test_generic_path_refuses_freezing_or_pricing_a_part_it_did_not_find():
    path, _, template = load_template(str(build_tiny("qwen2-vl")), "auto")  # Qwen's merger sits inside its tower
    assert "aligner" not in template.components and template.components["vision"] == "model.visual"
    skeleton = model_skeleton(str(path), template)
    with pytest.raises(ConfigError) as err:
        check_trainable(ModelConfig(freeze_aligner=True), skeleton, template.components)
    assert str(err.value).startswith("--freeze_aligner: this model has no aligner")
    assert "vision = model.visual, llm = model.language_model" in str(err.value)
    check_trainable(ModelConfig(freeze_vit=True), skeleton, template.components)  # the part found: fine
    with pytest.raises(ConfigError, match="^--aligner_lr: .*drop --aligner_lr"):
        check_fusion_model(ModelConfig(), OptimConfig(aligner_lr=1e-5), skeleton, template, str(path))


@pytest.mark.parametrize("family", ["glm4v-moe", "gemma4"])
@pytest.mark.parametrize("flags", [["--routing_replay", "rollout"], ["--router_aux_loss_coef", "0.001"]])
def test_routing_flags_name_the_router_that_is_not_supported(family, flags):
    cfg = TrainConfig.from_args(["--model", f"tiny:{family}", *flags])
    with pytest.raises(ConfigError) as err:
        check_train_flags(cfg)
    message = str(err.value)
    assert message.startswith(flags[0]) and f"tiny:{family}'s router is not supported by routing replay" in message
    assert "dense" not in message and "\n" not in message


TEXTS = ["Hi.", "Tell me a long story about a red square and a blue circle.", "What?"]


@pytest.mark.parametrize("family", ["qwen3.5-moe", "qwen3-omni"])
def test_routing_replay_makes_the_trainers_logps_the_samplers(family):
    """Top-1 routing, the sampler's routers perturbed: the trainer's own routes differ, the replayed
    ones give the sampler's log-probs (as tests/test_routing_replay.py shows for Qwen3-VL-MoE)."""
    check_train_flags(TrainConfig.from_args(["--model", f"tiny:{family}", "--routing_replay", "rollout"]))
    path, _, template = load_template(f"tiny:{family}", family)
    model = load_model(str(path), template=template)
    for router in moe_routers(model):
        router.top_k = 1
    sampler = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(sampler):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * 0.05 * router.weight.std())
    prompts = [template.encode_prompt(LoadedSample(id=f"rr/{i}", messages=[{"role": "user", "content": text}]))
               for i, text in enumerate(TEXTS)]
    batch = template.collate(prompts)
    torch.manual_seed(0)
    with torch.no_grad(), RoutingRecorder(sampler) as recorder:
        out = sampler.generate(**batch, max_new_tokens=24, do_sample=True, suppress_tokens=template.suppress_token_ids,
                               output_logits=True, return_dict_in_generate=True, eos_token_id=template.eos_token_ids,
                               pad_token_id=template.completion_pad_id)
    ids = out.sequences[:, batch["input_ids"].shape[1]:]  # [R, T]
    mask, _ = completion_mask_from_ids(ids, template.eos_token_ids)
    sampler_logps = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, ids[..., None])[..., 0] * mask
    routed = recorder.per_row(batch["attention_mask"], mask.sum(1))
    policy = Policy(model, template, per_row_routing=True)
    results = {}
    for replay in (False, True):
        routing = Routing(routed, replay=replay)
        with torch.no_grad():
            logps, _ = policy.completion_logprobs(policy.forward_batch(prompts, [1] * len(prompts)), ids, mask,
                                                  routing=routing)
        results[replay] = logps, routing
    assert results[False][1].mismatched > 0  # the trainer's own routers send some tokens elsewhere
    torch.testing.assert_close(results[True][0], sampler_logps, atol=1e-5, rtol=0)
