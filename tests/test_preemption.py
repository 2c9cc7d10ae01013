"""A checkpoint on pre-emption (mmgrpo/runstate/preemption.py): SIGTERM or SIGUSR1 to a run's whole
process group (trainer and DataLoader workers, as Slurm sends it) during a step or during a save
finishes the step, saves it, and exits 75 with one line saying how to resume; resuming gives the
uninterrupted run's metrics.jsonl exactly. A second signal during that save exits at once (143)
and leaves the earlier checkpoints whole. Under torchrun the SIGTERM sent to torchrun reaches both
ranks, which agree on the step and save it together. Real processes, real signals."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmgrpo.runstate.checkpoint import check_checkpoint, list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
VARYING = ("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s")
REWARD = "def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))

pytestmark = pytest.mark.slow


def flags(folder, out, steps=8):
    (folder / "reward.py").write_text(REWARD)
    return ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", f"{folder / 'reward.py'}:length",
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
            "--max_steps", str(steps), "--learning_rate", "1e-3", "--beta", "0.04", "--report_to", "none",
            "--output_dir", str(out), "--eval_dataset", "shapes-color:test", "--eval_steps", "3", "--eval_limit", "4"]


def start(folder, out, *extra, workers=2):
    """`mmgrpo train` in a session of its own: a signal to its process group reaches the DataLoader workers too."""
    command = [sys.executable, "-m", "mmgrpo", "train", *flags(folder, out), "--dataloader_num_workers", str(workers), *extra]
    return subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process, code=0):
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == code, stderr[-3000:]
    return stderr


def steps_logged(out):
    path = out / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}")) if path.exists() else 0


def metrics(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VARYING)} for row in rows]


def wait_for(process, ready):
    while not ready():
        assert process.poll() is None, process.stderr.read()[-3000:]
        time.sleep(0.001)


def resume_line(out, step, name="SIGTERM"):
    return (f"mmgrpo train: stopped by {name} after step {step}: {out}/checkpoint-{step} is saved; to continue, run the "
            "same command with --resume_from_checkpoint latest")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole")
    finish(start(folder, folder / "run"))
    expected = metrics(folder / "run")
    assert [row["step"] for row in expected] == list(range(1, 9)) and any("eval/answer_format" in r for r in expected)
    return expected


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_mid_step_saves_that_step_and_the_resumed_run_is_the_uninterrupted_one(tmp_path, uninterrupted, name):
    out = tmp_path / "run"
    process = start(tmp_path, out)
    wait_for(process, lambda: steps_logged(out) >= 2)
    time.sleep(random.Random(name).uniform(0, 0.5))  # somewhere in step 3 (rollout, update or evaluation)
    os.killpg(process.pid, getattr(signal, name))
    stderr = finish(process, code=75)
    step = steps_logged(out)
    assert 3 <= step < 8
    assert f"mmgrpo: {name} received: finishing the step in progress, then saving a checkpoint" in stderr
    assert stderr.strip().splitlines()[-1] == resume_line(out, step, name)
    assert [p.name for p in list_checkpoints(out)] == [f"checkpoint-{step}"]  # a complete one, nothing else saved
    if name == "SIGTERM":  # the resume is the same code after either signal: checked once
        finish(start(tmp_path, out, "--resume_from_checkpoint", "latest"))
        assert metrics(out) == uninterrupted


def test_a_signal_during_a_save_lets_it_finish_and_saves_the_next_step(tmp_path, uninterrupted):
    out = tmp_path / "run"
    process = start(tmp_path, out, "--save_steps", "2")
    wait_for(process, lambda: any(p.name.endswith(".tmp") for p in out.iterdir()) if out.exists() else False)
    os.killpg(process.pid, signal.SIGTERM)  # while checkpoint-2 is being written
    stderr = finish(process, code=75)
    step = steps_logged(out)
    assert stderr.strip().splitlines()[-1] == resume_line(out, step)
    assert f"checkpoint-{step}" in [p.name for p in list_checkpoints(out)] and "checkpoint-2" in [p.name for p in list_checkpoints(out)]
    finish(start(tmp_path, out, "--resume_from_checkpoint", "latest", "--save_steps", "2"))
    assert metrics(out) == uninterrupted


def test_a_second_signal_during_the_stop_save_exits_at_once_and_keeps_the_earlier_checkpoints(tmp_path, uninterrupted):
    out = tmp_path / "run"
    process = start(tmp_path, out, "--save_steps", "4", workers=0)
    wait_for(process, lambda: steps_logged(out) >= 5)  # checkpoint-4 is written
    os.killpg(process.pid, signal.SIGTERM)
    wait_for(process, lambda: any(p.name.endswith(".tmp") for p in out.iterdir()))  # the stop's save, under way
    os.killpg(process.pid, signal.SIGTERM)
    stderr = finish(process, code=128 + signal.SIGTERM)
    assert stderr.strip().splitlines()[-1] == ("mmgrpo: SIGTERM again: stopping at once; the earlier checkpoints are intact "
                                               "(resume with --resume_from_checkpoint latest)")
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-4"] and check_checkpoint(out / "checkpoint-4")
    assert not (out / ".mmgrpo-run.lock").exists()
    finish(start(tmp_path, out, "--resume_from_checkpoint", "latest", "--save_steps", "4", workers=0))
    assert metrics(out) == uninterrupted


@pytest.mark.distributed
def test_under_torchrun_every_rank_saves_the_same_step_and_the_resume_is_exact(tmp_path):
    def torchrun(out, *extra):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mmgrpo",
                   "train", *flags(tmp_path, out, steps=6), "--parallel", "fsdp2", "--per_device_train_batch_size", "4",
                   "--dataloader_num_workers", "0", *extra]
        return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    finish(torchrun(tmp_path / "whole"))
    expected = metrics(tmp_path / "whole")
    assert any("eval/answer_format" in row for row in expected)  # both ranks evaluated, rank 0 wrote the results
    out = tmp_path / "run"
    process = torchrun(out)
    wait_for(process, lambda: steps_logged(out) >= 2)
    process.send_signal(signal.SIGTERM)  # to torchrun alone: it passes it on to both ranks
    stderr = process.communicate(timeout=900)[1]
    assert process.returncode != 0, stderr[-3000:]  # torchrun reports the stop as a failure of its own
    step = steps_logged(out)
    assert [p.name for p in list_checkpoints(out)] == [f"checkpoint-{step}"], stderr[-3000:]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (out / f"checkpoint-{step}").iterdir()}
    lines = [line for line in stderr.splitlines() if line.startswith("mmgrpo train: ")]
    assert lines == ["mmgrpo train: rank 0 of 2: " + resume_line(out, step).removeprefix("mmgrpo train: ")], stderr[-3000:]
    finish(torchrun(out, "--resume_from_checkpoint", "latest"))
    assert metrics(out) == expected


def test_a_signal_to_an_asynchronous_run_saves_its_rollouts_in_flight_and_the_resume_is_exact(tmp_path):
    """--max_staleness 2: the stop's checkpoint holds the completions already asked for the next two
    steps (sampled on earlier weights, which no checkpoint holds); the resumed run trains on them as
    the uninterrupted run does."""
    asynchronous = ("--max_staleness", "2")
    finish(start(tmp_path, tmp_path / "whole", *asynchronous, workers=0))
    expected = metrics(tmp_path / "whole")
    assert [row["rollout/staleness"] for row in expected][:4] == [0, 1, 2, 2]
    out = tmp_path / "run"
    process = start(tmp_path, out, *asynchronous, workers=0)
    wait_for(process, lambda: steps_logged(out) >= 2)
    os.killpg(process.pid, signal.SIGTERM)
    stderr = finish(process, code=75)
    step = steps_logged(out)
    assert 3 <= step < 8 and stderr.strip().splitlines()[-1] == resume_line(out, step)
    checkpoint = out / f"checkpoint-{step}"
    assert json.loads((checkpoint / "training_state.json").read_text())["rollout_in_flight"] == min(2, 8 - step)
    assert (checkpoint / "rollouts_in_flight_0.pt").is_file()
    finish(start(tmp_path, out, *asynchronous, "--resume_from_checkpoint", "latest", workers=0))
    assert metrics(out) == expected
