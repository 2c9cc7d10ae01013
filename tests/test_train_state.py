"""A training checkpoint restores weights, optimizer, schedule and every RNG exactly: the step after
a reload is bit-for-bit the step the original run takes; per-rank RNG files with real ranks."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmgrpo.errors import CheckpointError
from mmgrpo.runstate.state import TrainState, capture_rng, restore_rng
from mmgrpo.training.resume import (
    CheckpointContents,
    cpu_copy,
    load_training_checkpoint,
    rng_file,
    save_training_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]


def draws():
    return random.random(), float(np.random.rand()), np.random.randint(1 << 30), torch.rand(3).tolist(), torch.randint(9, (2,)).tolist()


def test_rng_state_survives_a_file_and_a_reseed(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # a cached gaussian inside numpy's state
    torch.save(capture_rng(), tmp_path / "rng.pth")
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(torch.load(tmp_path / "rng.pth", weights_only=True))
    assert draws() == expected


def build(path):
    from mmgrpo.models.loading import load_model, load_processor

    torch.manual_seed(0)
    model = load_model(path).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    return model, load_processor(path), optimizer, scheduler


def train_step(model, optimizer, scheduler):
    """A step that draws from every RNG (dropout-free model: the draws go into the inputs)."""
    ids = torch.randint(5, 200, (2, 12)) + int(np.random.randint(3)) + random.randrange(3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return loss.item()


def save(path, model, processor, optimizer, scheduler, step, **kwargs):
    state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    contents = CheckpointContents(model=model, processor=processor, state_dict=state_dict, optimizer=optimizer,
                                  scheduler=scheduler)
    return save_training_checkpoint(path, contents, TrainState(step=step, nonfinite_steps=1, best_metric=0.25,
                                                               data={"epoch": 0, "batch": step}), **kwargs)


def test_a_reloaded_run_takes_the_same_next_steps_bit_for_bit(tmp_path, tiny_qwen2_vl_path):
    model, processor, optimizer, scheduler = build(tiny_qwen2_vl_path)
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    save(tmp_path / "checkpoint-2", model, processor, optimizer, scheduler, step=2).wait()
    expected_losses = [train_step(model, optimizer, scheduler) for _ in range(2)]

    fresh, _, fresh_optimizer, fresh_scheduler = build(tiny_qwen2_vl_path)  # as a resumed run builds it
    state = load_training_checkpoint(tmp_path / "checkpoint-2", model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler)
    assert (state.step, state.nonfinite_steps, state.best_metric, state.data) == (2, 1, 0.25, {"epoch": 0, "batch": 2})
    assert [train_step(fresh, fresh_optimizer, fresh_scheduler) for _ in range(2)] == expected_losses
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_a_background_save_holds_the_weights_of_the_moment_it_was_called(tmp_path, tiny_qwen2_vl_path):
    from safetensors.torch import load_file

    model, processor, optimizer, scheduler = build(tiny_qwen2_vl_path)
    save(tmp_path / "reference", model, processor, optimizer, scheduler, step=0).wait()
    pending = save(tmp_path / "checkpoint-0", model, processor, optimizer, scheduler, step=0, background=True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # training goes on while the thread writes
    assert pending.wait() == tmp_path / "checkpoint-0"
    written, reference = load_file(tmp_path / "checkpoint-0" / "model.safetensors"), load_file(tmp_path / "reference" / "model.safetensors")
    assert written.keys() == reference.keys() and all(torch.equal(written[k], reference[k]) for k in written)
    assert (tmp_path / "checkpoint-0" / "optimizer.pt").read_bytes() == (tmp_path / "reference" / "optimizer.pt").read_bytes()


def test_cpu_copy_is_a_copy():
    live = {"w": torch.zeros(3), "state": [{"exp_avg": torch.ones(2)}], "lr": 0.1}
    copy = cpu_copy(live)
    live["w"].add_(1), live["state"][0]["exp_avg"].add_(1)
    assert copy["w"].tolist() == [0.0] * 3 and copy["state"][0]["exp_avg"].tolist() == [1.0, 1.0] and copy["lr"] == 0.1


def test_resume_needs_the_same_world_size_and_a_training_checkpoint(tmp_path, tiny_qwen2_vl_path):
    model, processor, optimizer, scheduler = build(tiny_qwen2_vl_path)
    save(tmp_path / "checkpoint-1", model, processor, optimizer, scheduler, step=1).wait()
    with pytest.raises(CheckpointError, match=r"written by 1 ranks and this run has 2: .*--nproc_per_node 1"):
        load_training_checkpoint(tmp_path / "checkpoint-1", world_size=2)
    (tmp_path / "checkpoint-1" / "training_state.json").unlink()
    with pytest.raises(CheckpointError, match="training_state.json is missing"):
        load_training_checkpoint(tmp_path / "checkpoint-1")


def test_each_rank_writes_its_own_rng_file(tmp_path):
    """Two real ranks (torchrun, gloo): one checkpoint, rng_state_0.pth and rng_state_1.pth, each
    restoring its own rank's generators."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    folder = tmp_path / "checkpoint-3"
    assert {rng_file(0), rng_file(1), "training_state.json", "checkpoint_complete.json"} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / "training_state.json").read_text())["world_size"] == 2
    for rank in (0, 1):
        expected = json.loads((tmp_path / f"after-{rank}.json").read_text())
        assert json.loads((tmp_path / f"restored-{rank}.json").read_text()) == expected
    assert json.loads((tmp_path / "after-0.json").read_text()) != json.loads((tmp_path / "after-1.json").read_text())


RANK_SCRIPT = '''
import json, os, sys
import torch, torch.distributed as dist
from mmgrpo.models.loading import load_model, load_processor
from mmgrpo.models.tiny import resolve_model_path
from mmgrpo.runstate.state import TrainState
from mmgrpo.training.resume import CheckpointContents, Ranks, load_training_checkpoint, save_training_checkpoint

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()

def any_rank(flag):
    value = torch.tensor([float(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())

path = resolve_model_path("tiny:qwen2-vl")
model, processor = load_model(path), load_processor(path)
torch.manual_seed(100 + rank)
state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()} if rank == 0 else {}
save_training_checkpoint(f"{out}/checkpoint-3", CheckpointContents(model=model, processor=processor, state_dict=state_dict),
                         TrainState(step=3), Ranks(rank=rank, world_size=2, any_rank=any_rank))
json.dump(torch.rand(4).tolist(), open(f"{out}/after-{rank}.json", "w"))
torch.manual_seed(7)
load_training_checkpoint(f"{out}/checkpoint-3", rank=rank, world_size=2)
json.dump(torch.rand(4).tolist(), open(f"{out}/restored-{rank}.json", "w"))
dist.destroy_process_group()
'''


def test_full_determinism_turns_on_deterministic_kernels(monkeypatch):
    from mmgrpo.config import TrainConfig
    from mmgrpo.runstate.state import deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert TrainConfig.from_args(["--full_determinism", "true"]).full_determinism
    assert not TrainConfig.from_args([]).full_determinism
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    try:
        deterministic_kernels(False)
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        deterministic_kernels(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
