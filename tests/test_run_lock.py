"""One run per output folder (mmgrpo/runstate/run_lock.py): while a run is alive, a second
`mmgrpo train` on its folder is refused with one line naming the first run's pid and host, whatever
its flags (`--overwrite_output_dir` deletes nothing, `--resume_from_checkpoint latest` writes
nothing); a lock left by a killed run is taken over with one line. Real processes throughout."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mmgrpo.errors import ConfigError
from mmgrpo.runstate.checkpoint import latest_checkpoint
from mmgrpo.runstate.run_lock import LOCK_FILE, RunLock, read_holder

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
HOLD = textwrap.dedent("""
    import os, signal, sys, time
    from mmgrpo.runstate.run_lock import RunLock
    RunLock.acquire(sys.argv[1])
    print("held", flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)  # no release, no atexit: the file stays
    time.sleep(600)
""")


def holder(folder, mode="hold"):
    """A process that takes the folder's lock and then holds it (or is killed at once)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), mode], env=ENV, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def snapshot(folder):
    """Every file under `folder` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_live_lock_refuses_and_a_dead_ones_is_taken_over(tmp_path, capfd):
    live = holder(tmp_path)
    try:
        with pytest.raises(ConfigError) as raised:
            RunLock.acquire(tmp_path)
        assert str(raised.value) == (
            f"--output_dir {tmp_path} is in use by another run (pid {live.pid} on host {socket.gethostname()}, started "
            f"{read_holder(tmp_path)['started']}): wait for it to end or stop it, or give another --output_dir")
    finally:
        live.kill()
        live.wait()
    # the kernel dropped the killed holder's lock; its file still says who it was
    started = read_holder(tmp_path)["started"]
    assert read_holder(tmp_path)["pid"] == live.pid
    lock = RunLock.acquire(tmp_path)
    assert capfd.readouterr().err.strip() == (
        f"mmgrpo: {tmp_path}: the run that held it (pid {live.pid} on host {socket.gethostname()}, started {started}) "
        "is gone; taking over its lock")
    assert read_holder(tmp_path)["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_left_by_a_killed_process_is_stale(tmp_path, capfd):
    dead = holder(tmp_path, "die")
    dead.wait()
    assert dead.returncode == -signal.SIGKILL and (tmp_path / LOCK_FILE).is_file()
    started = read_holder(tmp_path)["started"]
    lock = RunLock.acquire(tmp_path)
    assert capfd.readouterr().err.strip() == (
        f"mmgrpo: {tmp_path}: the run that held it (pid {dead.pid} on host {socket.gethostname()}, started {started}) is gone; "
        "taking over its lock")
    lock.release()


def train(out, *flags):
    return subprocess.Popen(
        [sys.executable, "-m", "mmgrpo", "train", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
         "--reward_funcs", "format", "--num_generations", "2", "--per_device_train_batch_size", "4",
         "--max_completion_length", "4", "--max_steps", "500", "--save_steps", "1", "--save_total_limit", "2",
         "--dataloader_num_workers", "0", "--report_to", "none", "--output_dir", str(out), *flags],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_folder_is_refused_with_any_flags(tmp_path):
    out = tmp_path / "run"
    first = train(out)
    try:
        while latest_checkpoint(out) is None:
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # frozen: its folder must stay exactly as it is
        before = snapshot(out)
        for flags in ([], ["--overwrite_output_dir"], ["--resume_from_checkpoint", "latest"]):
            second = subprocess.run([sys.executable, "-m", "mmgrpo", "train", "--model", "tiny:qwen2-vl", "--output_dir",
                                     str(out), *flags],
                                    env=ENV, capture_output=True, text=True, timeout=300)
            assert second.returncode == 2, second.stderr[-2000:]
            assert second.stderr.strip() == (
                f"mmgrpo train: error: --output_dir {out} is in use by another run (pid {first.pid} on host "
                f"{socket.gethostname()}, started {read_holder(out)['started']}): wait for it to end or stop it, or give "
                "another --output_dir"), flags
            assert snapshot(out) == before, flags  # nothing deleted, repaired, trimmed or written
        first.send_signal(signal.SIGCONT)
        steps = latest_checkpoint(out).name
        while latest_checkpoint(out).name == steps:  # the first run goes on
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait()
