"""Faults around a run (issue 49, kind 6): a checkpoint file corrupted after its save is found at resume
(sha256 in the manifest) and never trained on; NaN/inf weights or optimizer moments after a resume stop
the run naming the checkpoint; a folder that turns read-only is one line and keeps the last checkpoint;
`mmgrpo eval --output_dir` inside a live run's folder is refused; a second Ctrl-C exits without a traceback."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmgrpo.config import TrainConfig
from mmgrpo.engine import train
from mmgrpo.errors import CheckpointError, ConfigError
from mmgrpo.runstate.checkpoint import MARKER, check_checkpoint, list_checkpoints, save_atomically
from mmgrpo.training.output_dir import preflight
from mmgrpo.training.startup_checks import fill_model_type, fill_precision

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", "answer_format",
       "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "4",
       "--dataloader_num_workers", "0", "--report_to", "none"]


def config(out, *flags):
    return TrainConfig.from_args([*RUN, "--output_dir", str(out), *flags])


def resumed(out, flag):
    """The resumed run's config, resolved as train() resolves it before preflight."""
    cfg = config(out, "--max_steps", "3", "--save_steps", "1", "--resume_from_checkpoint", flag)
    fill_model_type(cfg.model)
    fill_precision(cfg)
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run that saved checkpoint-1 and checkpoint-2 (a real one: weights, optimizer, scheduler, RNG, state)."""
    out = tmp_path_factory.mktemp("faults") / "run"
    train(config(out, "--max_steps", "2", "--save_steps", "1"))
    return out


def _copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only a checksum sees it
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "training_state.json", "rng_state_0.pth",
                                  "step_log.json", "model.safetensors"])
@pytest.mark.parametrize("resume", ["latest", "path"])
def test_a_file_corrupted_since_its_save_is_found_at_resume(trained, tmp_path, name, resume):
    out = _copy(trained, tmp_path)
    target = out / "checkpoint-2"
    if name == "training_state.json":  # still valid JSON, same size: a digit changed
        text = (target / name).read_text()
        (target / name).write_text(text.replace('"step": 2', '"step": 7'))
    else:
        _flip_a_byte(target / name)
    check_checkpoint(target)  # the size check alone sees nothing
    flag = "latest" if resume == "latest" else str(target)
    with pytest.raises(CheckpointError, match=rf"checkpoint {target} is damaged: {name} does not match the checksum "
                                              rf"recorded when it was saved .*; the newest complete one is .*checkpoint-1"):
        preflight(resumed(out, flag))


def test_an_intact_checkpoint_resumes(trained, tmp_path):
    out = _copy(trained, tmp_path)
    plan = preflight(resumed(out, "latest"))
    plan.release()
    assert plan.resume_from == out / "checkpoint-2"
    assert set(json.loads((out / "checkpoint-2" / MARKER).read_text())["sha256"]) >= {"optimizer.pt", "model.safetensors"}


def _without_checksums(folder: Path) -> None:
    """As a checkpoint saved before checksums existed (or by another tool) looks."""
    manifest = json.loads((folder / MARKER).read_text())
    manifest.pop("sha256")
    (folder / MARKER).write_text(json.dumps(manifest))


@pytest.mark.parametrize("where", ["weights", "optimizer moments"])
def test_nonfinite_state_after_a_resume_stops_the_run_naming_the_checkpoint(trained, tmp_path, where):
    out = _copy(trained, tmp_path)
    target = out / "checkpoint-2"
    if where == "weights":
        weights = load_file(str(target / "model.safetensors"))
        name = sorted(weights)[0]
        weights[name].view(-1)[0] = float("nan")
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
        expected = f"first: weight .*{name.split('.')[-2]}"
    else:
        state = torch.load(target / "optimizer.pt", weights_only=True)
        state["state"][0]["exp_avg_sq"].view(-1)[0] = float("inf")
        torch.save(state, target / "optimizer.pt")
        expected = "first: optimizer state exp_avg_sq"
    manifest = json.loads((target / MARKER).read_text())  # sizes as they are now: only the values are wrong
    manifest["files"] = {n: (target / n).stat().st_size for n in manifest["files"]}
    (target / MARKER).write_text(json.dumps(manifest))
    _without_checksums(target)
    with pytest.raises(CheckpointError, match=rf"checkpoint {target} holds NaN/inf \({expected}.*\); training on it"):
        train(config(out, "--max_steps", "3", "--save_steps", "1", "--resume_from_checkpoint", "latest"))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]  # nothing trained, nothing saved


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state_0.pth"])
def test_an_unreadable_state_file_without_checksums_is_one_error_naming_it(trained, tmp_path, name):
    out = _copy(trained, tmp_path)
    target = out / "checkpoint-2"
    (target / name).write_bytes(bytes((target / name).stat().st_size))  # zeros, same size
    _without_checksums(target)
    with pytest.raises(CheckpointError, match=rf"checkpoint {target}: {re.escape(name)} cannot be loaded \(.*\); it is "
                                              "corrupt or from another run"):
        train(config(out, "--max_steps", "3", "--save_steps", "1", "--resume_from_checkpoint", "latest"))


# ---- a folder that turns read-only ----------------------------------------------------------------------

@pytest.fixture
def disk(tmp_path):
    """A small tmpfs this test may remount read-only (root); elsewhere a folder whose write permission goes."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        yield mount, lambda: mount.chmod(0o555)
        mount.chmod(0o755)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount, lambda: subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("background", [False, True])
