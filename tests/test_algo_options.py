"""--delta (dual clip), --entropy_coeff, HF learning-rate schedules by name, and dr_grpo's --scale_rewards notice."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgrpo.config import OptimConfig, TrainConfig
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError
from mmgrpo.grpo.losses import LossConfig, policy_loss
from mmgrpo.models.tiny import resolve_model_path
from mmgrpo.training.optim import make_scheduler
from mmgrpo.training.startup_checks import check_train_flags

FAST = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--dataloader_num_workers", "0",
        "--report_to", "none"]


def _loss(ratios, advantages, delta):
    """One token per completion, log(old) = 0: ratio = exp(logp)."""
    logps = torch.tensor(ratios).log()[:, None].requires_grad_(True)  # [N, 1]
    loss, metrics = policy_loss(logps, torch.zeros_like(logps), None, torch.tensor(advantages), torch.ones_like(logps),
                                LossConfig(loss_type="dapo", epsilon=0.2, epsilon_high=0.2, delta=delta))
    loss.backward()
    return float(loss.detach()), logps.grad[:, 0].tolist(), metrics


def test_delta_caps_the_ratio_for_negative_advantages_only():
    # ratios 5, 2, 5 with advantages -1, -1, +1; dapo: token mean over 3 tokens
    # without delta: -min(5*-1, 1.2*-1) = 5;  -min(2*-1, 1.2*-1) = 2;  -min(5, 1.2) = -1.2  -> (5 + 2 - 1.2) / 3
    loss, grads, _ = _loss([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], None)
    assert loss == pytest.approx((5 + 2 - 1.2) / 3)
    assert grads[0] == pytest.approx(5 / 3)  # d(ratio * 1)/dlogp = ratio, / 3 tokens
    # delta 3: the first token's loss is capped at 3 and has no gradient; the ratio 2 < delta is untouched
    loss, grads, metrics = _loss([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], 3.0)
    assert loss == pytest.approx((3 + 2 - 1.2) / 3)
    assert grads == pytest.approx([0.0, 2 / 3, 0.0])
    assert float(metrics["clip_ratio/low"]) == pytest.approx(1 / 3)


def test_delta_flag_is_checked_at_start_up():
    with pytest.raises(ConfigError, match="--delta 1.1"):
        check_train_flags(TrainConfig.from_args([*FAST, "--delta", "1.1"]))
    with pytest.raises(ConfigError, match="cispo"):
        check_train_flags(TrainConfig.from_args([*FAST, "--delta", "3", "--loss_type", "cispo"]))
    check_train_flags(TrainConfig.from_args([*FAST, "--delta", "3"]))


def _rates(name, total=10, warmup_ratio=0.0, kwargs=None):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = make_scheduler(OptimConfig(lr_scheduler_type=name, warmup_ratio=warmup_ratio, lr_scheduler_kwargs=kwargs), opt, total)
    rates = []
    for _ in range(total):
        rates.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return rates


def test_schedules_have_hfs_behaviour():
    assert _rates("constant", warmup_ratio=0.2) == [1.0] * 10  # HF's constant has no warm-up
    assert _rates("constant_with_warmup", warmup_ratio=0.2)[:3] == [0.0, 0.5, 1.0]
    assert _rates("linear") == pytest.approx([1 - s / 10 for s in range(10)])
    cosine = _rates("cosine")
    assert cosine == pytest.approx([0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(10)])
    floor = _rates("cosine_with_min_lr", kwargs='{"min_lr_rate": 0.2}')
    assert floor == pytest.approx([0.2 + 0.8 * c for c in cosine])
    stable_then_decay = _rates("warmup_stable_decay", kwargs='{"num_decay_steps": 4, "min_lr_ratio": 0.1}')
    assert stable_then_decay[:7] == [1.0] * 7
    assert stable_then_decay[7:] == pytest.approx([0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in (1, 2, 3)])


def test_warmup_stable_decay_asks_for_its_decay_length():
    with pytest.raises(ConfigError, match="num_decay_steps"):
        _rates("warmup_stable_decay")


def test_the_default_schedule_keeps_the_old_cosine_to_ten_percent():
    assert TrainConfig().optim.lr_scheduler_type == "cosine_with_min_lr"
    assert _rates("cosine_with_min_lr") == pytest.approx(
        [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(10)])


def test_bad_schedule_names_and_options_are_start_up_errors():
    with pytest.raises(ConfigError, match="choose one of linear, cosine"):
        check_train_flags(TrainConfig.from_args([*FAST, "--lr_scheduler_type", "cosine_to_zero"]))
    with pytest.raises(ConfigError, match="min_lr_rate is not an option of 'linear'"):
        check_train_flags(TrainConfig.from_args([*FAST, "--lr_scheduler_type", "linear", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}']))
    with pytest.raises(ConfigError, match="not valid JSON"):
        check_train_flags(TrainConfig.from_args([*FAST, "--lr_scheduler_kwargs", "min_lr_rate=0.1"]))


def test_dr_grpo_without_scale_rewards_none_is_said():
    with pytest.warns(UserWarning, match="--scale_rewards none"):
        check_train_flags(TrainConfig.from_args([*FAST, "--loss_type", "dr_grpo"]))


def test_training_runs_with_delta_and_a_linear_schedule(tmp_path):
    plugin = tmp_path / "digits.py"
    plugin.write_text("def digits(completions, **columns):\n    return [sum(c.isdigit() for c in s) / max(1, len(s)) for s in completions]\n")
    out = train(TrainConfig.from_args([
        *FAST, "--reward_funcs", f"{plugin}:digits", "--max_steps", "3", "--delta", "2.0", "--num_iterations", "2",
        "--lr_scheduler_type", "linear", "--learning_rate", "1e-3", "--output_dir", str(tmp_path / "run")]))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["learning_rate"] for m in metrics] == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3])
    assert all(math.isfinite(m["loss"]) for m in metrics)


def _weights(folder):
    return load_file(str(next(folder.glob("*.safetensors"))))


@pytest.mark.parametrize("coeff", [0.0, 0.5])
def test_entropy_coeff_is_the_only_gradient_when_every_group_is_equal(coeff, tmp_path):
    # A constant reward: every advantage is 0, so the clipped surrogate is exactly 0 and (beta 0) there is no KL.
    # What trains is the bonus alone: loss = -coeff x the mean entropy of the update's tokens, which is logged.
    plugin = tmp_path / "same.py"
    plugin.write_text("def same(completions, **columns):\n    return [1.0] * len(completions)\n")
    out = train(TrainConfig.from_args([
        *FAST, "--reward_funcs", f"{plugin}:same", "--max_steps", "1", "--beta", "0", "--entropy_coeff", str(coeff),
        "--learning_rate", "1e-2", "--save_steps", "1", "--output_dir", str(tmp_path / "run")]))
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["entropy"] > 1.0  # a random tiny model: nearly uniform over its vocabulary
    assert metrics["loss"] == pytest.approx(-coeff * metrics["entropy"], rel=1e-4, abs=1e-7)
    before = _weights(Path(resolve_model_path("tiny:qwen2-vl")))
    after = _weights(out / "checkpoint-1")
    changed = [name for name, value in after.items() if name in before and not torch.equal(value, before[name])]
    assert bool(changed) == (coeff > 0)


def test_entropy_coeff_is_checked_at_start_up():
    for bad in ("-0.1", "nan", "inf"):
        with pytest.raises(ConfigError, match="--entropy_coeff"):
            check_train_flags(TrainConfig.from_args([*FAST, "--entropy_coeff", bad]))
    check_train_flags(TrainConfig.from_args([*FAST, "--entropy_coeff", "0.01"]))
