"""LoRA and frozen parts, in one process: what trains, the reference model, export --merge_lora.

    .venv/bin/python -m pytest tests/test_lora.py -v
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_worker  # noqa: E402  (the fixed completions and prompts the distributed tests use)


def lora_config(tmp_path, *extra):
    return dist_worker.config("none", 1, tmp_path, "--train_type", "lora", "--lora_rank", "4", "--lora_dropout", "0", *extra)


def logprobs(policy, batch, completion, reference=False):
    with torch.no_grad():
        return policy.completion_logprobs(batch, completion.completion_ids, completion.completion_mask, reference=reference)[0]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run whose adapters are non-zero, a micro-batch and fixed completions for it."""
    run = dist_worker.prepared_run(lora_config(tmp_path_factory.mktemp("lora")), fixed_completions=True)
    generator = torch.Generator().manual_seed(0)
    for name, param in run.model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make the adapters do something
            param.data = torch.randn(param.shape, generator=generator) * 0.05
    from mmgrpo.rollout.base import SamplingParams

    encoded = [enc for _, enc in dist_worker.image_prompts(run.template, 2)]
    batch = run.policy.forward_batch(encoded, [1, 1])
    completion = dist_worker.FixedRollout(run.template, 6).generate(encoded, SamplingParams(num_generations=1, max_new_tokens=6))
    return run, batch, completion


def test_lora_trains_adapters_only(tmp_path):
    from mmgrpo.engine import grpo_step

    run = dist_worker.prepared_run(lora_config(tmp_path, "--freeze_vit"), fixed_completions=True)
    trainable = [name for name, param in run.model.named_parameters() if param.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert not any(".visual.blocks." in name for name in trainable)  # --freeze_vit: no adapters there
    assert any(".visual.merger." in name for name in trainable) and any(".language_model." in name for name in trainable)
    before = {name: param.detach().clone() for name, param in run.model.named_parameters()}
    grpo_step(run, dist_worker.image_prompts(run.template, 2), step=1)
    changed = {name for name, param in run.model.named_parameters() if not torch.equal(param, before[name])}
    assert changed and changed <= set(trainable)
    assert any("lora_B" in name for name in changed)


def test_reference_shares_frozen_weights(tmp_path):
    """Full training with --freeze_vit: the reference holds the policy's own vision tensors, its own
    copy of everything that trains; a step moves the policy and leaves the reference where it started."""
    from mmgrpo.engine import grpo_step

    run = dist_worker.prepared_run(dist_worker.config("none", 1, tmp_path, "--freeze_vit"), fixed_completions=True)
    policy = dict(run.model.named_parameters())
    reference = dict(run.policy.ref_model.named_parameters())
    assert policy.keys() == reference.keys()
    frozen = {name for name, param in policy.items() if not param.requires_grad}
    assert any(".visual.blocks." in name for name in frozen) and all(name.startswith("model.visual.") for name in frozen)
    assert all(reference[name] is policy[name] for name in frozen)
    assert not any(reference[name] is policy[name] or reference[name].data_ptr() == policy[name].data_ptr()
                   for name in policy.keys() - frozen)
    start = {name: param.detach().clone() for name, param in reference.items()}
    grpo_step(run, dist_worker.image_prompts(run.template, 2), step=1)
    assert all(torch.equal(param, start[name]) for name, param in run.policy.ref_model.named_parameters())
    assert any(not torch.equal(policy[name], start[name]) for name in policy.keys() - frozen)
    assert not any(param.requires_grad for param in run.policy.ref_model.parameters())


def test_freeze_flags_in_full_training(tiny_qwen2_vl_path):
    from mmgrpo.config import TrainConfig
    from mmgrpo.models.loading import model_skeleton
    from mmgrpo.models.train_type import freeze
    from mmgrpo.templates.qwen2_vl import Qwen2VLTemplate

    components = Qwen2VLTemplate.components
    model = model_skeleton(tiny_qwen2_vl_path)  # meta device: names and shapes only
    cfg = TrainConfig.from_args(["--freeze_vit", "--freeze_aligner"])
    freeze(model, components, cfg.model)
    grads = {name: param.requires_grad for name, param in model.named_parameters()}
    assert not any(flag for name, flag in grads.items() if name.startswith("model.visual."))
    assert all(flag for name, flag in grads.items() if name.startswith(("model.language_model.", "lm_head")))


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--freeze_vit", "--freeze_aligner", "--freeze_llm"], "leaves no weight to train"),
        (["--train_type", "lora", "--target_modules", "no_such_proj"], "matches no linear layer"),
        (["--train_type", "lora", "--target_modules", "vision", "--freeze_vit"], "contradicts --freeze_vit"),
        (["--train_type", "lora", "--target_modules", "all-linear", "--freeze_vit", "--freeze_aligner", "--freeze_llm"],
         "matches no linear layer"),
        (["--train_type", "qlora"], "--train_type 'qlora'"),
    ],
)
def test_bad_training_choices_fail_before_the_model_loads(tmp_path, monkeypatch, flags, match):
    import mmgrpo.models.train_type
    from mmgrpo.training.build import build_run

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(mmgrpo.models.train_type, "load_model", no_loading)
    cfg = dist_worker.config("none", 1, tmp_path, *flags)
    with pytest.raises(ConfigError, match=match):
        cfg.validate()
        build_run(cfg)


def test_reference_is_the_base_model_with_adapters_off(lora_run, tiny_qwen2_vl_path):
    from mmgrpo.forward.policy import Policy
    from mmgrpo.models.loading import load_model

    run, batch, completion = lora_run
    assert run.policy.ref_model is None  # no second copy of the weights
    base = Policy(load_model(tiny_qwen2_vl_path), run.template, shared_prefix=False)
    base_logps = logprobs(base, batch, completion)
    torch.testing.assert_close(logprobs(run.policy, batch, completion, reference=True), base_logps, atol=1e-6, rtol=0)
    assert (logprobs(run.policy, batch, completion) - base_logps).abs().max() > 1e-3  # the adapters do act


def test_export_merge_lora_loads_and_matches(lora_run, tmp_path):
    from mmgrpo.cli import main
    from mmgrpo.forward.policy import Policy
    from mmgrpo.models.loading import load_model

    run, batch, completion = lora_run
    run.save(tmp_path / "checkpoint-1")
    assert (tmp_path / "checkpoint-1" / "adapter_config.json").is_file()
    main(["export", "--merge_lora", "--model", str(tmp_path / "checkpoint-1"), "--output_dir", str(tmp_path / "merged")])
    merged = load_model(str(tmp_path / "merged"))
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    policy = Policy(merged, run.template, shared_prefix=False)
    torch.testing.assert_close(logprobs(policy, batch, completion), logprobs(run.policy, batch, completion), atol=1e-5, rtol=0)
