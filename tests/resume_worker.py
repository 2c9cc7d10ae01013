"""The GRPO loop of mmgrpo/engine.py `train`, with the calls that make it resumable, for
tests/test_resume.py to kill and restart:

    python tests/resume_worker.py --model tiny:qwen2-vl ... --output_dir OUT [--resume_from_checkpoint latest]

It is the reference for wiring resume into `engine.train` (the loop is being restructured there):
every call below that is not in `train` today is marked `# resume:`. It takes `mmgrpo train`'s
flags, plus MMGRPO_TEST_SAVE_IN_BACKGROUND=1 to write checkpoints from a thread.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from mmgrpo.checkpoint import wait_for_saves
from mmgrpo.config import TrainConfig
from mmgrpo.engine import grpo_step, lr_lambda, make_adamw, seed_everything
from mmgrpo.errors import ConfigError, MMGRPOError
from mmgrpo.eval.in_training import TrainingEval
from mmgrpo.preflight import preflight
from mmgrpo.runlog import RunLogger
from mmgrpo.setup import build_run
from mmgrpo.train_state import (
    TrainingState,
    load_training_checkpoint,
    restore_weights,
    save_training_checkpoint,
)


def train_resumable(cfg: TrainConfig) -> Path:
    cfg.validate()
    plan = preflight(cfg)  # resume: output folder, --resume_from_checkpoint, --overwrite_output_dir
    evaluator = TrainingEval(cfg)
    run = build_run(cfg)  # the reference model is built from --model: the starting weights
    seed_everything(cfg.seed)
    out = Path(cfg.output_dir)
    prompts_per_step = cfg.optim.per_device_train_batch_size * cfg.optim.gradient_accumulation_steps // cfg.rollout.num_generations
    total_steps = run.total_steps(prompts_per_step)
    if plan.resume_from is not None:
        restore_weights(run.model, plan.resume_from, peft_model=run.peft_model)  # resume: before the strategy wraps it
    run.optimizer = run.strategy.wrap(run.policy, make_adamw(cfg))
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lr_lambda(cfg, total_steps))
    batches = run.prompt_batches(prompts_per_step)
    first = 1
    if plan.resume_from is not None:  # resume: optimizer, schedule, counters, data position, RNGs (last)
        state = load_training_checkpoint(plan.resume_from, optimizer=run.optimizer, scheduler=run.scheduler,
                                         rank=run.strategy.rank, world_size=run.strategy.world_size)
        batches.load_state_dict(state.data)
        run.nonfinite_steps, evaluator.best_value, first = state.nonfinite_steps, state.best_metric, state.step + 1
    plan.apply()  # resume: trims metrics.jsonl / completions.jsonl to the checkpoint; overwrite: clears the folder
    logger = RunLogger(out, cfg, resume_step=plan.resume_step if plan.resume_from is not None else None)
    background = os.environ.get("MMGRPO_TEST_SAVE_IN_BACKGROUND") == "1"
    try:
        for step in range(first, total_steps + 1):
            run.step = step
            torch.manual_seed(cfg.seed * 100_003 + step + 1_000_003 * run.strategy.rank)
            metrics, records = grpo_step(run, next(batches), step)
            metrics.update(evaluator.maybe_evaluate(run, step, final=step == total_steps))
            logger.log_step(metrics, records, print_it=False)
            if run.nonfinite_steps >= cfg.max_nonfinite_steps:
                raise ConfigError(f"{run.nonfinite_steps} steps had a NaN/inf loss or gradient norm: stopping.")
            if (cfg.save_steps and step % cfg.save_steps == 0) or step == total_steps:
                state = TrainingState(step=step, epoch=batches.epoch, nonfinite_steps=run.nonfinite_steps,
                                      best_metric=evaluator.best_value, data=batches.state_dict())
                save_training_checkpoint(  # resume: replaces run.save
                    out / f"checkpoint-{step}", model=run.model, processor=run.processor, peft_model=run.peft_model,
                    state_dict=run.strategy.full_state_dict(run.policy, trainable_only=run.peft_model is not None),
                    optimizer=run.optimizer, scheduler=run.scheduler, state=state, keep_last=cfg.save_total_limit,
                    background=background and step != total_steps,  # the last save is awaited
                )
    finally:
        wait_for_saves()  # resume: a background save is finished (or its error raised) before exit
        logger.close()
    return out


if __name__ == "__main__":
    try:
        print(f"run written to {train_resumable(TrainConfig.from_args(sys.argv[1:]))}", flush=True)
    except MMGRPOError as err:
        print(f"resume_worker: error: {err}", file=sys.stderr)
        sys.exit(2)
