"""A run stopped by a signal saves its last step and says how to resume (`--save_on_signal`).

    stop = StopSignals(cfg.save_on_signal)   # before the loop: the first signal is only noted
    ...                                      # each step: `stop.agreed(strategy)` at the save, True on every rank
    stop.restore()                           # after the loop: the handlers as they were
    stop.raise_if_stopped(out)               # after the run's cleanup: Preempted, exit status 75

SIGTERM (what Slurm, Kubernetes and cloud schedulers send before they kill) and SIGUSR1 (Slurm's
`--signal=USR1@N`) by default. The first signal sets a flag and nothing else: the step in progress
finishes (rollout, update, evaluation), then at its save every rank agrees on the stop (one
all-reduce, so all ranks save the same step together), the checkpoint of that step is written in
the foreground and atomically like every save, the run's files are closed, and the command exits
with status 75 (EX_TEMPFAIL: try again) and one line saying how to resume. The resumed run is the
uninterrupted run, step for step (tests/test_preemption.py).

A second signal exits at once, with status 128 + its number: a save it interrupts leaves a staging
folder that the next save or resume removes, and every earlier checkpoint stays whole (the
atomic saves of mmgrpo/runstate/checkpoint.py guarantee that at any instant).

Under torchrun, torchrun passes a SIGTERM it receives on to every rank (then waits 30 s before it
kills them); a signal sent to the job's process group reaches each rank itself. DataLoader workers
ignore these signals (mmgrpo/data/lifetime.py): they end with their trainer, and a worker killed by
a process-group signal would make the trainer's next batch fail before it could save.
"""

from __future__ import annotations

import os
import signal
import threading

from mmgrpo.errors import MMGRPOError

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, the command may be run again
ALLOWED = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")


class Preempted(MMGRPOError):
    """The run stopped on a signal after saving a checkpoint; the CLI prints it and exits 75."""

    exit_code = EXIT_PREEMPTED


def signal_numbers(names: list[str]) -> list[int]:
    """--save_on_signal as signal numbers ([] for `none`); a ConfigError for another name.

    >>> signal_numbers(["SIGTERM", "USR1"]) == [signal.SIGTERM, signal.SIGUSR1], signal_numbers(["none"])
    (True, [])
    """
    from mmgrpo.errors import ConfigError

    numbers = []
    for name in names or []:
        if str(name).lower() == "none":
            continue
        full = str(name).upper() if str(name).upper().startswith("SIG") else f"SIG{str(name).upper()}"
        if full not in ALLOWED:
            raise ConfigError(f"--save_on_signal {name}: give signal names among {', '.join(ALLOWED)}, or none.")
        numbers.append(int(getattr(signal, full)))
    return numbers


class StopSignals:
    """The handlers of --save_on_signal for the life of the training loop (main thread only)."""

    def __init__(self, names: list[str]):
        self.received: int | None = None  # the first signal's number
        self.stopped_after: int | None = None  # the step every rank agreed to stop after
        self.previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():  # Python sets handlers from the main thread
            return
        for number in signal_numbers(names):
            self.previous[number] = signal.signal(number, self._handle)

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.received is None:
            self.received = number
            # os.write, not print: the handler may run while the progress bar is writing to stderr
            _say(f"mmgrpo: {name} received: finishing the step in progress, then saving a checkpoint "
                 f"({name} again stops at once)")
            return
        from mmgrpo.runstate.run_lock import _release_all

        _say(f"mmgrpo: {name} again: stopping at once; the earlier checkpoints are intact "
             "(resume with --resume_from_checkpoint latest)")
        _release_all()  # the run's lock file goes; the kernel ends everything else
        os._exit(128 + number)

    def agreed(self, strategy, step: int) -> bool:
        """At a step's save, on every rank: True everywhere if any rank received a signal (a collective)."""
        if not self.previous:
            return False
        if strategy.any_rank(self.received is not None):
            self.stopped_after = step
            return True
        return False

    def restore(self) -> None:
        """Put back the handlers there were before (a signal after the loop has its usual effect)."""
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def raise_if_stopped(self, output_dir) -> None:
        """Preempted (exit 75) naming the saved checkpoint, when the loop stopped on a signal."""
        if self.stopped_after is None:
            return
        name = signal.Signals(self.received).name if self.received is not None else "another rank's signal"
        raise Preempted(
            f"stopped by {name} after step {self.stopped_after}: {output_dir}/checkpoint-{self.stopped_after} is saved; "
            "to continue, run the same command with --resume_from_checkpoint latest"
        )


def exit_on_second_interrupt() -> None:
    """Ctrl-C: the first raises KeyboardInterrupt as usual (the command ends cleanly, `interrupted`);
    a second one, while that cleanup runs (awaiting a save, ending DataLoader workers, the interpreter's
    exit), ends the process at once with one line and status 130, instead of a traceback from wherever
    it landed. The earlier checkpoints are whole (atomic saves); a save it cuts short is discarded.
    Main thread only; a forked child (a DataLoader worker) keeps the usual behaviour."""
    if threading.current_thread() is not threading.main_thread():
        return
    owner, seen = os.getpid(), []

    def handle(number, frame):
        if os.getpid() != owner or not seen:
            seen.append(number)
            raise KeyboardInterrupt
        from mmgrpo.runstate.run_lock import _release_all

        _say("mmgrpo: interrupted again: stopping at once; the earlier checkpoints are intact "
             "(resume with --resume_from_checkpoint latest)")
        _release_all()
        os._exit(130)

    signal.signal(signal.SIGINT, handle)


def _say(text: str) -> None:
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass
