"""Atomic checkpoints: a save is complete or absent whatever instant it dies at, loaders never pick a
broken one, --save_total_limit keeps the newest, and checkpoint-best is swapped, never deleted first."""

import json
import logging
import os
import shutil
import signal

import pytest
import torch

from mmgrpo.errors import CheckpointError
from mmgrpo.runstate import checkpoint
from mmgrpo.runstate.checkpoint import (
    MARKER,
    check_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    repair_interrupted,
    save_atomically,
)


def write_files(names, fail_after=None):
    """A writer of small files; raises after writing `fail_after` of them."""

    def write(folder):
        for count, name in enumerate(names):
            if fail_after is not None and count == fail_after:
                raise OSError(f"disk full while writing {name}")
            (folder / name).write_text(f"{name} of {folder.name}")

    return write


def test_a_save_is_marked_complete_and_found_as_latest(tmp_path):
    for step in (1, 2, 10):
        pending = save_atomically(tmp_path / f"checkpoint-{step}", write_files(["a.json", "b.bin"]))
        assert pending.wait() == tmp_path / f"checkpoint-{step}"
    manifest = json.loads((tmp_path / "checkpoint-10" / MARKER).read_text())
    assert manifest["files"] == {"a.json": len("a.json of checkpoint-10.tmp"), "b.bin": len("b.bin of checkpoint-10.tmp")}
    assert latest_checkpoint(tmp_path).name == "checkpoint-10"  # by number: 10 after 2
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2", "checkpoint-10"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-10", "checkpoint-2"]


