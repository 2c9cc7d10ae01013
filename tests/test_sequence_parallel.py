"""Sequence parallelism (mmgrpo/forward/sequence_parallel.py: Ulysses): a row split across N real ranks
(torchrun, gloo) gives the log-probs and, summed over the group, the gradients of one process.

Each launch runs tests/sp_worker.py: every rank computes the one-process reference itself, then
the split forward and backward, and reports the largest differences. Rows: a video prompt and a
two-image prompt (mRoPE positions computed on the whole row, then split), G = 3 completions each,
left-padded prompts and right-padded completions; the decoders: Qwen2.5-VL, Qwen3-VL (deepstack
features follow their tokens to the slice that holds them) and Qwen3.5 (Gated DeltaNet layers
exchange heads for tokens as attention does). Each rank's vision tower encodes its run of the rows'
images and frames, about 1/N of them (the tower's gradients are checked like the rest). Each batch runs
split twice: every row whole (the naive forward), and each prompt once for its G rows (the shared
prefix: the prompts split, their K/V and linear-attention states kept per rank for its heads); once
under gradient checkpointing, whose backward recomputes each layer after the split forward returned.
Gemma 4 (sliding-window layers, with a 16-token window here so that it binds; image blocks that attend
both ways, taken from the masks the model builds for the whole row; KV-shared layers; per-layer inputs
split with the tokens) runs the same checks, and so does InternVL; its tower and Gemma 4's are split
by tiles, images or frames (each encoded alone: Gemma 3's too, checked by hand); and GLM-4.1V on two
clips (its tower, like Qwen's, split by frames).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.forward.sequence_parallel import row_mask

ROOT = Path(__file__).resolve().parents[1]


def _launch(family: str, ranks: int, out: Path, checkpointing: bool) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "tests/sp_worker.py", family, str(out), *(["checkpointing"] if checkpointing else [])]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.distributed
@pytest.mark.parametrize("family, ranks, checkpointing", [("qwen2.5-vl", 2, False), ("qwen2.5-vl", 4, False),
                                                         ("qwen3-vl", 2, False), ("qwen3.5", 2, False), ("qwen3.5", 2, True),
                                                         ("gemma4", 2, False), ("internvl", 2, False),
                                                         ("glm4v", 2, False)])
def test_split_rows_score_and_train_as_one_process(family, ranks, checkpointing, tmp_path):
    results = _launch(family, ranks, tmp_path, checkpointing)
    # Gemma 4's gradients reach 700 on the tiny model: the same rounding is a larger share of them
    tolerance = 5e-5 if family == "gemma4" else 1e-5
    for case, masked in (("padded", True), ("unpadded", False)):  # the whole row's mask, or causal attention alone
        slices = [result[case]["slice"] for result in results]
        length = results[0][case]["row_length"]
        assert slices == [[r * length // ranks, (r + 1) * length // ranks] for r in range(ranks)]  # contiguous, whole row
        assert all(result[case]["masked"] == masked for result in results), case
        for forward in ("naive", "shared"):  # each row's prompt in it, or each prompt once for its G rows
            patches, total = [r[case][forward]["tower_patches"] for r in results], results[0][case][forward]["all_patches"]
            # each rank's tower encodes its run of the images and frames (G copies of each when naive), the runs all
            # of them (cut at frame boundaries: the prompts alone may split unevenly, or with fewer frames than ranks
            # be encoded whole on every rank; InternVL's and the Gemmas': tiles, images and frames)
            assert (sum(patches) == total and max(patches) < total) or set(patches) == {total}, (case, forward, patches)
            assert forward == "shared" or max(patches) < total * 0.75, (case, forward, patches, total)
            for rank, result in enumerate(r[case][forward] for r in results):
                assert result["logps"] < 1e-5, (case, forward, rank, result["logps"])
                assert not result["missing"]  # every parameter the one-process backward reaches, the group's does
                worst = max(result["grads"], key=result["grads"].get)
                assert result["grads"][worst] < tolerance, (case, forward, rank, worst, result["grads"][worst])


@pytest.mark.distributed
def test_heads_the_group_cannot_split_are_refused(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               "tests/sp_worker.py", "qwen3.5", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--sequence_parallel_size 4 does not divide the decoder's 2 heads (linear_num_key_heads): give a divisor" in done.stderr


def test_row_mask():
    """Causal over the padded row, padded keys hidden, and a query with no key sees itself."""
    mask = row_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]), 4)[:, 0]
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0]]
    assert mask[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]


TRAIN = ["train", "--model", "tiny:qwen2.5-vl", "--dataset", "shapes-color", "--num_generations", "4",
         "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--beta", "0.04",
         "--learning_rate", "1e-3", "--dataloader_num_workers", "0", "--report_to", "none", "--seed", "3"]  # fmt: skip
COMPARED = ("loss", "reward", "grad_norm", "kl", "completion_length")


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
def test_a_run_split_over_two_ranks_trains_as_one_process(tmp_path):
    """`--parallel fsdp2 --sequence_parallel_size 2` on 2 ranks (one sequence group, one data rank): the
    ranks read the same prompts, train on the leader's rollout, split every row; the loss is scaled for
    FSDP2's average, so the run logs what one process logs, step for step."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    plugin = tmp_path / "varied.py"  # the tiny model's completions differ in their text, not their length
    plugin.write_text("def varied(completions, **columns):\n    return [sum(map(ord, c)) % 7 / 6 for c in completions]\n")
    train = [*TRAIN, "--reward_funcs", f"{plugin}:varied", "--max_steps", "2"]
    # both share each prompt's prefix: the split run's forwards split it (and the completions), its rollout does not
    single = subprocess.run([sys.executable, "-m", "mmgrpo", *train, "--output_dir", str(tmp_path / "one")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    split = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "mmgrpo", *train, "--parallel", "fsdp2", "--sequence_parallel_size", "2",
                            "--ddp_timeout", "120", "--output_dir", str(tmp_path / "split")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert split.returncode == 0, split.stdout[-2000:] + split.stderr[-4000:]
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "split")
    assert [row["step"] for row in two] == [1, 2]
    assert all(row["grad_norm"] > 0 for row in one) and one[1]["kl"] > 0  # the steps learn: the check can fail
    for a, b in zip(one, two):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
def test_sequence_groups_inside_fsdp2_train_as_fsdp2_alone(tmp_path):
    """SP 2 x FSDP2 2 (4 ranks: two sequence groups, each a data rank) against FSDP2 on 2 ranks: each
    group reads its data rank's prompts and samples with its seeds, splits its rows over its two
    ranks, and FSDP2 shards and averages over all four; the run logs what FSDP2 alone logs."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    plugin = tmp_path / "varied.py"
    plugin.write_text("def varied(completions, **columns):\n    return [sum(map(ord, c)) % 7 / 6 for c in completions]\n")
    train = [*TRAIN, "--reward_funcs", f"{plugin}:varied", "--max_steps", "2", "--parallel", "fsdp2", "--ddp_timeout", "120"]

    def launch(ranks: int, out: str, *flags: str):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               str(ranks), "-m", "mmgrpo", *train, *flags, "--output_dir", str(tmp_path / out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return _metrics(tmp_path / out)

    fsdp = launch(2, "fsdp2")  # its forwards share the prompt prefix whole, the split ones split it
    both = launch(4, "sp_x_fsdp2", "--sequence_parallel_size", "2")
    assert [row["step"] for row in both] == [1, 2]
    assert all(row["grad_norm"] > 0 for row in fsdp) and fsdp[1]["kl"] > 0  # the steps learn: the check can fail
    for a, b in zip(fsdp, both):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])


def test_flags_that_cannot_split_are_named(monkeypatch):
    from mmgrpo.config import TrainConfig
    from mmgrpo.errors import ConfigError
    from mmgrpo.training.startup_checks import check_train_flags

    def check(world: int, *flags):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        check_train_flags(TrainConfig.from_args(["--num_generations", "4", "--per_device_train_batch_size", "4", *flags]))

    with pytest.raises(ConfigError, match="--sequence_parallel_size 2 does not divide the world size 3"):
        check(3, "--parallel", "fsdp2", "--sequence_parallel_size", "2")
    with pytest.raises(ConfigError, match="--sequence_parallel_size 2 does not divide the world size 1"):
        check(1, "--sequence_parallel_size", "2")
    with pytest.raises(ConfigError, match=r"--sequence_parallel_size 2 runs with --parallel fsdp2 \(not zero3\)"):
        check(2, "--parallel", "zero3", "--sequence_parallel_size", "2")
    with pytest.raises(ConfigError, match="does not run with --max_staleness"):
        check(2, "--parallel", "fsdp2", "--sequence_parallel_size", "2", "--max_staleness", "1")
    with pytest.raises(ConfigError, match="does not run with --routing_replay"):
        check(2, "--parallel", "fsdp2", "--sequence_parallel_size", "2", "--router_aux_loss_coef", "0.01",
              "--model", "tiny:qwen3-vl-moe")
    check(4, "--parallel", "fsdp2", "--sequence_parallel_size", "2")  # 2 data ranks x 2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
def test_a_split_run_resumed_from_its_checkpoint_logs_the_uninterrupted_run(tmp_path):
    """Four steps straight on 2 ranks with --sequence_parallel_size 2, and the same run restarted from its
    checkpoint-2 (what a kill after that save leaves): the same metrics, step for step."""
    import shutil

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    plugin = tmp_path / "varied.py"
    plugin.write_text("def varied(completions, **columns):\n    return [sum(map(ord, c)) % 7 / 6 for c in completions]\n")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mmgrpo",
           *TRAIN, "--reward_funcs", f"{plugin}:varied", "--parallel", "fsdp2", "--sequence_parallel_size", "2",
           "--save_steps", "2", "--max_steps", "4", "--ddp_timeout", "120"]  # fmt: skip
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    done = subprocess.run([*run, "--output_dir", str(whole)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    lines = (whole / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= 2))
    done = subprocess.run([*run, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    expected, got = _metrics(whole), _metrics(resumed)
    assert [row["step"] for row in got] == [1, 2, 3, 4]
    for a, b in zip(expected[2:], got[2:]):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
