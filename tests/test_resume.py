"""Exact resume: a 12-step run killed with SIGKILL at random moments (during a step, during a save)
and resumed from the latest checkpoint writes the metrics.jsonl of an uninterrupted run, step for
step (fp32, one process, DataLoader workers, two epochs, a reference model, evaluation with a best
checkpoint; asynchronous with --max_staleness 2, whose two rollouts in flight at a save are kept;
and with the options whose state lives between steps: --dynamic_modality_weights over a two-dataset
mixture, two-stage generation and dynamic sampling, which draw extra prompts). Runs `mmgrpo train`."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmgrpo.data.catalog import resolve_dataset
from mmgrpo.runstate.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
VARYING = ("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s")  # wall-clock figures differ run to run
REWARD = "def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """12 prompts (6 steps of 2 per epoch: the run crosses an epoch) and a reward that varies."""
    folder = tmp_path_factory.mktemp("inputs")
    for name, source in (("prompts", resolve_dataset("shapes-color")), ("counts", resolve_dataset("shapes-count"))):
        with open(folder / f"{name}.jsonl", "w") as f:
            for row in source.rows.select(range(12)):
                row["images"] = [str(Path(source.media_root) / image) for image in row["images"]]
                f.write(json.dumps(row) + "\n")
    (folder / "reward.py").write_text(REWARD)
    return folder


def flags(inputs, out):
    return ["--model", "tiny:qwen2-vl", "--dataset", str(inputs / "prompts.jsonl"), "--reward_funcs", f"{inputs / 'reward.py'}:length",
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
            "--max_steps", "12", "--save_steps", "2", "--save_total_limit", "3", "--learning_rate", "1e-3", "--beta", "0.04",
            "--dataloader_num_workers", "2", "--eval_dataset", "shapes-color:test", "--eval_steps", "3", "--eval_limit", "4",
            "--metric_for_best_model", "answer_format", "--output_dir", str(out)]


def start(inputs, out, *extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if "--dynamic_modality_weights" in extra:  # a mixture of two datasets, weighted by dataset
        extra = (*extra, "--dataset", str(inputs / "prompts.jsonl"), str(inputs / "counts.jsonl"))
    return subprocess.Popen([sys.executable, "-m", "mmgrpo", "train", *flags(inputs, out), *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(process):
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]


def steps_logged(out):
    path = out / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}")) if path.exists() else 0


def kill_when(process, ready, rng, max_delay, still=lambda: True):
    """SIGKILL `process` a random 0..max_delay s after ready() holds; False if it ended first.

    The process is frozen (SIGSTOP) before the kill and `still()` asked again: where the moment has
    passed in between (a save renamed its staging folder), it runs on and the next moment is taken."""
    while True:
        while not ready():
            if process.poll() is not None:
                return False
            time.sleep(0.002)
        time.sleep(rng.uniform(0, max_delay))
        if process.poll() is not None:
            return False
        process.send_signal(signal.SIGSTOP)
        if still():
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        process.send_signal(signal.SIGCONT)
        while ready() and process.poll() is None:  # let the moment that passed end before waiting for the next
            time.sleep(0.002)


def metrics(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VARYING)} for row in rows]


MODES = {
    "foreground": [], "background": ["--save_in_background"], "async": ["--max_staleness", "2"],
    "resampling": ["--dynamic_modality_weights", "--dynamic_weights_by", "dataset", "--first_stage_generations", "2",
                   "--dynamic_sample", "--max_resample_times", "1"],
}


@pytest.fixture(scope="module")
def uninterrupted(inputs, tmp_path_factory):
    """The uninterrupted run's metrics, per mode (computed once each)."""
    runs = {}

    def of(mode):
        kind = "foreground" if mode == "background" else mode  # where a save is written does not change the run
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{kind}")
            finish(start(inputs, out, *MODES[kind]))
            runs[kind] = metrics(out)
        return runs[kind]

    return of


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_killed_and_resumed_runs_log_the_uninterrupted_run(inputs, uninterrupted, tmp_path, mode):
    rng = random.Random(1234 + len(mode))
    out = tmp_path / "run"
    expected = uninterrupted(mode)
    assert [row["step"] for row in expected] == list(range(1, 13))
    assert any("eval/answer_format" in row for row in expected)
    if mode == "resampling":  # the weights moved away from 1 (their moving averages are run state)
        assert len({round(row["weights/counts"], 6) for row in expected}) > 2

    # 1. killed at a random moment after the first checkpoint: during a step, an eval or a save
    process = start(inputs, out, *MODES[mode])
    assert kill_when(process, lambda: latest_checkpoint(out) is not None, rng, max_delay=1.5)
    # 2. resumed, then killed while it writes a checkpoint (a staging folder exists)
    process = start(inputs, out, "--resume_from_checkpoint", "latest", *MODES[mode])
    first = steps_logged(out) if (out / "metrics.jsonl").exists() else 0
    saving = lambda: any(p.name.endswith(".tmp") for p in out.iterdir())  # noqa: E731
    killed_in_save = kill_when(process, lambda: steps_logged(out) > first and saving(), rng, max_delay=0.0, still=saving)
    if killed_in_save:
        assert saving()  # the kill did land inside a save
    # 3. resumed to the end
    finish(start(inputs, out, "--resume_from_checkpoint", "latest", *MODES[mode]))

    assert metrics(out) == expected
    best = json.loads((out / "checkpoint-best" / "best.json").read_text())
    assert best["step"] in (3, 6, 9, 12)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-12", "checkpoint-8", "checkpoint-best"]
    assert killed_in_save or mode == "background"  # a foreground save of the tiny model is long enough to be caught


@pytest.mark.slow
def test_a_kill_between_a_save_and_its_log_line_loses_no_line(inputs, tmp_path):
    """The loop logs step N after checkpoint-N is written; killed in between, the resumed run gets
    step N's lines from the checkpoint (completions of the step written before its metrics line too)."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    finish(start(inputs, whole, "--max_steps", "4"))
    # the folder as such a kill leaves it: checkpoint-2 complete, the logs at step 1, step 2's
    # completions half written, nothing later
    killed.mkdir()
    shutil.copytree(whole / "checkpoint-2", killed / "checkpoint-2")
    assert (killed / "checkpoint-2" / "step_log.json").is_file()
    lines = {name: (whole / name).read_text().splitlines(keepends=True) for name in ("metrics.jsonl", "completions.jsonl")}
    step_of = lambda line: json.loads(line)["step"]  # noqa: E731
    (killed / "metrics.jsonl").write_text("".join(line for line in lines["metrics.jsonl"] if step_of(line) == 1))
    partial = [line for line in lines["completions.jsonl"] if step_of(line) <= 2][:-1]
    (killed / "completions.jsonl").write_text("".join(partial) + partial[-1][:10])  # and a torn line
    finish(start(inputs, killed, "--max_steps", "4", "--resume_from_checkpoint", "latest"))

    assert metrics(killed) == metrics(whole)
    assert [step_of(line) for line in (killed / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert (killed / "completions.jsonl").read_text() == "".join(lines["completions.jsonl"])
