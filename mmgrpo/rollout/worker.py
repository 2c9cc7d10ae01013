"""One background thread that runs rollouts on an engine in the order they were asked for, and
loads the weights each one needs between them, never during one.

    worker = RolloutWorker(sampler)                                                  # a RolloutSampler
    request = worker.submit(encoded_prompts, sampling, version=3, weights=snapshot)   # returns at once
    ...                                                                              # the trainer trains
    rollout = request.result()                                                       # its completions (or its error)

A request names the weights version it must sample from. Where the engine holds another, the
request carries those weights (`snapshot`: copies the training thread took while that version was
the policy's, since the policy's own tensors change under an optimizer step) and the worker
loads them first. Requests run first come, first served; the pipeline (mmgrpo/rollout/pipeline.py)
asks for versions that never go down, so each version is loaded once and the engine's weights
never change while it generates.

Under --partial_rollouts a request may be one chunk of a rollout (`resume`: the request of the
chunk before it, which ran first; `until`: the decode step it stops at), on newer weights than the
chunk before: the weights change between chunks, never during one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from mmgrpo.rollout.base import PartialRollout, Rollout, RolloutSampler, SamplingParams


def snapshot(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Host copies of (name, tensor) pairs that later in-place updates cannot reach."""
    return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named_tensors]


@dataclass(eq=False)
class RolloutRequest:
    """One rollout asked of the worker, and, once `done` is set, its result."""

    encoded: list  # the prompts' PromptInputs
    sampling: SamplingParams
    version: int  # the weights it samples from
    weights: list[tuple[str, torch.Tensor]] | None = None  # those weights, where the engine may hold others
    # --partial_rollouts: a chunk of a rollout, continuing the chunk `resume` asked before it (None: the first),
    # up to decode step `until` (None: to the end, its result a Rollout; else a PartialRollout)
    resume: RolloutRequest | None = None
    until: int | None = None
    rollout: Rollout | PartialRollout | None = None
    error: BaseException | None = None
    seconds: float = 0.0  # the engine's time on it: loading its weights, then generating (with its earlier chunks')
    done: threading.Event = field(default_factory=threading.Event)

    def result(self) -> Rollout | PartialRollout:
        """The rollout, once generated (waits); its error raised here, in the caller's thread."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.rollout

    @classmethod
    def finished(cls, rollout: Rollout | PartialRollout) -> RolloutRequest:
        """A request whose rollout (or paused rollout) is already known (restored from a checkpoint)."""
        version = int(rollout.token_versions.max()) if isinstance(rollout, PartialRollout) else rollout.weight_version
        request = cls(encoded=[], sampling=None, version=version, rollout=rollout)
        request.done.set()
        return request


class RolloutWorker:
    def __init__(self, sampler: RolloutSampler):
        """sampler: the engine that generates (its own copy of the weights), under the policy's autocast."""
        self.sampler, self.engine = sampler, sampler.engine
        self._queue: deque[RolloutRequest] = deque()
        self._running = False
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="rollout-worker", daemon=True)  # started by `submit`

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing waits: the engine may be used from another thread until the next `submit`."""
        with self._changed:
            return not self._queue and not self._running

    def submit(self, encoded: list, sampling: SamplingParams, version: int,
               weights: list[tuple[str, torch.Tensor]] | None = None, *, resume: RolloutRequest | None = None,
               until: int | None = None) -> RolloutRequest:
        """A rollout of `encoded` on weights `version` (`weights`: their copy, where the engine may hold
        others); with `resume` / `until`, a chunk of one (`RolloutRequest`, --partial_rollouts)."""
        request = RolloutRequest(encoded, sampling, version, weights, resume=resume, until=until)
        with self._changed:
            if self._closed:
                raise RuntimeError("the rollout worker is closed")
            if not self._thread.is_alive():
                self._thread.start()
            self._queue.append(request)
            self._changed.notify_all()
        return request

    def close(self) -> None:
        """Drop what waits, let the running rollout finish, end the thread."""
        with self._changed:
            self._closed = True
            self._queue.clear()
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                request = self._queue.popleft()
                self._running = True
            started = time.perf_counter()
            earlier = 0.0 if request.resume is None else request.resume.seconds  # the chunks before it ran first
            try:
                request.rollout = self._run(request)
            except BaseException as error:  # raised in the caller's thread by `wait`
                request.error = error
            request.weights = None  # the copies go as soon as they are loaded
            request.seconds = earlier + time.perf_counter() - started
            with self._changed:
                self._running = False
                request.done.set()
                self._changed.notify_all()

    def _run(self, request: RolloutRequest) -> Rollout:
        if self.engine.weight_version != request.version:
            if request.weights is None:
                raise RuntimeError(f"a rollout of weights version {request.version} came with no weights, and the engine "
                                   f"holds version {self.engine.weight_version}")
            self.engine.update_weights(request.weights, request.version)
        if request.resume is None and request.until is None:  # a whole rollout
            return self.sampler.generate(request.encoded, request.sampling)
        # a chunk: the one before it ran first (requests run in order); its paused rollout goes on here
        resume = None if request.resume is None else request.resume.result()
        request.resume = None  # the chunks before are not held longer than needed
        if request.until is None:  # the last chunk: finished
            return self.sampler.generate(request.encoded, request.sampling, resume=resume)
        return self.sampler.continue_(request.encoded, request.sampling, resume, request.until)
