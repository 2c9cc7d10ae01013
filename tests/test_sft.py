"""`mmgrpo sft`: evaluations during SFT and the validation target that stops it (--stop_at)."""

import json

import pytest

from mmgrpo.cli import main as cli_main
from mmgrpo.config import SFTConfig
from mmgrpo.errors import ConfigError
from mmgrpo.sft import STOP_FILE, sft

TINY = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--per_device_train_batch_size", "4",
        "--torch_threads", "1", "--report_to", "none", "--dataloader_num_workers", "0"]
EVAL = ["--eval_dataset", "shapes-color:test", "--eval_limit", "4", "--max_completion_length", "8"]


def steps_logged(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft_stops_at_the_first_evaluation_that_reaches_the_target(tmp_path):
    out = tmp_path / "run"
    # an untrained model writes no <answer> tags: answer_format is 0.0 <= 0.0 at the first evaluation (step 2)
    cfg = SFTConfig.from_args([*TINY, *EVAL, "--eval_steps", "2", "--max_steps", "6", "--stop_at", "answer_format<=0.0",
                               "--output_dir", str(out)])
    final = sft(cfg)
    record = json.loads((out / STOP_FILE).read_text())
    assert record["step"] == 2 and record["max_steps"] == 6
    assert record["metrics"]["eval/answer_format"] == 0.0
    assert steps_logged(out) == [1, 2]  # no step after the stop
    assert (final / "model.safetensors").exists() and (out / "eval" / "step-2" / "eval.json").exists()


def test_the_sft_bar_shows_the_loss_and_seconds_per_step_which_the_log_keeps(tmp_path):
    from mmgrpo.runstate.runlog import console

    out = tmp_path / "run"
    cfg = SFTConfig.from_args([*TINY, *EVAL, "--eval_steps", "2", "--max_steps", "2", "--output_dir", str(out)])
    with console.capture() as captured:
        sft(cfg)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(line["time/step"] > 0 for line in lines)
    assert lines[1]["time/step"] >= lines[1]["time/eval"] > 0  # as in GRPO: the evaluation is inside the step
    bar = [line for line in captured.get().splitlines() if line.startswith("SFT")][-1]
    assert f"loss {lines[-1]['loss']:.3f}" in bar and "s/step" in bar and "nan" not in bar and "reward" not in bar


def test_a_target_never_reached_trains_every_step_and_writes_no_stop_record(tmp_path):
    out = tmp_path / "run"
    (out).mkdir()
    (out / STOP_FILE).write_text("{}")  # left by an earlier run: not this run's record
    cfg = SFTConfig.from_args([*TINY, *EVAL, "--eval_steps", "2", "--max_steps", "4", "--stop_at", "vqa_accuracy>=1.5",
                               "--output_dir", str(out), "--overwrite_output_dir"])
    sft(cfg)
    assert not (out / STOP_FILE).exists()
    assert steps_logged(out) == [1, 2, 3, 4]
    evaluated = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in evaluated if "eval/vqa_accuracy" in row] == [2, 4]  # every 2 steps and the last


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--stop_at", "vqa_accuracy>=0.5"], "needs --eval_dataset"),
        ([*EVAL, "--stop_at", "vqa_accuracy>=0.5"], "needs --eval_dataset NAME and --eval_steps"),
        ([*EVAL, "--eval_steps", "2", "--stop_at", "vqa_accuracy=0.5"], "write METRIC>=VALUE"),
        ([*EVAL, "--eval_steps", "2", "--stop_at", "vqa_acc>=0.5"], "'vqa_acc' is not among the eval metrics (answer_format, vqa_accuracy)"),
    ],
)
def test_a_stop_target_that_cannot_work_is_a_startup_error(tmp_path, flags, message):
    cfg = SFTConfig.from_args([*TINY, *flags, "--max_steps", "2", "--output_dir", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sft(cfg)
    assert not (tmp_path / "run" / "final").exists()


def test_sft_help_lists_the_evaluation_and_stop_flags(capsys):
    with pytest.raises(SystemExit):
        cli_main(["sft", "--help"])
    text = capsys.readouterr().out
    assert "--stop_at" in text and "--eval_dataset" in text and "--eval_steps" in text


def test_sample_normalization_weighs_each_answer_alike_whatever_its_length(tmp_path):
    # Count answers are a few tokens, box answers about 27. With learning rate 0 the model never
    # changes, so a run of one sample a step logs each answer's own mean loss, and a run that
    # accumulates the same samples two by two must log each pair's plain mean under `sample`, and
    # under `token` a mean weighted by length, which differs wherever a count meets a box.
    counting = tmp_path / "counting"  # a few steps on counts alone: its count answers then cost far less than its boxes
    start = sft(SFTConfig.from_args([*TINY[:2], "--dataset", "shapes-count", *TINY[4:], "--learning_rate", "1e-2",
                                     "--max_steps", "8", "--output_dir", str(counting)]))
    mixture = ["--model", str(start), "--dataset", "shapes-count", "shapes-ground", "--per_device_train_batch_size", "1",
               "--torch_threads", "1", "--report_to", "none", "--dataloader_num_workers", "0",
               "--learning_rate", "0", "--warmup_ratio", "0", "--seed", "3"]

    def losses(out, *flags):
        sft(SFTConfig.from_args([*mixture, *flags, "--output_dir", str(tmp_path / out)]))
        return [json.loads(line)["loss"] for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    single = losses("single", "--max_steps", "8")
    pair_means = [(a + b) / 2 for a, b in zip(single[::2], single[1::2])]
    pairs = ["--max_steps", "4", "--gradient_accumulation_steps", "2"]
    assert losses("sample", *pairs, "--loss_normalization", "sample") == pytest.approx(pair_means, rel=1e-5)
    by_tokens = losses("token", *pairs, "--loss_normalization", "token")
    assert max(abs(a - b) for a, b in zip(by_tokens, pair_means)) > 0.05
    assert min(single) < max(single) - 1.0  # the pairs did mix cheap count answers with dear boxes


def test_an_unknown_loss_normalization_is_a_startup_error(tmp_path):
    cfg = SFTConfig.from_args([*TINY, "--loss_normalization", "answer", "--output_dir", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match="--loss_normalization 'answer': choose one of token, sample"):
        sft(cfg)
