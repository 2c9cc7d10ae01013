"""What a checkpoint holds to continue a run bit for bit, and putting it back.

    checkpoint-8/
        config.json, model.safetensors, processor files   the HF folder from_pretrained loads (LoRA: the adapter)
        optimizer.pt, scheduler.pt                        torch state dicts (one process)
        rng_state_<rank>.pth                              python, numpy, torch CPU (and CUDA) RNGs of each rank
        training_state.json                               step, epoch, counters, best eval metric, data position
        step_log.json                                     the step's lines of metrics.jsonl / completions.jsonl
        checkpoint_complete.json                          written last (mmgrpo/checkpoint.py)

The loop's two calls:

    pending = save_training_checkpoint(out / f"checkpoint-{step}", model=..., processor=..., state_dict=...,
                                       optimizer=..., scheduler=..., state=TrainingState(step=step, ...))
    state = load_training_checkpoint(path, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler)

The reference model is not in a checkpoint: a resumed run builds it from `--model` (the starting
weights) as the first run did, then loads the policy's weights from the checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from mmgrpo.checkpoint import (
    STAGING_SUFFIX,
    PendingSave,
    check_checkpoint,
    commit,
    prepare_staging,
    rotate_checkpoints,
    save_atomically,
)
from mmgrpo.errors import CheckpointError

STATE_FILE = "training_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STEP_LOG_FILE = "step_log.json"  # {"metrics.jsonl": line, "completions.jsonl": lines}: mmgrpo.preflight.restore_step_log


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pth"


@dataclass
class TrainingState:
    """The loop's counters, saved as JSON beside the weights.

    >>> TrainingState.from_dict({"step": 4, "best_metric": 0.5}).step
    4
    """

    step: int = 0
    """Steps finished (the resumed run starts at step + 1)."""
    epoch: int = 0
    """Epoch of the prompt stream at the save (also inside `data`)."""
    nonfinite_steps: int = 0
    """Steps skipped for a NaN/inf loss or gradient norm so far (--max_nonfinite_steps counts them)."""
    best_metric: float | None = None
    """The in-training evaluation's best --metric_for_best_model value so far."""
    best_step: int | None = None
    """The step of checkpoint-best."""
    data: dict = field(default_factory=dict)
    """The prompt stream's position (mmgrpo.data.stream.PromptStream.state_dict())."""
    world_size: int = 1
    """Ranks that wrote the checkpoint; a resume needs as many."""
    extra: dict = field(default_factory=dict)
    """Room for later parts (e.g. the async rollout's state), saved and restored as is."""

    @classmethod
    def from_dict(cls, values: dict) -> TrainingState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


# ---- random number generators --------------------------------------------------------------------


def capture_rng() -> dict:
    """Every global RNG this process draws from: python `random`, numpy's global state, torch CPU
    and (when present) every CUDA device. Only tensors and plain values, so it loads with
    `torch.load(weights_only=True)`.

    >>> state = capture_rng(); a = (random.random(), np.random.rand(), torch.rand(1).item())
    >>> restore_rng(state); a == (random.random(), np.random.rand(), torch.rand(1).item())
    True
    """
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Put back what `capture_rng` took."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- saving -----------------------------------------------------------------------------------------


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding a NaN or inf, else None."""
    for name, tensor in tensors.items():
        if torch.is_floating_point(tensor) and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def snapshot(value):
    """A copy of tensors (nested in dicts / lists) that later in-place updates cannot reach."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    return copy.deepcopy(value)


