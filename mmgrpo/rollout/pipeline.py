"""When rollouts run: in step (synchronous), or up to K steps ahead of training (asynchronous with
bounded staleness, `--max_staleness K`; `--async_generate` is K = 1). One call gives the loop the
batch it trains on, so the loop reads the same either way:

    pipeline = RolloutPipeline(setup, batches, policy_weights, total_steps)   # mmgrpo/engine.py's rollout_pipeline(run, batches)
    for step in 1, 2, ...:
        batch = pipeline.next_batch(step, timers)   # prompts and their completions: scored, extra rounds done
        ... train on batch.prompts, batch.rollout
        pipeline.policy_updated(step)               # the policy's weights are now version `step`

The schedule. A version counts the optimizer steps the weights have taken: step t trains version
t - 1, and step t's rollout samples version max(0, t - 1 - K), so its staleness, (t - 1) minus the
version that sampled it, is at most K:

    synchronous (K = 0)   step t draws its prompts, loads version t - 1 into the engine (once per
                          version; nothing for an engine on the policy's own module) and generates.
    asynchronous (K >= 1) once step t's batch is complete, the rollouts of steps t + 1 .. t + K are
                          asked for (the one not asked yet, t + K, on version t - 1, the newest) and
                          a background thread (mmgrpo/rollout/worker.py) generates them in order while
                          the steps train. Step t waits only for what is not ready yet.

K = 1 is one step off-policy: each rollout generates while the step before trains. K = 2 trains
every step two versions stale (from step 3 on) and in exchange lets the rollouts get up to two
steps ahead, so one that takes longer than a step (long answers, a busy rollout server) is hidden
by the slack that the others left. The version a rollout samples is fixed by this schedule, not by
timing: a run is the same however fast its rollouts come back, and a resumed run continues it
exactly (the checkpoint keeps the rollouts in flight: mmgrpo/training/resume.py).

Weights change between rollouts, never during one. Where the worker is idle (K = 1 always: step
t + 1's rollout is asked once step t's is taken) the newest weights are loaded there and then
(time/weight_sync). Where it is still generating (K >= 2, generation behind), the trainer takes a
host copy of the weights to sync (`worker.snapshot`: memory for one copy of the trainable weights
per version waiting) and the worker loads it before the rollout that needs it.

Extra rounds (--dynamic_sample, two-stage generation) run on the same engine after the rollouts
asked before them, on the newest weights (staleness 0).

A rollout staler than K (restored from a checkpoint saved with a larger K, or sampled by an engine
that held other weights than asked) is never trained on: it is dropped (rollout/dropped_stale
counts its completions) and generated again from the same prompts on the newest weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mmgrpo.data.prompt_batches import PromptStream
from mmgrpo.rollout.base import Rollout, SamplingParams
from mmgrpo.rollout.rounds import RolloutSetup, complete_batch
from mmgrpo.rollout.worker import RolloutRequest, RolloutWorker, snapshot


@dataclass
class StepBatch:
    """What a step trains on."""

    prompts: list  # (Sample, PromptInputs) of the B prompts
    rollout: Rollout  # their B x G completions, scored
    metrics: dict[str, float]  # the rounds' (dynamic/*, two_stage/*), rollout/generate_s, rollout/dropped_stale


@dataclass
class Ahead:
    """A rollout asked for a step that has not taken it yet."""

    prompts: list
    position: tuple[int, int]  # (epoch, batch) of the prompt stream where its prompts began
    request: RolloutRequest


def untimed(name: str):
    return nullcontext()


class RolloutPipeline:
    def __init__(self, setup: RolloutSetup, batches: PromptStream,
                 policy_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], total_steps: int):
        """setup: the engine, sampling options, rewards and ranks (mmgrpo/rollout/rounds.py); batches:
        the run's prompt stream; policy_weights: the policy's weights as an engine with its own copy
        loads them (mmgrpo/rollout/weight_sync.py); total_steps: the run's, the last one asked ahead."""
        self.setup, self.batches, self.engine = setup, batches, setup.sampler.engine
        self.total_steps = total_steps
        self.max_staleness = setup.options.staleness_bound  # 0: synchronous
        if self.max_staleness and not self.engine.separate_weights:
            raise ValueError("asynchronous rollouts need an engine that holds its own copy of the weights")
        self.weights = policy_weights
        self.version = 0  # optimizer steps the policy's weights have taken
        self.ahead: dict[int, Ahead] = {}  # by step
        self.worker = RolloutWorker(setup.sampler) if self.max_staleness else None
        # the version the engine holds once everything asked of it has run
        self._asked_version = self.engine.weight_version
        self._generate_seconds = 0.0  # the engine's, on the rollouts the current batch is made of

    def policy_updated(self, version: int) -> None:
        """The policy's weights are now `version` (optimizer steps taken)."""
        self.version = version

    def next_batch(self, step: int, timers: Callable = untimed) -> StepBatch:
        """Step `step`'s prompts and their completions, scored and completed by the extra rounds;
        then the rollouts of the next K steps asked for. `timers(phase)` times data, weight_sync,
        rollout (generating, or waiting for what the worker generates), reward and resample."""
        setup, options = self.setup, self.setup.options
        metrics = {"rollout/dropped_stale": 0} if self.max_staleness else {}
        self._generate_seconds = 0.0
        if step not in self.ahead:  # synchronous, the first step, or a rollout dropped
            self._ask(step, timers)
        ahead = self.ahead.pop(step)
        with timers("rollout"):
            rollout = self._take(ahead.request)
        if (step - 1) - rollout.weight_version > self.max_staleness:  # never trained on
            metrics["rollout/dropped_stale"] += len(rollout)
            self._ask(step, timers, again=ahead)
            with timers("rollout"):
                rollout = self._take(self.ahead.pop(step).request)
        with timers("reward"):
            setup.score(ahead.prompts, rollout)  # the one scoring of these completions
        prompts = ahead.prompts
        if options.dynamic_sample or options.first_stage_generations:  # off: the batch is unchanged
            with timers("resample"):
                prompts, rollout, sampled = complete_batch(setup, prompts, rollout, self.batches, step, generate=self.generate)
            metrics.update(sampled)
        oldest = int(rollout.versions().min())
        if (step - 1) - oldest > self.max_staleness:
            raise RuntimeError(f"step {step} would train on weights of version {oldest}, more than --max_staleness "
                               f"{self.max_staleness} behind the policy's {step - 1}")
        for later in range(step + 1, min(step + self.max_staleness, self.total_steps) + 1):
            if later not in self.ahead:
                self._ask(later, timers)
        metrics["rollout/generate_s"] = self._generate_seconds
        return StepBatch(prompts, rollout, metrics)

    def generate(self, encoded: list, sampling: SamplingParams) -> Rollout:
        """A rollout of `encoded` prompts on the newest weights, now: the extra rounds' (after the
        rollouts asked before it, on the same engine)."""
        return self._take(self._submit(encoded, sampling, untimed))

    def in_flight(self) -> list[tuple[int, tuple[int, int], Rollout]]:
        """(step, where its prompts began in the prompt stream, rollout) of every rollout asked ahead,
        in step order, each finished (waits for it) and left in place. A checkpoint saves them."""
        return [(step, ahead.position, ahead.request.result()) for step, ahead in sorted(self.ahead.items())]

    def restore(self, saved: list[tuple[int, list, tuple[int, int], Rollout]], version: int) -> None:
        """Put back the rollouts a checkpoint saved in flight, (step, prompts, position, rollout)
        each, with the policy's weights at `version`."""
        self.version = version
        for step, prompts, position, rollout in saved:
            self.ahead[step] = Ahead(prompts, position, RolloutRequest.finished(rollout))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def _ask(self, step: int, timers: Callable, again: Ahead | None = None) -> None:
        """Ask for step `step`'s rollout: new prompts from the stream, or those of `again`."""
        if again is None:
            with timers("data"):
                prompts = next(self.batches)
            position = self.batches.last_start
        else:
            prompts, position = again.prompts, again.position
        sampling = self.setup.sampling(prompts, self.setup.step_seed(step))
        request = self._submit([enc for _, enc in prompts], sampling, timers)
        self.ahead[step] = Ahead(prompts, position, request)

    def _submit(self, encoded: list, sampling: SamplingParams, timers: Callable) -> RolloutRequest:
        """A rollout on the newest weights: generated here (synchronous) or asked of the worker."""
        with timers("weight_sync"):
            weights = self._newest_weights()
        if self.worker is not None:
            return self.worker.submit(encoded, sampling, self.version, weights)
        request = RolloutRequest(encoded, sampling, self.version)
        started = time.perf_counter()
        with timers("rollout"):
            request.rollout = self.setup.sampler.generate(encoded, sampling)
        request.seconds = time.perf_counter() - started
        request.done.set()
        return request

    def _newest_weights(self):
        """What the next rollout asked needs to sample the newest weights: nothing where the engine
        will hold them by then (or is loaded now, while idle); else a host copy for the worker."""
        if self._asked_version == self.version:
            return None
        self._asked_version = self.version
        if self.worker is None or self.worker.idle:  # nothing runs: load them now, from the policy itself
            self.engine.update_weights(self.weights(), self.version)
            return None
        return snapshot(self.weights())

    def _take(self, request: RolloutRequest) -> Rollout:
        rollout = request.result()
        self._generate_seconds += request.seconds
        return rollout
