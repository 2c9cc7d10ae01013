"""The GRPO engine end to end on the tiny Qwen2-VL: files, learning, and bad input."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from mmgrpo.cli import main as cli_main
from mmgrpo.config import TrainConfig
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError
from mmgrpo.models.tiny import resolve_model_path
from mmgrpo.training.startup_checks import check_train_flags

FAST = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--dataloader_num_workers", "0"]

DIGITS_REWARD = '''
def digits(completions, **columns):
    """Share of characters that are digits: a reward a random policy can climb quickly."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

def broken(completions, **columns):
    raise ValueError("boom")
'''


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_cli_leaves_the_run_files(tmp_path):
    out = tmp_path / "run"
    cli_main(["train", *FAST, "--reward_funcs", "vqa_accuracy", "answer_format", "--max_steps", "2",
              "--output_dir", str(out)])
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward", "reward/vqa_accuracy", "reward/answer_format_std", "reward/image", "reward_std",
                "frac_reward_zero_std", "kl", "loss", "entropy", "clip_ratio/region", "completion_length",
                "completion_length_max", "clipped_ratio", "grad_norm", "learning_rate", "time/rollout",
                "time/reward", "time/ref", "time/update", "samples_per_s"):
        assert key in metrics[-1], key
    completions = read_jsonl(out / "completions.jsonl")
    assert len(completions[0]["completions"]) == 4 and set(completions[0]["rewards"]) == {"vqa_accuracy", "answer_format"}
    assert list(out.glob("events.out.tfevents.*"))
    assert "num_generations: 4" in (out / "config.yaml").read_text()
    model = AutoModelForImageTextToText.from_pretrained(out / "checkpoint-2")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_report_to_none_writes_metrics_only(tmp_path):
    from mmgrpo.runstate.runlog import RunLogger

    cfg = TrainConfig.from_args([*FAST, "--report_to", "none", "--output_dir", str(tmp_path)])
    logger = RunLogger(tmp_path, cfg.to_dict(), cfg.report_to)
    logger.log_step({"step": 1, "reward": 0.5}, print_it=False)
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward": 0.5}]
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    with pytest.raises(ConfigError, match="--report_to comet: 'comet' is not one of tensorboard, wandb, mlflow"):
        TrainConfig.from_args([*FAST, "--report_to", "comet"]).validate()


def test_one_step_changes_every_trainable_parameter(tmp_path):
    plugin = tmp_path / "digits.py"
    plugin.write_text(DIGITS_REWARD)  # rewards that differ within a group: non-zero advantages
    cfg = TrainConfig.from_args([*FAST, "--reward_funcs", f"{plugin}:digits", "--max_steps", "1", "--learning_rate", "1e-3",
                                 "--beta", "0", "--output_dir", str(tmp_path / "run")])
    out = train(cfg)
    before = load_file(f"{resolve_model_path('tiny:qwen2-vl')}/model.safetensors")
    after = load_file(str(out / "checkpoint-1" / "model.safetensors"))
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters that did not train: {unchanged}"


@pytest.mark.slow
def test_mean_reward_rises_on_a_learnable_reward(tmp_path):
    plugin = tmp_path / "digits.py"
    plugin.write_text(DIGITS_REWARD)
    cfg = TrainConfig.from_args([*FAST, "--reward_funcs", f"{plugin}:digits", "--max_steps", "30",
                                 "--learning_rate", "1e-2", "--beta", "0", "--per_device_train_batch_size", "32",
                                 "--output_dir", str(tmp_path / "run"), "--seed", "1"])
    out = train(cfg)
    rewards = [m["reward"] for m in read_jsonl(out / "metrics.jsonl")]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.03, rewards  # measured here: 0.216 -> 0.266


def test_second_iteration_uses_old_logprobs(tmp_path):
    plugin = tmp_path / "digits.py"
    plugin.write_text(DIGITS_REWARD)
    cfg = TrainConfig.from_args([*FAST, "--reward_funcs", f"{plugin}:digits", "--max_steps", "1",
                                 "--num_iterations", "2", "--learning_rate", "1e-2", "--output_dir", str(tmp_path / "run")])
    metrics = read_jsonl(train(cfg) / "metrics.jsonl")[0]
    assert "time/old" in metrics
    # ratio_mean averages the two passes: exactly 1 in the first, moved by the update in the second
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-7)


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(args)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_start_up_errors_name_the_flag_before_any_model_loads(tmp_path, capsys):
    err = run_cli(["train", *FAST, "--reward_funcs", "no_such_reward", "--output_dir", str(tmp_path)], capsys)
    assert "no_such_reward" in err and "choose one of: " in err
    err = run_cli(["train", *FAST, "--reward_funcs", "missing.py:fn", "--output_dir", str(tmp_path)], capsys)
    assert "missing.py" in err
    err = run_cli(["train", *FAST, "--num_generations", "3", "--output_dir", str(tmp_path)], capsys)
    assert "--num_generations 3" in err
    err = run_cli(["train", *FAST, "--dataset", "no-such-data", "--output_dir", str(tmp_path)], capsys)
    assert "no-such-data" in err and "shapes-color" in err


def test_a_raising_reward_names_itself_and_the_sample(tmp_path, capsys):
    plugin = tmp_path / "bad.py"
    plugin.write_text(DIGITS_REWARD)
    err = run_cli(["train", *FAST, "--reward_funcs", f"{plugin}:broken", "--max_steps", "1",
                   "--output_dir", str(tmp_path / "run")], capsys)
    assert "broken" in err and "boom" in err and "shapes-color/train/" in err
    # --reward_errors none skips those samples instead
    cli_main(["train", *FAST, "--reward_funcs", f"{plugin}:broken", f"{plugin}:digits", "--max_steps", "1",
              "--reward_errors", "none", "--output_dir", str(tmp_path / "run2")])
    metrics = read_jsonl(tmp_path / "run2" / "metrics.jsonl")[0]
    assert metrics["reward/broken"] is None or math.isnan(metrics["reward/broken"])


def test_a_prompt_over_max_prompt_length_names_the_sample(tmp_path, capsys):
    err = run_cli(["train", *FAST, "--reward_funcs", "vqa_accuracy", "--max_prompt_length", "10", "--max_steps", "1",
                   "--output_dir", str(tmp_path)], capsys)
    assert "shapes-color/train/" in err and "--max_prompt_length 10" in err


def test_advantage_estimator_rloo_is_what_the_step_uses(tmp_path):
    """--advantage_estimator rloo: each completion's advantage is its reward minus the mean of its
    G - 1 siblings' (here without scaling), as completions.jsonl records them."""
    plugin = tmp_path / "digits.py"
    plugin.write_text(DIGITS_REWARD)
    advantages = {}
    for estimator in ("grpo", "rloo"):
        out = tmp_path / estimator
        train(TrainConfig.from_args([*FAST, "--reward_funcs", f"{plugin}:digits", "--max_steps", "1", "--beta", "0",
                                     "--advantage_estimator", estimator, "--scale_rewards", "none",
                                     "--output_dir", str(out)]))
        records = read_jsonl(out / "completions.jsonl")
        advantages[estimator] = [(r["reward"], r["advantage"]) for r in records]
    for estimator, expected in (("grpo", lambda r, i: r[i] - sum(r) / len(r)),
                                ("rloo", lambda r, i: r[i] - (sum(r) - r[i]) / (len(r) - 1))):
        for rewards, got in advantages[estimator]:
            assert got == pytest.approx([expected(rewards, i) for i in range(len(rewards))], abs=1e-6)
    assert any(max(map(abs, a)) > 0 for _, a in advantages["rloo"])  # not all-equal groups


def test_unregistered_names_are_start_up_errors_and_registered_ones_work(tmp_path, capsys):
    from mmgrpo.grpo import losses
    from mmgrpo.grpo.losses import register_loss

    err = run_cli(["train", *FAST, "--advantage_estimator", "nope", "--output_dir", str(tmp_path)], capsys)
    assert "nope" in err and "rloo" in err
    err = run_cli(["train", *FAST, "--loss_type", "nope", "--output_dir", str(tmp_path)], capsys)
    assert "unknown loss type 'nope' (--loss_type)" in err and "dapo" in err
    register_loss("token_sum_for_test")(lambda per_token_loss, mask, **_: (per_token_loss * mask).sum())
    try:  # a loss a plugin registers can be chosen
        check_train_flags(TrainConfig.from_args([*FAST, "--loss_type", "token_sum_for_test"]))
    finally:
        losses.LOSSES.unregister("token_sum_for_test")


def test_every_second_of_a_step_has_a_phase(tmp_path):
    plugin = tmp_path / "digits.py"
    plugin.write_text(DIGITS_REWARD)
    out = train(TrainConfig.from_args([*FAST, "--reward_funcs", f"{plugin}:digits", "--max_steps", "3",
                                       "--save_steps", "2", "--output_dir", str(tmp_path / "run")]))
    for metrics in read_jsonl(out / "metrics.jsonl"):
        phases = {k: v for k, v in metrics.items() if k.startswith("time/") and k != "time/step"}
        assert {"time/data", "time/rollout", "time/reward", "time/plan", "time/ref", "time/adv", "time/update",
                "time/save", "time/other"} <= phases.keys()
        assert sum(phases.values()) == pytest.approx(metrics["time/step"], rel=1e-6)
        assert phases["time/other"] < 0.5 * metrics["time/step"], phases  # most of a step is in a named phase


def test_a_skipped_step_still_advances_the_schedule(tmp_path):
    """A NaN loss skips the update (counted) but the learning-rate schedule moves on with the steps."""
    plugin = tmp_path / "nan.py"
    plugin.write_text("def nan_on_first(completions, **columns):\n"
                      "    import math\n    return [float(i) for i in range(len(completions))]\n")
    from mmgrpo.grpo import advantages as advantages_module

    estimator = advantages_module.get_advantage("grpo")
    calls = []

    def nan_first_step(rewards, *args, **kwargs):
        adv, stats = estimator(rewards, *args, **kwargs)
        calls.append(1)
        return (adv * float("nan"), stats) if len(calls) == 1 else (adv, stats)

    advantages_module.register_advantage("nan_first_for_test")(nan_first_step)
    try:
        out = train(TrainConfig.from_args([*FAST, "--reward_funcs", f"{plugin}:nan_on_first", "--max_steps", "3",
                                           "--lr_scheduler_type", "cosine", "--learning_rate", "1e-3",
                                           "--advantage_estimator", "nan_first_for_test",
                                           "--output_dir", str(tmp_path / "run")]))
    finally:
        advantages_module.ADVANTAGES.unregister("nan_first_for_test")
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["skipped"] for m in metrics] == [1, 0, 0] and metrics[-1]["nonfinite_steps"] == 1
    rates = [m["learning_rate"] for m in metrics]
    assert rates[0] > rates[1] > rates[2]  # step 2 uses the rate of step 2, not of step 1


def test_sft_help_lists_only_what_sft_uses(capsys):
    with pytest.raises(SystemExit):
        cli_main(["sft", "--help"])
    text = capsys.readouterr().out
    assert "--learning_rate" in text and "--per_device_train_batch_size" in text and "--max_pixels" in text
    for grpo_only in ("--beta", "--num_generations", "--reward_funcs", "--parallel"):
        assert grpo_only not in text, grpo_only


def test_fixed_length_rollouts_without_checkpoints(tmp_path, capsys):
    """--suppress_eos: every completion runs to --max_completion_length (benchmarks); --save_strategy
    no: no checkpoint; cpu/step_s is logged beside time/step."""
    plugin = tmp_path / "digits.py"
    plugin.write_text(DIGITS_REWARD)
    out = train(TrainConfig.from_args([*FAST, "--reward_funcs", f"{plugin}:digits", "--max_steps", "2", "--suppress_eos",
                                       "--save_strategy", "no", "--output_dir", str(tmp_path / "run")]))
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["completion_length"] == 8 and m["clipped_ratio"] == 1.0 for m in metrics)
    assert all(0 < m["cpu/step_s"] for m in metrics)
    assert not list(out.glob("checkpoint-*"))
    err = run_cli(["train", *FAST, "--save_strategy", "no", "--save_steps", "5", "--output_dir", str(tmp_path / "x")], capsys)
    assert "--save_steps 5 with --save_strategy no" in err
    err = run_cli(["train", *FAST, "--save_strategy", "epoch", "--output_dir", str(tmp_path / "x")], capsys)
    assert "--save_strategy 'epoch'" in err


def test_suppress_eos_reaches_every_engine(tiny_qwen2_vl_path):
    """--suppress_eos in each engine's terms: the in-process samplers suppress EOS with the
    placeholders; vLLM requests get EOS in their logit bias (never drawn, so never a stop)."""
    from mmgrpo.models.loading import load_processor
    from mmgrpo.rollout.base import SamplingParams
    from mmgrpo.rollout.vllm_requests import sampling_options
    from mmgrpo.templates import get_template

    template = get_template("qwen2-vl", load_processor(tiny_qwen2_vl_path))
    fixed = SamplingParams(num_generations=2, max_new_tokens=4, suppress_eos=True)
    assert fixed.suppressed(template.suppress_token_ids, template.eos_token_ids) == [
        *template.suppress_token_ids, *template.eos_token_ids]
    assert SamplingParams(2, 4).suppressed([1], [2]) == [1]
    bias = sampling_options(fixed, template)["logit_bias"]
    assert set(template.eos_token_ids) | set(template.suppress_token_ids) <= set(bias)
    assert not set(template.eos_token_ids) & set(sampling_options(SamplingParams(2, 4), template)["logit_bias"])
