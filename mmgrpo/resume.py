"""A run saved so that it continues exactly, and continued (`--resume_from_checkpoint PATH|latest`).

    plan = preflight(cfg)                                   # which checkpoint (mmgrpo/preflight.py)
    run = build_run(cfg, resume_from=plan.resume_from)      # reference: --model; policy: the checkpoint's weights
    resume_run(run, plan.resume_from, state, batches, pipeline)
    ...
    save_run(run, out / f"checkpoint-{step}", state, batches, pipeline)   # every --save_steps and at the end

A checkpoint (mmgrpo/train_state.py lists its files) holds the weights, optimizer and schedule,
every RNG of each rank, the loop's counters, the best in-training evaluation value, the prompt
stream's position and the starting `--model` (the reference model: a resumed run is refused with
another one, whose KL term would pull toward other weights).

With `--async_generate` a rollout is in flight across the step boundary: the one for step N + 1
began during step N on the weights of step N - 1, which no checkpoint holds. Regenerating it on
the saved (step N) weights would give another run, so the save waits for that rollout and keeps
its completions and log-probs (`rollout_in_flight.pt`, kilobytes: token ids, not media) and the
prompt stream's position before its prompts; the resumed run draws those prompts again and
trains step N + 1 on the saved completions, as the uninterrupted run does.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from mmgrpo.checkpoint import PendingSave
from mmgrpo.errors import CheckpointError
from mmgrpo.models.loading import RUN_INFO_FILE
from mmgrpo.rollout.base import Rollout
from mmgrpo.train_state import (
    STEP_LOG_FILE,
    TrainingState,
    load_training_checkpoint,
    save_training_checkpoint,
)

ROLLOUT_FILE = "rollout_in_flight.pt"


def save_run(run, path: Path, state, batches, pipeline, *, background: bool = False,
             step_log: dict[str, str] | None = None) -> PendingSave:
    """Write checkpoint `path` of a run after step `state.step` (every rank calls it).

    step_log: the step's lines of metrics.jsonl and completions.jsonl (`runlog.step_log_lines`,
    timings of the save aside). The loop logs a step after its save; a kill between the two would
    lose the step's lines, so the checkpoint keeps them and a resume restores them.

    background: copy what is saved, then write it in a thread (one process; the final save is
    awaited by the caller). A NaN/inf weight is a CheckpointError and nothing is written.
    """
    cfg, strategy = run.cfg, run.strategy
    in_flight = pipeline.pending()  # async: the next step's rollout, finished
    training = TrainingState(
        step=state.step, epoch=batches.epoch, nonfinite_steps=state.nonfinite_steps,
        best_metric=run.evaluator.best_value,
        data=batches.state_dict(before_last=in_flight is not None),  # its prompts are drawn again on resume
        extra={"model": cfg.model.model, "rollout_in_flight": in_flight is not None},
    )
    extra_files: dict[str, object] = {RUN_INFO_FILE: json.dumps({"model_type": run.template.name}) + "\n"}
    if step_log is not None:
        extra_files[STEP_LOG_FILE] = json.dumps(step_log) + "\n"
    if in_flight is not None:
        extra_files[ROLLOUT_FILE] = {k: v for k, v in dataclasses.asdict(in_flight[1]).items() if v is not None}
    return save_training_checkpoint(
        path, model=run.model, processor=run.processor, peft_model=run.peft_model,
        state_dict=strategy.full_state_dict(run.model, trainable_only=run.peft_model is not None),
        optimizer=run.optimizer, scheduler=run.scheduler, state=training, rank=strategy.rank,
        world_size=strategy.world_size, any_rank=strategy.any_rank, background=background,
        keep_last=cfg.save_total_limit, extra_files=extra_files,
        save_shards=(lambda folder: strategy.save_sharded_optimizer(run.optimizer, folder)) if strategy.world_size > 1 else None,
    )


def resume_run(run, path: Path, state, batches, pipeline) -> TrainingState:
    """Continue a run from checkpoint `path`: optimizer, schedule, counters, best evaluation value,
    prompt stream position, the rollout in flight (async) and, last, every RNG of this rank.
    The policy's weights were loaded by `build_run(cfg, resume_from=path)`."""
    strategy = run.strategy
    saved = load_training_checkpoint(
        path, optimizer=run.optimizer, scheduler=run.scheduler, rank=strategy.rank, world_size=strategy.world_size,
        load_shards=(lambda folder: strategy.load_sharded_optimizer(run.optimizer, folder)) if strategy.world_size > 1 else None,
    )
    started_from = saved.extra.get("model")
    if started_from is not None and started_from != run.cfg.model.model:
        raise CheckpointError(
            f"checkpoint {path} continues a run that started from --model {started_from} (its KL reference); "
            f"this run has --model {run.cfg.model.model}. Resume with --model {started_from}."
        )
    batches.load_state_dict({**saved.data, "rank": strategy.rank})  # ranks move in step: rank 0's position is each one's
    state.step, state.nonfinite_steps = saved.step, saved.nonfinite_steps
    run.evaluator.best_value = saved.best_metric
    pipeline.policy_updated(saved.step)  # an engine with its own copy gets these weights at its next rollout
    if saved.extra.get("rollout_in_flight"):
        if not run.cfg.rollout.async_generate:
            raise CheckpointError(f"checkpoint {path} was saved with --async_generate: resume with it too.")
        rollout = Rollout(**torch.load(Path(path) / ROLLOUT_FILE, map_location="cpu", weights_only=True))
        pipeline.restore(next(batches), rollout, saved.step)
    return saved
