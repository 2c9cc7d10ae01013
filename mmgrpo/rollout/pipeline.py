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

Partial rollouts (`--partial_rollouts`, K >= 2). A rollout asked ahead does not finish on the
weights it was asked on: it pauses at every weight update and continues on the new weights, so
its later tokens are fresher. Once step t's batch is taken, every rollout in flight gets one more
chunk on version t - 1 (oldest step first): a rollout taken at the next step finishes (its last
chunk), the others decode C more tokens per completion (C: --partial_rollout_tokens, else
ceil(--max_completion_length / K)); the rollout of step t + K gets its first chunk, also of C
tokens. So step s's rollout is generated in K chunks (fewer in the first steps) on versions
s - 1 - K .. s - 2, and its first tokens bound its staleness: K, as without the flag. With K = 2:

    after step t's batch   chunk on version t - 1
    t = 1                  rollout 2: whole (its first chunk is its last), rollout 3: tokens 0 .. C - 1
    t = 2                  rollout 3: tokens C .. end,                     rollout 4: tokens 0 .. C - 1
    t = 3                  rollout 4: tokens C .. end,                     rollout 5: tokens 0 .. C - 1

A completion that ended in an earlier chunk is not continued. A continued chunk feeds the tokens
so far back teacher-forced (their K/V recomputed on the new weights, the tokens and their log-probs
kept: `SharedPrefixRollout.continue_`), and every token carries the version that sampled it
(`Rollout.token_versions`; the importance correction reads each token's own log-prob). Which
version samples which tokens is fixed by this schedule, so a run is as reproducible as without
the flag, and on weights that do not change (--learning_rate 0) it is the same run. A checkpoint
keeps the paused rollouts (`in_flight`), and the resumed run continues them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mmgrpo.data.prompt_batches import PromptStream
from mmgrpo.errors import ConfigError
from mmgrpo.rollout.base import PartialRollout, Rollout, SamplingParams
from mmgrpo.rollout.rounds import RolloutSetup, complete_batch
from mmgrpo.rollout.worker import RolloutRequest, RolloutWorker, snapshot


@dataclass
class StepBatch:
    """What a step trains on."""

    prompts: list  # (Sample, PromptInputs) of the B prompts
    rollout: Rollout  # their B x G completions, scored
    # the rounds' (dynamic/*, two_stage/*), rollout/generate_s, rollout/dropped_stale, partial/* (--partial_rollouts)
    metrics: dict[str, float]


@dataclass
class Ahead:
    """A rollout asked for a step that has not taken it yet."""

    prompts: list
    position: tuple[int, int]  # (epoch, batch) of the prompt stream where its prompts began
    request: RolloutRequest  # under --partial_rollouts its latest chunk's
    chunks: int = 1  # --partial_rollouts: chunks asked so far; chunk j stops at decode step j * C


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
        self.partial = setup.options.partial_rollouts  # rollouts ahead continue on each new version
        self.chunk_tokens = setup.options.chunk_tokens
        if self.partial and not self.engine.can_pause:
            raise ConfigError(f"--partial_rollouts: the rollout engine {type(self.engine).__name__} cannot pause a rollout; "
                              "partial rollouts need the in-process shared-prefix engine (a model whose template declares "
                              "shared_prefix) or vLLM (--use_vllm), or drop --partial_rollouts.")
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
        if self.partial:  # every rollout in flight: one more chunk on the newest weights, the next step's last
            for later in sorted(self.ahead):
                self._continue(later, last=later == step + 1, timers=timers)
        for later in range(step + 1, min(step + self.max_staleness, self.total_steps) + 1):
            if later not in self.ahead:
                self._ask(later, timers, chunked=self.partial and later > step + 1)
        metrics["rollout/generate_s"] = self._generate_seconds
        if self.partial:
            metrics.update(partial_rollout_metrics(rollout, step))
        return StepBatch(prompts, rollout, metrics)

    def generate(self, encoded: list, sampling: SamplingParams) -> Rollout:
        """A rollout of `encoded` prompts on the newest weights, now: the extra rounds' (after the
        rollouts asked before it, on the same engine)."""
        return self._take(self._submit(encoded, sampling, untimed))

    def in_flight(self) -> list[tuple[int, tuple[int, int], Rollout | PartialRollout, int]]:
        """(step, where its prompts began in the prompt stream, rollout, chunks asked) of every rollout
        asked ahead, in step order, each finished (waits for it) and left in place; under
        --partial_rollouts a rollout not on its last chunk yet is a PartialRollout. A checkpoint saves them."""
        return [(step, ahead.position, ahead.request.result(), ahead.chunks) for step, ahead in sorted(self.ahead.items())]

    def restore(self, saved: list[tuple[int, list, tuple[int, int], Rollout | PartialRollout, int]], version: int) -> None:
        """Put back the rollouts a checkpoint saved in flight, (step, prompts, position, rollout, chunks
        asked) each, with the policy's weights at `version`; a paused one continues at the next step."""
        self.version = version
        for step, prompts, position, rollout, chunks in saved:
            request = RolloutRequest.finished(rollout)
            if isinstance(rollout, PartialRollout):  # paused at that decode step: the next step continues it
                request.until = rollout.steps
            self.ahead[step] = Ahead(prompts, position, request, chunks)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def _ask(self, step: int, timers: Callable, again: Ahead | None = None, chunked: bool = False) -> None:
        """Ask for step `step`'s rollout: new prompts from the stream, or those of `again`.
        chunked: only its first chunk (--partial_rollouts), C tokens per completion."""
        if again is None:
            with timers("data"):
                prompts = next(self.batches)
            position = self.batches.last_start
        else:
            prompts, position = again.prompts, again.position
        sampling = self.setup.sampling(prompts, self.setup.step_seed(step))
        until = self.chunk_tokens if chunked else None
        request = self._submit([enc for _, enc in prompts], sampling, timers, until=until)
        self.ahead[step] = Ahead(prompts, position, request)

    def _continue(self, step: int, last: bool, timers: Callable) -> None:
        """The next chunk of step `step`'s rollout in flight, on the newest weights: C more tokens per
        completion, or to the end where `last` (--partial_rollouts)."""
        ahead = self.ahead[step]
        if ahead.request.until is None:  # its last chunk asked already (or asked whole)
            return
        ahead.chunks += 1
        until = None if last else ahead.chunks * self.chunk_tokens
        sampling = self.setup.sampling(ahead.prompts, self.setup.step_seed(step))  # the seed of its first chunk
        ahead.request = self._submit([enc for _, enc in ahead.prompts], sampling, timers, resume=ahead.request, until=until)

    def _submit(self, encoded: list, sampling: SamplingParams, timers: Callable, resume: RolloutRequest | None = None,
                until: int | None = None) -> RolloutRequest:
        """A rollout on the newest weights: generated here (synchronous) or asked of the worker;
        resume / until: a chunk of one (--partial_rollouts, the worker's `RolloutRequest`)."""
        with timers("weight_sync"):
            weights = self._newest_weights()
        if self.worker is not None:
            return self.worker.submit(encoded, sampling, self.version, weights, resume=resume, until=until)
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


def partial_rollout_metrics(rollout: Rollout, step: int) -> dict[str, float]:
    """--partial_rollouts: the share of completions whose tokens came from more than one weight
    version (continued after a weight update), and the mean staleness of their tokens, each token
    (step - 1) minus the version that sampled it (the rows' own, `rollout/staleness`, is their oldest).

    >>> ids = torch.tensor([[5, 6, 2], [7, 2, 0]])
    >>> rollout = Rollout(ids, torch.tensor([[1, 1, 1], [1, 1, 0]]), torch.tensor([False, False]), weight_version=1,
    ...                   token_versions=torch.tensor([[1, 2, 2], [1, 1, 0]]))
    >>> partial_rollout_metrics(rollout, step=4)   # policy version 3: tokens 2, 1, 1 and 2, 2 steps behind
    {'partial/continued_frac': 0.5, 'partial/token_staleness_mean': 1.6}
    """
    mask = rollout.model_mask.bool()  # [N, T]
    versions = rollout.tokens_versions()  # [N, T]
    newest = versions.masked_fill(~mask, torch.iinfo(versions.dtype).min).amax(1)  # [N]
    continued = newest > rollout.versions()
    staleness = ((step - 1) - versions)[mask].double()
    return {"partial/continued_frac": float(continued.double().mean()),
            "partial/token_staleness_mean": float(staleness.mean()) if staleness.numel() else 0.0}
