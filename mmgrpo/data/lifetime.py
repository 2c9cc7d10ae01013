"""Child processes that end when their trainer ends, however it ends (kill -9 included).

    make_prompt_loader(..., num_workers=2)      # its workers run WorkerInit(): nothing else to do
    end_with_parent(trainer_pid)                # first thing in any other child process

torch's DataLoader workers notice a dead trainer only between two samples (a check every 5 s),
so a worker busy decoding a long video, or one whose pipe filled up, lives on holding its memory.
Here a child asks the Linux kernel to SIGKILL it when its parent dies (prctl PR_SET_PDEATHSIG),
and a watcher thread also ends it within a second once its parent changes (the backstop for other
platforms and for the case below).

The kernel's signal fires when the *thread* that created the child ends, not the process: it is
only asked for when the child was started from the trainer's main thread (a DataLoader first
iterated in a helper thread relies on the watcher alone).

A DataLoader worker also ignores SIGTERM / SIGUSR1 from anyone but its trainer: a scheduler signals
every process of a job, and the trainer saves a checkpoint on it (mmgrpo/runstate/preemption.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")  # what --save_on_signal may name (SIGINT aside)
WATCH_INTERVAL_S = 0.5


def end_with_parent(parent_pid: int | None = None, *, kernel_signal: bool = True) -> None:
    """Make this (child) process exit as soon as its parent is gone.

    parent_pid: the parent as the child saw it when it started (default: the current parent).
    kernel_signal: also ask Linux for SIGKILL on the parent's death; only safe when the parent
        started this child from its main thread (see the module docstring).
    """
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    if kernel_signal and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    watcher = threading.Thread(target=_watch, args=(parent_pid,), name="end-with-parent", daemon=True)
    watcher.start()


def ignore_stop_signals_from_others(*owners: int) -> None:
    """In a child: SIGTERM, SIGUSR1 ... (STOP_SIGNALS) end it only when its parent or trainer (`owners`)
    sends them, as DataLoader's `terminate()` and its shutdown at exit do; from anyone else they are
    ignored. A scheduler signals every process of a job, and a worker killed under the trainer would
    fail its next batch before the trainer could save (mmgrpo/runstate/preemption.py). The signals
    are blocked in every thread and taken by one thread with `sigwaitinfo`, which tells the sender."""
    if not hasattr(signal, "sigwaitinfo"):  # not on macOS: the signals keep their default effect
        return
    numbers = {getattr(signal, name) for name in STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, numbers)

    def take() -> None:
        while True:
            if signal.sigwaitinfo(numbers).si_pid in owners:
                os._exit(0)

    threading.Thread(target=take, name="stop-signals", daemon=True).start()


@contextlib.contextmanager
def stop_signals_blocked():
    """Hold STOP_SIGNALS back in this thread while it starts child processes: a child inherits the
    mask, so a scheduler's signal that reaches a worker before its `worker_init_fn` has set up
    `ignore_stop_signals_from_others` waits for it instead of killing the worker. The trainer's
    own signals wait too, and arrive (to its handlers) when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {getattr(signal, name) for name in STOP_SIGNALS})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # a dead parent's children are handed to init or a subreaper
        time.sleep(WATCH_INTERVAL_S)
    os._exit(1)


class WorkerInit:
    """DataLoader `worker_init_fn`: one torch thread per worker, and the worker ends with its trainer.

    Picklable (spawn / forkserver start methods); it records whether it was handed to the new
    process from the trainer's main thread, which decides whether the kernel signal is safe.
    """

    def __init__(self):
        self.trainer_pid = os.getpid()
        self.from_main_thread: bool | None = None  # known when pickled (spawn/forkserver); fork: see __call__

    def __getstate__(self):
        return {**self.__dict__, "from_main_thread": threading.current_thread() is threading.main_thread()}

    def __call__(self, worker_id: int) -> None:
        import torch

        # Workers decode and run processors; one thread each keeps them from fighting the trainer.
        torch.set_num_threads(1)
        if self.from_main_thread is None:  # forked: this process's only thread is a copy of the forking one
            self.from_main_thread = threading.current_thread().name == "MainThread"
        parent = os.getppid()
        if parent == 1 or not _alive(self.trainer_pid):  # the trainer died before this worker started
            os._exit(1)
        direct_child = parent == self.trainer_pid  # not started by a forkserver process
        ignore_stop_signals_from_others(parent, self.trainer_pid)  # before any thread starts: they inherit the mask
        end_with_parent(parent, kernel_signal=self.from_main_thread and direct_child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
