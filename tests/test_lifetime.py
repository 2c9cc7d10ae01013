"""DataLoader workers end when their trainer dies, however it dies: a real trainer-like process with
two workers busy on slow samples is killed with SIGKILL, and its workers are gone within seconds
(torch's own check would see it only after the sample in hand, 20 s later)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TRAINER = '''
import sys, threading, time
from mmgrpo.data.prompt_batches import cycle, make_prompt_loader
from mmgrpo.data.sample import Sample

class Slow:
    """Sample 0 and 1 are quick; later ones take seconds each (a long video decode)."""
    name = "slow"
    def __len__(self):
        return 64
    def __getitem__(self, index):
        if index > 1:
            time.sleep(20)
        return Sample(id=f"slow/train/{index}", messages=[{"role": "user", "content": "hi"}])

def main():
    loader = make_prompt_loader(Slow(), batch_size=1, num_workers=2, seed=0, shuffle=False)
    batches = cycle(loader)
    next(batches)
    print(" ".join(str(w.pid) for w in loader._iterator._workers), flush=True)
    time.sleep(600)

if sys.argv[1] == "main":
    main()
else:  # the loader first iterated from a helper thread: the kernel signal is not used, the watcher is
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
'''


def alive(pid: int) -> bool:
    """Running (a zombie has freed its memory and waits only to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_workers_die_with_a_sigkilled_trainer(tmp_path, started_from):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    trainer = subprocess.Popen([sys.executable, str(script), started_from], stdout=subprocess.PIPE, text=True, env=env)
    workers = []
    try:
        workers = [int(pid) for pid in trainer.stdout.readline().split()]
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        time.sleep(0.5)  # both workers are now inside a 20 s sample
        kill_and_expect_workers_gone(trainer, workers)
    finally:
        trainer.kill()
        kill_all(workers)


def kill_and_expect_workers_gone(trainer, workers: list[int]) -> None:
    """SIGKILL the trainer; its workers must be gone within 3 s."""
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(10)
    deadline = time.monotonic() + 3.0
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers), "workers outlived their trainer"


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_sigkilled_mmgrpo_train(tmp_path):
    """The real trainer: `mmgrpo train` with two DataLoader workers, killed with SIGKILL mid-run."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "mmgrpo", "train", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", "format",
         "--num_generations", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "4", "--max_steps", "200",
         "--dataloader_num_workers", "2", "--output_dir", str(out)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    workers = []
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert trainer.poll() is None and time.monotonic() < deadline, "the run ended or did not start"
            time.sleep(0.1)
        workers = children(trainer.pid)
        assert len(workers) >= 2 and all(alive(pid) for pid in workers)
        kill_and_expect_workers_gone(trainer, workers)
    finally:
        trainer.kill()
        kill_all(workers)


QUICK_TRAINER = '''
import sys
from mmgrpo.data.prompt_batches import cycle, make_prompt_loader
from mmgrpo.data.sample import Sample

class Quick:
    name = "quick"
    def __len__(self):
        return 64
    def __getitem__(self, index):
        return Sample(id=f"quick/train/{index}", messages=[{"role": "user", "content": "hi"}])

loader = make_prompt_loader(Quick(), batch_size=1, num_workers=2, seed=0, shuffle=False)
batches = cycle(loader)
next(batches)
print(" ".join(str(w.pid) for w in loader._iterator._workers), flush=True)
sys.stdin.readline()
next(batches)  # the workers still serve
print("served", flush=True)
'''  # then the interpreter exits without closing the loader: multiprocessing terminates its workers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_ignore_a_schedulers_stop_signals_and_still_end_with_their_trainer(tmp_path):
    """A SIGTERM / SIGUSR1 to every process of a job (as Slurm sends it) is the trainer's to handle
    (it saves first: mmgrpo/runstate/preemption.py): its workers ignore one from anyone else, and
    still end when the trainer's own shutdown terminates them (its exit does not wait forever)."""
    script = tmp_path / "trainer.py"
    script.write_text(QUICK_TRAINER)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    trainer = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    workers = []
    try:
        workers = [int(pid) for pid in trainer.stdout.readline().split()]
        for pid in workers:
            os.kill(pid, signal.SIGTERM)  # from this process: not their trainer
            os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        assert all(alive(pid) for pid in workers)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline().strip() == "served"
        assert trainer.wait(30) == 0
        deadline = time.monotonic() + 3.0
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in workers)
    finally:
        trainer.kill()
        kill_all(workers)
