"""On-policy distillation (--teacher_model): the teacher's per-token log-probs of the student's own
completions as the reward, log p_teacher - log p_student per token (docs/algorithm.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny_runs import metrics_of, tiny_config

from mmgrpo.engine import train
from mmgrpo.errors import ConfigError


def config(tmp_path, *extra):
    return tiny_config(tmp_path, "--save_strategy", "no", *extra, reward="flat", learning_rate="3e-2", max_steps=None)


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory, tiny_qwen2_vl_path) -> str:
    """The tiny Qwen2-VL with every weight moved: same family and tokenizer, other preferences."""
    from transformers import AutoProcessor

    from mmgrpo.models.loading import load_model

    folder = tmp_path_factory.mktemp("teacher")
    model = load_model(tiny_qwen2_vl_path)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std().clamp(min=0.02))
    model.save_pretrained(folder)
    AutoProcessor.from_pretrained(tiny_qwen2_vl_path).save_pretrained(folder)
    return str(folder)


def test_a_teacher_equal_to_the_student_adds_nothing(tmp_path, tiny_qwen2_vl_path):
    logged = metrics_of(train(config(tmp_path, "--max_steps", "1", "--teacher_model", tiny_qwen2_vl_path)))
    assert logged[0]["distill/reverse_kl"] == 0.0 and logged[0]["loss"] == 0.0  # flat rewards, no gap: no signal
    assert logged[0]["time/teacher"] > 0


def test_each_token_moves_the_way_the_teacher_leans(tmp_path, other_teacher):
    """One GRPO step on fixed completions with flat rewards: the tokens the teacher finds likelier than
    the student did gain log-probability, the ones it finds less likely lose it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dist_worker

    from mmgrpo.engine import grpo_step
    from mmgrpo.rollout.base import SamplingParams

    run = dist_worker.prepared_run(config(tmp_path, "--max_steps", "1", "--teacher_model", other_teacher,
                                          "--learning_rate", "1e-3"), fixed_completions=True)
    prompts = dist_worker.image_prompts(run.template, 2)
    encoded = [enc for _, enc in prompts]
    rollout = run.rollout.generate(encoded, SamplingParams(num_generations=4, max_new_tokens=8))
    forward = run.policy.forward_batch(encoded, [4, 4])

    def logps(**which):
        with torch.no_grad():
            return run.policy.completion_logprobs(forward, rollout.completion_ids, rollout.completion_mask, **which)[0]

    before, teacher = logps(), logps(teacher=True)
    metrics, _ = grpo_step(run, prompts, step=1)
    moved, mask = logps() - before, rollout.completion_mask.bool()
    leans_up, leans_down = mask & (teacher > before), mask & (teacher < before)
    assert metrics["distill/reverse_kl"] == pytest.approx(float((before - teacher)[mask].mean()), abs=1e-5)
    assert leans_up.any() and leans_down.any()
    assert moved[leans_up].mean() > 0 > moved[leans_down].mean()


def test_a_teacher_must_share_the_family_and_the_tokenizer(tmp_path, tiny_qwen2_vl_path):
    from transformers import AutoProcessor

    from mmgrpo.training.build import build_run

    with pytest.raises(ConfigError, match="--teacher_model tiny:qwen2.5-vl is a qwen2.5-vl model and --model tiny:qwen2-vl a qwen2-vl one"):
        build_run(config(tmp_path, "--teacher_model", "tiny:qwen2.5-vl"))
    other = tmp_path / "other-tokenizer"
    processor = AutoProcessor.from_pretrained(tiny_qwen2_vl_path)
    processor.tokenizer.add_tokens(["<an_extra_token>"])
    processor.save_pretrained(other)
    for name in ("config.json", "model.safetensors"):
        (other / name).write_bytes((Path(tiny_qwen2_vl_path) / name).read_bytes())
    with pytest.raises(ConfigError, match=r"has another tokenizer than --model tiny:qwen2-vl \(.* 1 differing\)"):
        build_run(config(tmp_path / "b", "--teacher_model", str(other)))


@pytest.mark.parametrize("flags, match", [
    (("--teacher_server_port", "8001"), "--teacher_server_port 8001 needs --teacher_model"),
    (("--teacher_model", "tiny:qwen2-vl", "--teacher_server_port", "8001", "--temperature", "0.7"),
     "--teacher_server_port with --temperature 0.7: .*use --temperature 1"),
])
def test_a_teacher_server_that_cannot_work_is_one_line(tmp_path, flags, match):
    from mmgrpo.training.startup_checks import check_train_flags

    with pytest.raises(ConfigError, match=match) as error:
        check_train_flags(config(tmp_path, *flags))
    assert "\n" not in str(error.value)
