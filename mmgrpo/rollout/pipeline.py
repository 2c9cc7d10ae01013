"""When rollouts run: in step (synchronous) or one step ahead of training (asynchronous).

    pipeline = RolloutPipeline(engine, weights, asynchronous=cfg.rollout.async_generate)
    pipeline.sync_weights(); pipeline.start(prompts_1, sampling)       # step 1's rollout
    for step in 1, 2, ...:
        prompts, rollout = pipeline.result()                           # this step's completions
        pipeline.sync_weights(); pipeline.start(prompts_next, sampling) # async: runs while this step trains
        ... train on rollout
        pipeline.policy_updated(step)                                  # the policy's weights are version `step`

`sync_weights` loads the policy's newest weights into an engine that holds its own copy (once
per version; a no-op for an engine on the policy's own module), and `start` refuses to run on
older weights: a rollout is never stale by accident.

Synchronous: `start` generates there and then; every rollout samples from the weights the step
trains. Asynchronous (one-step off-policy, ms-swift's `--async_generate`): after step t's
rollout is taken, the newest weights (version t - 1) are loaded and the next batch is generated
in a background thread while step t trains; step t + 1 then trains on completions of version
t - 1: exactly one step stale, and `Rollout.weight_version` says so. The engine must hold its
own copy of the weights (vLLM, or an in-process engine on a copy of the model): training
changes the policy's weights while the rollout runs. A weight update never overlaps a rollout:
it happens between `result` and `start`.

`weights` is a callable returning the lazy (HF name, tensor) iterable of the policy's current
weights (`lora.rollout_weights`); it is iterated only by engines that hold their own copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

from mmgrpo.rollout.base import Rollout, SamplingParams


class RolloutPipeline:
    def __init__(self, engine, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], *, asynchronous: bool = False):
        if asynchronous and not getattr(engine, "separate_weights", False):
            raise ValueError("asynchronous rollouts need an engine that holds its own copy of the weights")
        self.engine, self.weights, self.asynchronous = engine, weights, asynchronous
        self.version = 0  # optimizer steps the policy's weights have taken
        # seconds the engine spent on the rollouts taken by `result` since `take_generate_seconds`
        # (background when async); counted when a rollout is taken, so a step reports its own rollout's
        self.generate_seconds = 0.0
        self._seconds = 0.0  # of the rollout in flight, written by the thread that generates it
        self._thread: threading.Thread | None = None
        self._result: Rollout | BaseException | None = None
        self._prompts: list | None = None

    def policy_updated(self, version: int) -> None:
        """The policy's weights are now `version` (optimizer steps taken)."""
        self.version = version

    def start(self, prompts: list, sampling: SamplingParams) -> None:
        """Begin the rollout of `prompts`, a step's (Sample, PromptInputs) pairs, on the policy's newest weights."""
        if self._prompts is not None:
            raise RuntimeError("the previous rollout was not taken")
        if getattr(self.engine, "weight_version", 0) != self.version:
            raise RuntimeError(
                f"the rollout engine holds weights of version {self.engine.weight_version}, the policy's are "
                f"{self.version}: call sync_weights() first"
            )
        self._prompts = prompts
        encoded = [enc for _, enc in prompts]
        if not self.asynchronous:
            self._generate(encoded, sampling)
            if isinstance(self._result, BaseException):
                self._prompts, error, self._result = None, self._result, None
                raise error
            return
        self._result = None
        self._thread = threading.Thread(target=self._generate, args=(encoded, sampling), daemon=True)
        self._thread.start()

    def result(self) -> tuple[list, Rollout]:
        """The prompts of the rollout begun last and its completions (waits for them)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        prompts, result = self._prompts, self._result
        self._prompts = self._result = None
        self.generate_seconds, self._seconds = self.generate_seconds + self._seconds, 0.0
        if isinstance(result, BaseException):
            raise result
        return prompts, result

    @property
    def in_flight(self) -> bool:
        """A rollout was started (or restored) and not yet taken by `result`."""
        return self._prompts is not None

    def pending(self) -> tuple[list, Rollout] | None:
        """The rollout in flight, finished (waits for it) but left in place for `result`; None if none.
        A checkpoint saves it: mmgrpo/training/resume.py."""
        if self._prompts is None:
            return None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if isinstance(self._result, BaseException):
            return None  # `result` raises it
        return self._prompts, self._result

    def restore(self, prompts: list, rollout: Rollout, version: int) -> None:
        """Put back a rollout saved in flight (`pending`), with the policy's weights at `version`."""
        if self._prompts is not None:
            raise RuntimeError("a rollout is in flight already")
        self._prompts, self._result, self.version = prompts, rollout, version

    def take_generate_seconds(self) -> float:
        """Seconds the engine spent generating the rollouts taken since the last call."""
        seconds, self.generate_seconds = self.generate_seconds, 0.0
        return seconds

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _generate(self, encoded: list, sampling: SamplingParams) -> None:
        start = time.perf_counter()
        try:
            self._result = self.engine.generate(encoded, sampling)
        except BaseException as error:  # raised in the training thread by `result`
            self._result = error
        self._seconds = time.perf_counter() - start

    def sync_weights(self) -> None:
        """Load the policy's newest weights into the engine (once per version). Not while a rollout runs."""
        if self._thread is not None:
            raise RuntimeError("weights cannot change while a rollout runs: take its result first")
        if getattr(self.engine, "weight_version", 0) != self.version:
            self.engine.update_weights(self.weights(), self.version)