def test_a_folder_turned_read_only_is_one_line_and_keeps_the_last_checkpoint(disk, background):
    folder, make_read_only = disk
    write = lambda d: (d / "weights.bin").write_bytes(b"w" * 1000)  # noqa: E731
    save_atomically(folder / "checkpoint-1", write).wait()
    make_read_only()
    with pytest.raises(CheckpointError) as raised:
        save_atomically(folder / "checkpoint-2", write, background=background).wait()
    message = str(raised.value)
    assert message.startswith(f"not saving checkpoint-2: {folder} cannot be written any more (")
    assert "checkpoint-1 is kept" in message and "--resume_from_checkpoint latest" in message and "\n" not in message
    assert [p.name for p in list_checkpoints(folder)] == ["checkpoint-1"] and check_checkpoint(folder / "checkpoint-1")


# ---- eval into a live run's folder ----------------------------------------------------------------------

@pytest.mark.parametrize("inside", ["", "eval", "eval/again"])
def test_eval_into_a_live_runs_folder_is_refused_by_its_lock(tmp_path, inside):
    from mmgrpo.eval.evaluate import main as eval_main

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(  # a live run: another process holding the folder's lock
        [sys.executable, "-c", "import sys, time\nfrom mmgrpo.runstate.run_lock import RunLock\n"
         f"RunLock.acquire({str(run)!r}); print('held', flush=True); time.sleep(60)"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        target = run / inside if inside else run
        with pytest.raises(ConfigError, match=rf"--output_dir {target} (is the output folder|is inside {run}, the output "
                                              rf"folder) of a live training run \(pid {holder.pid} on host"):
            eval_main(["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--output_dir", str(target)])
        assert not (run / "eval").exists()
    finally:
        holder.kill()
        holder.wait()


# ---- Ctrl-C twice ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_without_a_traceback(tmp_path):
    """The first Ctrl-C ends the run ("interrupted"); the second lands in the exit's cleanup, here a reward
    module's atexit hook that takes seconds (as a tracker flushing its uploads does)."""
    slow_exit = tmp_path / "slow_exit.py"
    slow_exit.write_text("import atexit, time\natexit.register(time.sleep, 20)\n\n"
                         "def score(completions, **columns):\n    return [0.0] * len(completions)\n")
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "mmgrpo", "train", *RUN, "--reward_funcs", f"{slow_exit}:score", "--max_steps", "500",
         "--save_steps", "1", "--output_dir", str(out)],
        env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list_checkpoints(out) and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        lines = []
        for line in process.stderr:  # until the first Ctrl-C has ended the command
            lines.append(line)
            if line.startswith("mmgrpo train: interrupted"):
                break
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        stderr = "".join(lines) + process.stderr.read()
        process.wait(timeout=15)
    finally:
        process.kill()
    assert time.monotonic() - started < 10  # at once, not after the 20 s hook
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    assert process.returncode == 130
    assert stderr.rstrip().endswith("mmgrpo: interrupted again: stopping at once; the earlier checkpoints are intact "
                                    "(resume with --resume_from_checkpoint latest)"), stderr[-2000:]
    assert list_checkpoints(out)  # the saved ones stay complete


@pytest.mark.slow
def test_a_run_whose_folder_loses_its_write_permission_ends_with_one_line(tmp_path):
    """The run folder's write permission goes during step 2 (a reward does it, on its second call): the run
    ends with one line at step 2's save and checkpoint-1 stays complete. As root, the run is started without
    the capability that overrides permissions (setpriv), so that the permission counts."""
    out = tmp_path / "run"
    plugin = tmp_path / "turns_read_only.py"
    plugin.write_text(f"import os\ncalls = []\n\ndef score(completions, **columns):\n    calls.append(1)\n"
                      f"    if len(calls) == 2:\n        os.chmod({str(out)!r}, 0o555)\n    return [0.0] * len(completions)\n")
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: a folder's permissions do not bind root")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps", "-dac_override,-dac_read_search"]
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-m", "mmgrpo", "train", *RUN, "--reward_funcs", f"{plugin}:score", "--max_steps", "3",
             "--save_steps", "1", "--output_dir", str(out)],
            env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
            capture_output=True, text=True, timeout=300)
    finally:
        out.chmod(0o755)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mmgrpo train: error: not saving checkpoint-2: {out} cannot be written any more ("), last
    assert last.endswith("checkpoint-1 is kept. Make the folder writable again (or copy the run to one that is), then "
                         "resume with --resume_from_checkpoint latest"), last
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"] and check_checkpoint(out / "checkpoint-1")