def save_training_checkpoint(
    path: str | os.PathLike,
    *,
    model,
    processor,
    state_dict: dict[str, torch.Tensor],
    optimizer=None,
    scheduler=None,
    state: TrainingState,
    peft_model=None,
    rank: int = 0,
    world_size: int = 1,
    any_rank: Callable[[bool], bool] | None = None,
    background: bool = False,
    keep_last: int | None = None,
    extra_files: dict[str, object] | None = None,
    save_shards: Callable[[Path], None] | None = None,
) -> PendingSave:
    """Write a complete checkpoint of a run atomically (mmgrpo/checkpoint.py).

    state_dict: the full weights by HF name (`strategy.full_state_dict(policy)`; LoRA: the
        trainable ones), on rank 0. A NaN/inf in it is a CheckpointError and nothing is written:
        the previous checkpoints stay the newest.
    background: copy weights, optimizer state and RNGs now (the only time training waits), and
        write them in a thread; `wait()` the result before exiting (mmgrpo/checkpoint.py).
    extra_files: more files for rank 0 to write, by name: a str is written as text, anything else
        with torch.save (tensors only, so it loads with weights_only=True).
    world_size > 1: every rank calls this with `any_rank` (`strategy.any_rank`: True everywhere if
        True on any; it is also the barrier); each writes its RNG file, rank 0 the rest and the
        marker, in the foreground. `save_shards(folder)`, a collective every rank calls, writes the
        sharded optimizer state (`strategy.save_sharded_optimizer`: each rank its shards).
    """
    from mmgrpo.lora import save_pretrained

    path = Path(path)
    bad = first_nonfinite(state_dict) if rank == 0 else None
    if (any_rank(bad is not None) if world_size > 1 else bad is not None):
        raise CheckpointError(
            f"not saving {path}: the weights hold NaN/inf (first: {bad or 'on rank 0'}); the last good checkpoint stays the newest. "
            "Lower --learning_rate or --max_grad_norm, or train in fp32."
        )
    state = TrainingState(**{**asdict(state), "world_size": world_size})
    rng = capture_rng()
    optimizer_state = optimizer.state_dict() if optimizer is not None and world_size == 1 else None
    scheduler_state = scheduler.state_dict() if scheduler is not None else None
    if background:
        if world_size > 1:
            raise CheckpointError("background checkpoint saving is for one process; save in the foreground under torchrun.")
        state_dict, optimizer_state, scheduler_state = snapshot(state_dict), snapshot(optimizer_state), snapshot(scheduler_state)
        extra_files = snapshot(extra_files)

    def write_rank_files(folder: Path) -> None:
        torch.save(rng, folder / rng_file(rank))
        if save_shards is not None:
            save_shards(folder)

    def write(folder: Path) -> None:
        if world_size == 1:
            write_rank_files(folder)
        save_pretrained(model, peft_model, folder, state_dict)
        processor.save_pretrained(folder)
        if optimizer_state is not None:
            torch.save(optimizer_state, folder / OPTIMIZER_FILE)
        if scheduler_state is not None:
            torch.save(scheduler_state, folder / SCHEDULER_FILE)
        for name, content in (extra_files or {}).items():
            if isinstance(content, str):
                (folder / name).write_text(content)
            else:
                torch.save(content, folder / name)
        (folder / STATE_FILE).write_text(json.dumps(asdict(state), indent=1, allow_nan=False) + "\n")
        if world_size > 1:
            missing = [rng_file(r) for r in range(world_size) if not (folder / rng_file(r)).is_file()]
            if missing:
                raise CheckpointError(f"not saving {path}: ranks did not write {', '.join(missing)}")

    if world_size == 1:
        return save_atomically(path, write, background=background, keep_last=keep_last)
    # Ranks: rank 0 prepares the staging folder, every rank writes its RNG file into it, rank 0 the
    # rest and commits. Only rank 0 touches the folder's other entries; a failure anywhere is
    # raised on every rank (no rank waits in a collective for one that gave up).
    staging = path.with_name(path.name + STAGING_SUFFIX)

    def commit_all(folder: Path) -> None:
        try:
            write(folder)
            commit(folder, path)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if keep_last:
            rotate_checkpoints(path.parent, keep_last)

    _together(any_rank, prepare_staging if rank == 0 else None, path, path)
    _together(any_rank, write_rank_files, staging, path)  # every rank: a collective with save_shards
    _together(any_rank, commit_all if rank == 0 else None, staging, path)
    return PendingSave(path)


def _together(any_rank: Callable[[bool], bool], action, argument, path: Path) -> None:
    """Run `action(argument)` on this rank (None: nothing), then raise on every rank if it failed on any."""
    error = None
    if action is not None:
        try:
            action(argument)
        except Exception as err:  # raised below, after the other ranks know
            error = err
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise CheckpointError(f"not saving {path}: another rank failed (its error is above)")


# ---- loading ----------------------------------------------------------------------------------------


def read_training_state(path: str | os.PathLike) -> TrainingState:
    """The TrainingState of a complete checkpoint (CheckpointError if it is not one)."""
    path = check_checkpoint(path)
    file = path / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}: it holds weights only; "
                              f"start a new run with --model {path} instead of resuming")
    try:
        return TrainingState.from_dict(json.loads(file.read_text()))
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is unreadable ({err})") from None


def load_training_checkpoint(
    path: str | os.PathLike, *, model=None, peft_model=None, template=None, optimizer=None, scheduler=None,
    rank: int = 0, world_size: int = 1, load_shards: Callable[[Path], None] | None = None,
) -> TrainingState:
    """Restore a run from a complete checkpoint; returns its TrainingState.

    model: the policy's HF model, as built from --model (the reference stays that): its weights are
        replaced by the checkpoint's (LoRA: `peft_model`'s adapters). Call before the strategy wraps it.
    optimizer / scheduler: built as in a new run, then loaded (call after they exist).
    Every RNG of this rank is restored last, so nothing after this call draws before the loop.
    """
    path = Path(path)
    state = read_training_state(path)
    if state.world_size != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {state.world_size} ranks and this run has {world_size}: "
            f"resume with the same number of processes (torchrun --nproc_per_node {state.world_size})"
        )
    if model is not None:
        restore_weights(model, path, peft_model=peft_model, template=template)
    if load_shards is not None:  # a sharded optimizer state (every rank: a collective)
        load_shards(path)
        optimizer = None
    for obj, name in ((optimizer, OPTIMIZER_FILE), (scheduler, SCHEDULER_FILE)):
        if obj is not None:
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint {path} has no {name}; it cannot continue this run's {name.split('.')[0]}")
            obj.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
    rng = path / rng_file(rank)
    if not rng.is_file():
        raise CheckpointError(f"checkpoint {path} has no {rng.name} (rank {rank}'s random state)")
    restore_rng(torch.load(rng, weights_only=True))
    return state


def restore_weights(model: torch.nn.Module, path: str | os.PathLike, *, peft_model=None, template=None) -> None:
    """Copy a checkpoint's weights into `model` in place (same class, HF's key mapping applied by
    loading it as transformers does). With `peft_model`: the LoRA adapter only."""
    path = Path(path)
    if peft_model is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from mmgrpo.fusion.attach import fusion_of, load_fusion_weights

        set_peft_model_state_dict(peft_model, load_file(str(path / "adapter_model.safetensors")))
        if fusion_of(model) is not None:  # LoRA with fusion modules: theirs too
            load_fusion_weights(fusion_of(model), path)
        return
    from mmgrpo.models.loading import load_model

    loaded = load_model(str(path), dtype=next(model.parameters()).dtype, template=template)
    with torch.no_grad():
        model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
