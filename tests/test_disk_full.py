"""A full disk (mmgrpo/runstate/disk_space.py): on a small tmpfs, a run is warned at start-up that its
checkpoints will not fit, and the save that fills the disk ends the run with one line naming the
folder, the bytes the checkpoint needs and the checkpoints kept; the earlier checkpoint stays
complete and no partial save is left. Skipped where a tmpfs cannot be mounted (it needs root)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mmgrpo.runstate.checkpoint import check_checkpoint, list_checkpoints

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs: one checkpoint of the tiny Qwen2-VL (about 11 MB) fits, two do not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here to make a small tmpfs")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (it needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoint(small_disk):
    out = small_disk / "run"
    completed = subprocess.run(
        [sys.executable, "-m", "mmgrpo", "train", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
         "--reward_funcs", "answer_format", "--num_generations", "2", "--per_device_train_batch_size", "4",
         "--max_completion_length", "4", "--max_steps", "3", "--save_steps", "1", "--save_total_limit", "1",
         "--dataloader_num_workers", "0", "--report_to", "none", "--output_dir", str(out)],
        env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=900)
    assert completed.returncode == 2, completed.stderr[-3000:]
    assert "Traceback" not in completed.stderr
    warning = [line for line in completed.stderr.splitlines() if line.startswith("mmgrpo: warning:")]
    assert re.fullmatch(rf"mmgrpo: warning: {out} has 1\d\.\d MB free; this run's checkpoints need about 2\d\.\d MB "
                        r"\(1\d\.\d MB each x \(1 kept \+ 1 being written\)\): .*", warning[0]), warning
    last = completed.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"mmgrpo train: error: not saving checkpoint-2: the disk of {out} is full \(.* free; this "
                        r"checkpoint needs about 1\d,\d{3},\d{3} bytes, 1\d\.\d MB\); the partial save was removed, "
                        r"checkpoint-1 is kept\. Free space or give an --output_dir on a larger disk, then resume with "
                        r"--resume_from_checkpoint latest", last), last
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"] and check_checkpoint(out / "checkpoint-1")
    assert not [p for p in out.iterdir() if p.name.endswith((".tmp", ".old"))]
