"""A run saved so that it continues exactly, and continued (`--resume_from_checkpoint PATH|latest`).

    plan = preflight(cfg)                                   # which checkpoint (mmgrpo/training/output_dir.py)
    run = build_run(cfg, resume_from=plan.resume_from)      # reference: --model; policy: the checkpoint's weights
    resume_run(run, plan.resume_from, state, batches, pipeline)
    ...
    save_run(run, out / f"checkpoint-{step}", state, batches, pipeline)   # every --save_steps and at the end

    checkpoint-8/
        config.json, model.safetensors, processor files   the HF folder from_pretrained loads (LoRA: the adapter)
        mmgrpo.json                                       the model type (`mmgrpo eval` needs no --model_type)
        optimizer.pt, scheduler.pt                        torch state dicts (one process; sharded: each rank's files)
        rng_state_<rank>.pth                              python, numpy, torch CPU (and CUDA) RNGs of each rank
        training_state.json                               the TrainState (mmgrpo/runstate/state.py), the run's flags included
        step_log.json                                     the step's lines of metrics.jsonl / completions.jsonl
        rollouts_in_flight_<rank>.pt                      async: the completions asked for the next K steps
        checkpoint_complete.json                          written last (mmgrpo/runstate/checkpoint.py)

The TrainState holds the loop's counters, the best in-training evaluation, the dynamic modality
weights, the prompt stream's position and the starting `--model` (the reference model: a resumed
run is refused with another one, whose KL term would pull toward other weights). The reference
model is not in a checkpoint: a resumed run builds it from `--model` as the first run did.

Asynchronous training (`--max_staleness K`, `--async_generate`) has up to K rollouts in flight
across the step boundary: those for steps N + 1 .. N + K, sampled on the weights of steps
N - K .. N - 1, which no checkpoint holds (mmgrpo/rollout/pipeline.py). Regenerating them on the
saved (step N) weights would give another run, so the save waits for them and each rank keeps its
own completions and log-probs (`rollouts_in_flight_<rank>.pt`, kilobytes: token ids, not media)
with the prompt stream's position where each one's prompts began; the resumed run reads those
prompts again, puts the rollouts back in flight and trains on them as the uninterrupted run does.
Resumed with a smaller K, a rollout that would be too stale is dropped and generated again.
Under --partial_rollouts a rollout in flight may be paused part way: the file keeps its decode so far
(tokens, their log-probs and weight versions, which rows ended, the chunks asked) and the resumed
run continues it with the next chunk, as the uninterrupted run does; resuming it needs the same
--partial_rollouts and K (mmgrpo/training/resume_flags.py).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mmgrpo.errors import CheckpointError
from mmgrpo.models.saving import save_model_folder
from mmgrpo.rollout.base import PartialRollout, Rollout
from mmgrpo.runstate.checkpoint import (
    STAGING_SUFFIX,
    PendingSave,
    check_checkpoint,
    commit,
    list_checkpoints,
    prepare_staging,
    rotate_checkpoints,
    save_atomically,
    staged_bytes,
)
from mmgrpo.runstate.disk_space import SMALL_FILES, disk_full_error, tensor_bytes, unwritable_error
from mmgrpo.runstate.state import STATE_FILE, TrainState, capture_rng, restore_rng
from mmgrpo.training.resume_flags import apply_resume_changes

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STEP_LOG_FILE = "step_log.json"  # {"metrics.jsonl": line, "completions.jsonl": lines}: output_dir.restore_step_log

EARLIER_ROLLOUT_FILE = "rollout_in_flight.pt"  # one rollout, rank 0's, its prompts just before the saved position


def rollouts_file(rank: int) -> str:
    return f"rollouts_in_flight_{rank}.pt"


def save_run(run, path: Path, state: TrainState, batches, pipeline, *, background: bool = False,
             step_log: dict[str, str] | None = None) -> PendingSave:
    """Write checkpoint `path` of a run after step `state.step` (every rank calls it).

    step_log: the step's lines of metrics.jsonl and completions.jsonl (`runlog.step_log_lines`,
    timings of the save aside). The loop logs a step after its save; a kill between the two would
    lose the step's lines, so the checkpoint keeps them and a resume restores them.

    background: copy what is saved, then write it in a thread (one process; the final save is
    awaited by the caller). A NaN/inf weight is a CheckpointError and nothing is written.
    """
    cfg, strategy = run.cfg, run.strategy
    own = strategy.saves_optimizer_itself  # the optimizer's state: written by the strategy, not as optimizer.pt
    in_flight = pipeline.in_flight()  # async: the rollouts asked for the next steps, finished
    state.model = cfg.model.model
    state.flags = cfg.to_dict()  # what a resumed run is compared with (mmgrpo/training/resume_flags.py)
    state.rollout_in_flight = len(in_flight)
    state.data = batches.state_dict()
    state.loss_scale = strategy.loss_scale_state()
    extra_files: dict[str, object] = {}
    if step_log is not None:
        extra_files[STEP_LOG_FILE] = json.dumps(step_log) + "\n"
    rank_files = {}
    if in_flight:  # each rank's own completions; their prompts are read again on resume
        rank_files[rollouts_file(strategy.rank)] = [in_flight_record(*entry) for entry in in_flight]
    contents = CheckpointContents(
        model=run.model, processor=run.processor, peft_model=run.peft_model, template=run.template,
        state_dict=strategy.full_state_dict(run.model, trainable_only=run.peft_model is not None),
        optimizer=None if own else run.optimizer, scheduler=run.scheduler, extra_files=extra_files, rank_files=rank_files,
        save_shards=(lambda folder: strategy.save_sharded_optimizer(run.optimizer, folder)) if own else None,
    )
    return save_training_checkpoint(path, contents, state, Ranks(strategy.rank, strategy.world_size, strategy.any_rank),
                                    background=background and not own, keep_last=cfg.save_total_limit)


def resume_run(run, path: Path, batches, pipeline) -> TrainState:
    """Continue a run from checkpoint `path`: its TrainState (counters, best evaluation, modality
    weights, data position), optimizer, schedule, the rollout in flight (async) and, last, every
    RNG of this rank. The policy's weights were loaded by `build_run(cfg, resume_from=path)`."""
    strategy = run.strategy
    state = load_training_checkpoint(
        path, optimizer=run.optimizer, scheduler=run.scheduler, rank=strategy.rank, world_size=strategy.world_size,
        load_shards=(lambda folder: strategy.load_sharded_optimizer(run.optimizer, folder))
        if strategy.saves_optimizer_itself else None,
    )
    refuse_nonfinite_state(path, run.model, run.optimizer, strategy)
    if state.model is not None and state.model != run.cfg.model.model:
        raise CheckpointError(
            f"checkpoint {path} continues a run that started from --model {state.model} (its KL reference); "
            f"this run has --model {run.cfg.model.model}. Resume with --model {state.model}."
        )
    strategy.load_loss_scale_state(state.loss_scale)
    apply_resume_changes(run, state)  # changed schedule flags take effect now; every change is recorded
    # ranks move in step: rank 0's position is each one's, at its own data rank (a sequence group's ranks share one)
    position = {**state.data, "rank": strategy.data_rank}
    batches.load_state_dict(position)
    pipeline.policy_updated(state.step)  # an engine with its own copy gets these weights at its next rollout
    if state.rollout_in_flight:
        if not run.cfg.rollout.staleness_bound:
            raise CheckpointError(f"checkpoint {path} was saved by asynchronous training with {int(state.rollout_in_flight)} "
                                  f"rollout(s) in flight: resume with --max_staleness {int(state.rollout_in_flight)} too.")
        restored = restore_in_flight(Path(path), strategy.rank, state, batches, position)
        paused = [step for step, _, _, rollout, _ in restored if isinstance(rollout, PartialRollout)]
        if paused and not run.cfg.rollout.partial_rollouts:
            raise CheckpointError(f"checkpoint {path} holds the rollouts of steps {', '.join(map(str, paused))} paused part "
                                  "way (saved with --partial_rollouts): resume with --partial_rollouts too.")
        pipeline.restore(restored, state.step)
    return state