@pytest.mark.parametrize("fail_after", [0, 1, 2])
def test_a_writer_failing_at_each_file_leaves_the_previous_checkpoint_latest(tmp_path, fail_after):
    names = ["config.json", "model.safetensors", "optimizer.pt"]
    save_atomically(tmp_path / "checkpoint-1", write_files(names))
    with pytest.raises(OSError, match="disk full"):
        save_atomically(tmp_path / "checkpoint-2", write_files(names, fail_after=fail_after))
    assert latest_checkpoint(tmp_path) == check_checkpoint(tmp_path / "checkpoint-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # the staging folder is gone


def test_incomplete_and_truncated_checkpoints_are_skipped_with_one_line(tmp_path, caplog):
    save_atomically(tmp_path / "checkpoint-1", write_files(["model.safetensors"]))
    save_atomically(tmp_path / "checkpoint-3", write_files(["model.safetensors"]))
    half = tmp_path / "checkpoint-5"  # as an older, non-atomic save would leave it
    half.mkdir()
    (half / "config.json").write_text("")
    with open(tmp_path / "checkpoint-3" / "model.safetensors", "r+") as f:
        f.truncate(3)
    with caplog.at_level(logging.WARNING, logger="mmgrpo.runstate.checkpoint"):
        assert latest_checkpoint(tmp_path).name == "checkpoint-1"
    lines = [r.getMessage() for r in caplog.records]
    assert any("checkpoint-5: incomplete (no checkpoint_complete.json" in line for line in lines)
    assert any("checkpoint-3: model.safetensors is 3 bytes" in line for line in lines)
    assert all("\n" not in line for line in lines)
    with pytest.raises(CheckpointError, match=r"checkpoint-5 is incomplete .*the newest complete one is .*checkpoint-1$"):
        check_checkpoint(half)
    with pytest.raises(CheckpointError, match="checkpoint-3 is damaged: model.safetensors is 3 bytes, 37 when it was saved"):
        check_checkpoint(tmp_path / "checkpoint-3")


def test_save_total_limit_keeps_the_newest_complete_ones(tmp_path):
    (tmp_path / "checkpoint-best").mkdir()
    (tmp_path / "checkpoint-0").mkdir()  # incomplete: neither counted nor deleted
    for step in range(1, 6):
        save_atomically(tmp_path / f"checkpoint-{step}", write_files(["w"]), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0", "checkpoint-4", "checkpoint-5", "checkpoint-best"]


@pytest.mark.parametrize("atomic_exchange", [True, False])
def test_replacing_a_checkpoint_swaps_it_in_whole(tmp_path, monkeypatch, atomic_exchange):
    if not atomic_exchange:
        monkeypatch.setattr(checkpoint, "exchange", lambda a, b: False)  # platforms without renameat2
    best = tmp_path / "checkpoint-best"
    save_atomically(best, write_files(["best.json"]))
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(OSError):  # a failed replacement leaves the old one in place
        save_atomically(best, write_files(["best.json", "w"], fail_after=1))
    assert (best / "best.json").read_text() == "best.json of checkpoint-best.tmp" and check_checkpoint(best)
    save_atomically(best, write_files(["best.json", "w"]))
    assert sorted(p.name for p in best.iterdir()) == ["best.json", MARKER, "w"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-best", "keep.txt"]


def test_background_save_returns_at_once_and_the_next_save_waits_for_it(tmp_path):
    import threading

    release = threading.Event()

    def slow(folder):
        release.wait(10)
        (folder / "w").write_text("late")

    pending = save_atomically(tmp_path / "checkpoint-1", slow, background=True)
    assert not pending.done and latest_checkpoint(tmp_path) is None  # nothing visible while it writes
    release.set()
    save_atomically(tmp_path / "checkpoint-2", write_files(["w"]))  # awaits checkpoint-1 first
    assert pending.done and [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]

    def broken(folder):
        raise OSError("no space left")

    failing = save_atomically(tmp_path / "checkpoint-3", broken, background=True)
    with pytest.raises(OSError, match="no space left"):
        failing.wait()
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"


def test_repair_puts_a_finished_but_unrenamed_save_in_place(tmp_path):
    save_atomically(tmp_path / "checkpoint-1", write_files(["w"]))
    shutil.copytree(tmp_path / "checkpoint-1", tmp_path / "checkpoint-2.tmp")  # killed just before its rename
    (tmp_path / "checkpoint-3.tmp").mkdir()  # killed while writing
    repair_interrupted(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2"]


# ---- a real checkpoint killed with SIGKILL at every durable write -------------------------------


@pytest.fixture(scope="module")
def tiny_run(tiny_qwen2_vl_path):
    from mmgrpo.models.loading import load_model, load_processor

    model = load_model(tiny_qwen2_vl_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**{"input_ids": torch.tensor([[1, 2, 3]])}).logits.sum().backward()
    optimizer.step()  # an optimizer with state
    return model, load_processor(tiny_qwen2_vl_path), optimizer


def _save(tiny_run, path, step):
    from mmgrpo.runstate.state import TrainState
    from mmgrpo.training.resume import CheckpointContents, save_training_checkpoint

    model, processor, optimizer = tiny_run
    state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    contents = CheckpointContents(model=model, processor=processor, state_dict=state_dict, optimizer=optimizer)
    return save_training_checkpoint(path, contents, TrainState(step=step))


def _killed_save(tiny_run, path, step, kill_at, call="fsync", exchange=True):
    """Fork; the child saves and SIGKILLs itself at its `kill_at`-th os.<call>. True if it was killed."""
    pid = os.fork()
    if pid == 0:  # the child
        try:
            real, count = getattr(os, call), [0]

            def dying(*args):
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args)

            setattr(os, call, dying)
            if not exchange:
                checkpoint.exchange = lambda a, b: False
            _save(tiny_run, path, step).wait()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


def _assert_previous_or_new_loads(out, new_step):
    from mmgrpo.models.loading import load_model
    from mmgrpo.training.resume import read_training_state

    latest = latest_checkpoint(out)
    assert latest.name in ("checkpoint-1", f"checkpoint-{new_step}")
    assert read_training_state(latest).step == int(latest.name.split("-")[1])
    load_model(str(latest))
    staging = out / f"checkpoint-{new_step}.tmp"
    if staging.exists():
        with pytest.raises(CheckpointError, match="save that has not finished"):
            load_model(str(staging))
    return latest


def test_sigkill_at_every_fsync_of_a_real_save_never_leaves_a_broken_latest(tmp_path, tiny_run):
    template = tmp_path / "template"
    _save(tiny_run, template / "checkpoint-1", step=1)
    outcomes = []
    for kill_at in range(1, 100):
        out = tmp_path / f"kill-{kill_at}"
        shutil.copytree(template, out)
        if not _killed_save(tiny_run, out / "checkpoint-2", 2, kill_at):
            break  # the save finished before its kill_at-th fsync: every instant has been tried
        outcomes.append(_assert_previous_or_new_loads(out, 2).name)
        repair_interrupted(out)
        assert latest_checkpoint(out).name in ("checkpoint-1", "checkpoint-2")
        shutil.rmtree(out)
    assert kill_at > 10, "too few durable writes were interrupted"
    assert outcomes[0] == "checkpoint-1" and outcomes[-1] == "checkpoint-2"  # before the marker, after the rename


def test_sigkill_between_the_renames_of_a_replacement_keeps_a_loadable_best(tmp_path, tiny_run):
    out = tmp_path / "run"
    _save(tiny_run, out / "checkpoint-best", step=1)
    for kill_at in (1, 2):  # old aside / new in place (the fallback path without an atomic exchange)
        assert _killed_save(tiny_run, out / "checkpoint-best", 2, kill_at, call="rename", exchange=False)
        repair_interrupted(out)  # what the next save (or a resume) does first
        assert check_checkpoint(out / "checkpoint-best")
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-best"]


def test_nonfinite_weights_are_never_saved(tmp_path, tiny_run):
    from mmgrpo.runstate.state import TrainState
    from mmgrpo.training.resume import CheckpointContents, save_training_checkpoint

    model, processor, _ = tiny_run
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    name = next(iter(state_dict))
    state_dict[name][0] = float("nan")
    with pytest.raises(CheckpointError, match=f"not saving .*checkpoint-2: the weights hold NaN/inf \\(first: {name}\\)"):
        save_training_checkpoint(tmp_path / "checkpoint-2", CheckpointContents(model, processor, state_dict),
                                 TrainState(step=2))
    assert not any(tmp_path.iterdir())


def test_a_rotation_killed_while_deleting_leaves_nothing_the_next_save_keeps(tmp_path):
    # save checkpoint-1, then rotate it out as a kill during its deletion would leave it: renamed
    # aside, half deleted, its marker still there
    checkpoint.save_atomically(tmp_path / "checkpoint-1", lambda d: (d / "w.txt").write_text("one")).wait()
    doomed = tmp_path / ("checkpoint-1" + checkpoint.DELETING_SUFFIX)
    (tmp_path / "checkpoint-1").rename(doomed)
    (doomed / "w.txt").unlink()
    assert checkpoint.list_checkpoints(tmp_path) == [] and checkpoint.repairable(tmp_path) == {}  # never counted, never restored
    checkpoint.save_atomically(tmp_path / "checkpoint-2", lambda d: (d / "w.txt").write_text("two"), keep_last=1).wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    # a rotation renames before it deletes, so what it removes is gone whole
    checkpoint.save_atomically(tmp_path / "checkpoint-3", lambda d: (d / "w.txt").write_text("three"), keep_last=1).wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
