"""Sequence parallelism (mmgrpo/parallel/sequence.py: Ulysses): a row split across N real ranks
(torchrun, gloo) gives the log-probs and, summed over the group, the gradients of one process.

Each launch runs tests/sp_worker.py: every rank computes the one-process reference itself, then
the split forward and backward, and reports the largest differences. Rows: a video prompt and a
two-image prompt (mRoPE positions computed on the whole row, then split), G = 3 completions each,
left-padded prompts and right-padded completions; the decoders: Qwen2.5-VL, Qwen3-VL (deepstack
features follow their tokens to the slice that holds them) and Qwen3.5 (Gated DeltaNet layers
exchange heads for tokens as attention does).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.parallel.sequence import row_mask

ROOT = Path(__file__).resolve().parents[1]


def _launch(family: str, ranks: int, out: Path) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "tests/sp_worker.py", family, str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.distributed
@pytest.mark.parametrize("family, ranks", [("qwen2.5-vl", 2), ("qwen2.5-vl", 4), ("qwen3-vl", 2), ("qwen3.5", 2)])
def test_split_rows_score_and_train_as_one_process(family, ranks, tmp_path):
    results = _launch(family, ranks, tmp_path)
    slices = [result["slice"] for result in results]
    length = results[0]["row_length"]
    assert slices == [[r * length // ranks, (r + 1) * length // ranks] for r in range(ranks)]  # contiguous, whole row
    for rank, result in enumerate(results):
        assert result["logps"] < 1e-5, (rank, result["logps"])
        assert not result["missing"]  # every parameter the one-process backward reaches, the group's does
        worst = max(result["grads"], key=result["grads"].get)
        assert result["grads"][worst] < 1e-5, (rank, worst, result["grads"][worst])


@pytest.mark.distributed
def test_heads_the_group_cannot_split_are_refused(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               "tests/sp_worker.py", "qwen3.5", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--sequence_parallel_size 4 does not divide the decoder's 2 heads (linear_num_key_heads)" in done.stderr


def test_row_mask():
    """Causal over the padded row, padded keys hidden, and a query with no key sees itself."""
    mask = row_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]), 4)[:, 0]
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0]]
    assert mask[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