def in_flight_record(step: int, position: tuple[int, int], rollout: Rollout | PartialRollout, chunks: int) -> dict:
    """One rollout in flight as rollouts_in_flight_<rank>.pt keeps it: its step, where its prompts began,
    and its completions, or under --partial_rollouts its paused decode ("partial": tokens so far, their
    log-probs and versions, which rows ended) with the chunks asked so far."""
    record = {"step": step, "position": list(position), "chunks": chunks}
    record["partial" if isinstance(rollout, PartialRollout) else "rollout"] = rollout.to_file()
    return record


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (FSDP2's DTensor: its local shard; ZeRO-3 leaves an empty placeholder)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def refuse_nonfinite_state(path: Path, model: torch.nn.Module, optimizer, strategy) -> None:
    """CheckpointError on every rank when the resumed weights or optimizer moments hold a NaN/inf: a
    checkpoint that passed its checksums can still hold them (saved by another tool, or before
    checksums existed), and one step on them would turn every weight NaN. Each rank checks its part."""
    bad = None
    for name, parameter in model.named_parameters():
        if torch.is_floating_point(parameter) and not bool(torch.isfinite(local_tensor(parameter.detach())).all()):
            bad = f"weight {name}"
            break
    if bad is None and optimizer is not None:
        for parameter_state in optimizer.state.values():
            for key, value in parameter_state.items():
                if isinstance(value, torch.Tensor) and torch.is_floating_point(value) \
                        and not bool(torch.isfinite(local_tensor(value)).all()):
                    bad = f"optimizer state {key}"
                    break
            if bad is not None:
                break
    if strategy.any_rank(bad is not None):
        raise CheckpointError(
            f"checkpoint {path} holds NaN/inf ({'first: ' + bad if bad else 'on another rank'}); training on it would "
            "make every weight NaN. Resume from an earlier checkpoint (--resume_from_checkpoint PATH)."
        )


def restore_in_flight(path: Path, rank: int, state: TrainState, batches, position: dict) -> list:
    """(step, prompts, position, rollout, chunks asked) of each rollout a checkpoint saved in flight
    (a PartialRollout where it was paused, --partial_rollouts): its prompts read again from where
    they began in the stream, which is then back at `position`."""
    file = path / rollouts_file(rank)
    if file.is_file():
        saved = torch.load(file, map_location="cpu", weights_only=True)
    else:  # written before K > 1: one rollout (rank 0's), its prompts the batch at the saved position
        rollout = torch.load(path / EARLIER_ROLLOUT_FILE, map_location="cpu", weights_only=True)
        saved = [{"step": state.step + 1, "position": [state.data["epoch"], state.data["batch"]], "rollout": rollout}]
        position = None  # after reading them the stream is where it goes on
    restored = []
    for record in saved:
        epoch, batch = record["position"]
        if (batches.epoch, batches.batch) != (epoch, batch):
            batches.load_state_dict({**state.data, "epoch": epoch, "batch": batch, "rank": rank})
        rollout = PartialRollout.from_file(record["partial"]) if "partial" in record else Rollout.from_file(record["rollout"])
        restored.append((record["step"], next(batches), (epoch, batch), rollout, record.get("chunks", 1)))
    if position is not None and (batches.epoch, batches.batch) != (position["epoch"], position["batch"]):
        batches.load_state_dict(position)
    return restored


# ---- the files of a checkpoint ---------------------------------------------------------------------


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pth"


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding a NaN or inf, else None."""
    for name, tensor in tensors.items():
        if torch.is_floating_point(tensor) and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def cpu_copy(value):
    """A copy of tensors (nested in dicts / lists) on the CPU, and of everything else, that later
    in-place updates cannot reach."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return copy.deepcopy(value)


@dataclass
class CheckpointContents:
    """What a training checkpoint holds beside its TrainState (`save_training_checkpoint`).

    model, processor, peft_model, template: the policy's HF folder (`save_model_folder`; the
        template's name goes into mmgrpo.json, None writes no mmgrpo.json).
    state_dict: the full weights by HF name (`strategy.full_state_dict(policy)`; LoRA: the
        trainable ones), on rank 0.
    optimizer, scheduler: their state dicts become optimizer.pt (one process) and scheduler.pt.
    save_shards(folder): a collective every rank calls that writes the sharded optimizer state
        (`strategy.save_sharded_optimizer`: each rank its shards).
    extra_files: more files for rank 0 to write, by name: a str is written as text, anything else
        with torch.save (tensors only, so it loads with weights_only=True).
    rank_files: files this rank writes (each rank its own names), with torch.save.
    """

    model: torch.nn.Module
    processor: object
    state_dict: dict[str, torch.Tensor]
    peft_model: object = None
    template: object = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object = None
    save_shards: Callable[[Path], None] | None = None
    extra_files: dict[str, object] = field(default_factory=dict)
    rank_files: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Ranks:
    """The processes that save a checkpoint together: this one's rank, how many there are, and
    `any_rank(flag)`, True on every rank if True on any (`strategy.any_rank`; it is also the barrier)."""

    rank: int = 0
    world_size: int = 1
    any_rank: Callable[[bool], bool] | None = None


def refuse_nonfinite(path: Path, state_dict: dict[str, torch.Tensor], ranks: Ranks) -> None:
    """CheckpointError on every rank where rank 0's weights hold a NaN/inf: nothing is written."""
    bad = first_nonfinite(state_dict) if ranks.rank == 0 else None
    if (ranks.any_rank(bad is not None) if ranks.world_size > 1 else bad is not None):
        raise CheckpointError(
            f"not saving {path}: the weights hold NaN/inf (first: {bad or 'on rank 0'}); the last good checkpoint stays the newest. "
            "Lower --learning_rate or --max_grad_norm, or train in fp32."
        )


def save_training_checkpoint(path: str | os.PathLike, contents: CheckpointContents, state: TrainState,
                             ranks: Ranks = Ranks(), *, background: bool = False,
                             keep_last: int | None = None) -> PendingSave:
    """Write a complete checkpoint of a run atomically (mmgrpo/runstate/checkpoint.py): `contents`,
    `state` and each rank's RNGs.

    A NaN/inf in the weights is a CheckpointError and nothing is written: the previous checkpoints
    stay the newest.
    background: copy weights, optimizer state and RNGs now (the only time training waits), and
        write them in a thread; `wait()` the result before exiting (mmgrpo/runstate/checkpoint.py).
    keep_last: then keep only the newest N checkpoints (--save_total_limit).
    ranks.world_size > 1: every rank calls this; each writes its RNG file, rank 0 the rest and the
        marker, in the foreground.
    """
    path = Path(path)
    rank, world_size = ranks.rank, ranks.world_size
    refuse_nonfinite(path, contents.state_dict, ranks)
    state = TrainState(**{**asdict(state), "world_size": world_size})
    rng = capture_rng()
    state_dict, extra_files, rank_files = contents.state_dict, contents.extra_files, contents.rank_files
    optimizer_state = contents.optimizer.state_dict() if contents.optimizer is not None and world_size == 1 else None
    scheduler_state = contents.scheduler.state_dict() if contents.scheduler is not None else None
    if background:
        if world_size > 1:
            raise CheckpointError("background checkpoint saving is for one process; save in the foreground under torchrun.")
        state_dict, optimizer_state, scheduler_state = cpu_copy(state_dict), cpu_copy(optimizer_state), cpu_copy(scheduler_state)
        extra_files, rank_files = cpu_copy(extra_files), cpu_copy(rank_files)

    def write_rank_files(folder: Path) -> None:
        torch.save(rng, folder / rng_file(rank))
        for name, content in (rank_files or {}).items():
            torch.save(content, folder / name)
        if contents.save_shards is not None:
            contents.save_shards(folder)

    def write(folder: Path) -> None:
        if world_size == 1:
            write_rank_files(folder)
        save_model_folder(folder, contents.model, contents.peft_model, contents.processor, contents.template, state_dict)
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

    weights = tensor_bytes(state_dict)  # rank 0's; a sharded optimizer: AdamW's two moments per weight
    needed = weights + (tensor_bytes(optimizer_state) if optimizer_state is not None else 2 * weights) + SMALL_FILES
    if world_size == 1:
        return save_atomically(path, write, background=background, keep_last=keep_last, needed_bytes=needed)
    save_on_ranks(path, ranks, write_rank_files, write, needed, keep_last)
    return PendingSave(path)


def save_on_ranks(path: Path, ranks: Ranks, write_rank_files: Callable[[Path], None], write: Callable[[Path], None],
                  needed: int, keep_last: int | None) -> None:
    """A checkpoint several ranks write: rank 0 prepares the staging folder, every rank writes its
    own files into it (`write_rank_files`), rank 0 the rest (`write`) and commits. Only rank 0
    touches the folder's other entries; a failure anywhere is raised on every rank (no rank waits
    in a collective for one that gave up). needed: the bytes a disk-full error names."""
    staging = path.with_name(path.name + STAGING_SUFFIX)

    def commit_all(folder: Path) -> None:
        try:
            write(folder)
            commit(folder, path)
        except BaseException as err:
            written, free = staged_bytes(folder), shutil.disk_usage(folder.parent).free  # before the partial save goes
            shutil.rmtree(folder, ignore_errors=True)
            kept = [p.name for p in list_checkpoints(path.parent, warn=False)]
            full = disk_full_error(err, path, needed, kept, written, free)  # one line: the folder, the bytes, what is kept
            full = full or unwritable_error(err, path, kept)
            if full is not None:
                raise full from None
            raise
        if keep_last:
            rotate_checkpoints(path.parent, keep_last)

    any_rank, rank = ranks.any_rank, ranks.rank
    _together(any_rank, prepare_staging if rank == 0 else None, path, path)
    _together(any_rank, write_rank_files, staging, path)  # every rank: a collective with save_shards
    _together(any_rank, commit_all if rank == 0 else None, staging, path)


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


def read_training_state(path: str | os.PathLike) -> TrainState:
    """The TrainState of a complete checkpoint (CheckpointError if it is not one)."""
    path = check_checkpoint(path)
    file = path / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}: it holds weights only; "
                              f"start a new run with --model {path} instead of resuming")
    try:
        return TrainState.from_dict(json.loads(file.read_text()))
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is unreadable ({err})") from None


def load_training_checkpoint(
    path: str | os.PathLike, *, model=None, peft_model=None, template=None, optimizer=None, scheduler=None,
    rank: int = 0, world_size: int = 1, load_shards: Callable[[Path], None] | None = None,
) -> TrainState:
    """Restore a run from a complete checkpoint; returns its TrainState.

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
            with unreadable_as_checkpoint_error(path, name):
                obj.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
    rng = path / rng_file(rank)
    if not rng.is_file():
        raise CheckpointError(f"checkpoint {path} has no {rng.name} (rank {rank}'s random state)")
    with unreadable_as_checkpoint_error(path, rng.name):
        restore_rng(torch.load(rng, weights_only=True))
    return state


@contextmanager
def unreadable_as_checkpoint_error(path: Path, name: str):
    """A file of a checkpoint that torch cannot load (corrupt in a checkpoint saved before checksums, or
    another run's) as one CheckpointError naming it, not a traceback from the unpickler."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"checkpoint {path}: {name} cannot be loaded ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); it is corrupt or from another run: "
                              "resume from an earlier checkpoint") from None


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
