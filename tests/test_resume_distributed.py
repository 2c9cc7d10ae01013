"""Exact resume under FSDP2 and ZeRO-3 on 2 real ranks (torchrun, gloo): a run whose process group
is killed with SIGKILL (a pre-empted node: torchrun and both ranks at once) after its first
checkpoint, then resumed from `latest`, logs the uninterrupted run's metrics.jsonl step for step.
The checkpoint holds each rank's RNG file and the optimizer state as shards: FSDP2's in
torch.distributed.checkpoint's format, ZeRO-3's in DeepSpeed's own."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmgrpo.runstate.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
VARYING = ("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s")
REWARD = "def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n"

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


SHARDS = {"fsdp2": "optimizer/.metadata", "zero3": "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"}


def start(tmp_path, out, parallel, *extra):
    (tmp_path / "reward.py").write_text(REWARD)
    flags = ["--parallel", parallel, "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
             "--reward_funcs", f"{tmp_path / 'reward.py'}:length", "--num_generations", "4", "--per_device_train_batch_size", "4",
             "--max_completion_length", "8", "--max_steps", "6", "--save_steps", "2", "--learning_rate", "1e-3",
             "--beta", "0.04", "--dataloader_num_workers", "0", "--output_dir", str(out), *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))  # DeepSpeed's compiled op, cached
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mmgrpo", "train", *flags]
    # its own session: the kill reaches torchrun and both ranks, as a pre-empted node's would
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process):
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]


def metrics(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VARYING)} for row in rows]


@pytest.mark.parametrize("parallel", list(SHARDS))
def test_killed_and_resumed_logs_the_uninterrupted_run(tmp_path, parallel):
    finish(start(tmp_path, tmp_path / "whole", parallel))
    expected = metrics(tmp_path / "whole")
    assert [row["step"] for row in expected] == list(range(1, 7))
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoint.iterdir()}
    assert (checkpoint / SHARDS[parallel]).is_file()  # the optimizer's shards

    out = tmp_path / "run"
    process = start(tmp_path, out, parallel)
    while latest_checkpoint(out) is None:
        assert process.poll() is None, process.stderr.read()[-3000:]
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)  # right after checkpoint-2: step 3 is under way
    process.wait()
    assert latest_checkpoint(out).name in ("checkpoint-2", "checkpoint-4")
    finish(start(tmp_path, out, parallel, "--resume_from_checkpoint", "latest"))
    assert metrics(out) == expected
