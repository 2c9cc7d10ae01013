"""A time limit on each reward call (`--reward_timeout`), so that a reward that never returns cannot
hang training.

    values = call_with_timeout(func, (completions,), columns, timeout=300, name="llm_judge")

How a call that runs too long is stopped:
- From the main thread (the training loop), the reward runs right there, and a watchdog thread
  sends the main thread a signal at the deadline (a real-time signal, `SIGRTMIN + 2`); its handler
  raises `RewardTimeout` inside the reward, as Ctrl-C would raise KeyboardInterrupt. That
  interrupts Python loops and blocking system calls (a socket read, a sleep) alike, and the
  reward's `except Exception` blocks do not swallow it (it is a BaseException); the signal is
  repeated every second until the call ends. Nothing is left running. A reward stuck inside
  native code that never returns to the interpreter cannot be interrupted: after `GRACE_S` more
  seconds the process exits with status 2 and a one-line message (resume from the latest
  checkpoint), instead of hanging.
- From any other thread (signals reach only the main thread), the reward runs in a daemon thread
  that is abandoned at the deadline: Python cannot kill a thread, so it keeps running (and holding
  what it holds) until it returns by itself, and it does not keep the process from exiting. Until
  it returns, further calls of the same reward fail at once with `RewardTimeout` (at most one
  stuck thread per reward, never a pile of them).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

GRACE_S = 30.0  # after the deadline: how long interrupting may take before the process gives up
TIMEOUT_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") and hasattr(signal, "pthread_kill") else None

_stuck: dict[str, threading.Thread] = {}  # reward name -> its abandoned call, still running
_active: dict = {"call": None}  # the main-thread call the watchdog may interrupt: {"expired": bool}
_handler_installed = False


class RewardTimeout(BaseException):  # noqa: N818 (the reward's own `except Exception` must not catch it)
    """Raised in (or for) a reward call that ran past its time limit."""


def call_with_timeout(func, args: tuple, kwargs: dict, *, timeout: float | None, name: str):
    """`func(*args, **kwargs)`, or RewardTimeout once `timeout` seconds have passed (None or 0: no limit)."""
    if not timeout:
        return func(*args, **kwargs)
    if TIMEOUT_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        return _in_main_thread(func, args, kwargs, timeout, name)
    return _in_worker_thread(func, args, kwargs, timeout, name)


def _on_signal(signum, frame):
    call = _active["call"]
    if call is not None and call["expired"] and not call["done"]:
        raise RewardTimeout()
    # otherwise a late signal of a call that has ended: ignored


def _in_main_thread(func, args, kwargs, timeout: float, name: str):
    global _handler_installed
    if not _handler_installed:  # installed once and never restored: a late signal is always harmless
        signal.signal(TIMEOUT_SIGNAL, _on_signal)
        _handler_installed = True
    call = {"expired": False, "done": False}
    finished = threading.Event()
    main_thread = threading.get_ident()

    def watchdog():
        if finished.wait(timeout):
            return
        call["expired"] = True
        give_up = time.monotonic() + GRACE_S
        while not finished.is_set():
            signal.pthread_kill(main_thread, TIMEOUT_SIGNAL)
            if finished.wait(1.0):
                return
            if time.monotonic() > give_up:
                print(
                    f"mmgrpo: reward '{name}' has run {timeout + GRACE_S:.0f} s, past --reward_timeout {timeout:g}, and "
                    "cannot be interrupted (it is inside native code): exiting. Resume with --resume_from_checkpoint latest.",
                    file=sys.stderr, flush=True,
                )
                os._exit(2)

    _active["call"] = call
    guard = threading.Thread(target=watchdog, name=f"reward timeout {name}", daemon=True)
    guard.start()
    try:
        result = func(*args, **kwargs)
        call["done"] = True
    except RewardTimeout:
        call["done"] = True
        raise
    finally:
        call["done"] = True
        finished.set()
        _active["call"] = None
        guard.join()
    if call["expired"]:  # returned, but only after the deadline (a signal came too late to interrupt it)
        raise RewardTimeout()
    return result


def _in_worker_thread(func, args, kwargs, timeout: float, name: str):
    previous = _stuck.get(name)
    if previous is not None:
        if previous.is_alive():
            raise RewardTimeout("still running")
        del _stuck[name]
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = func(*args, **kwargs)
        except BaseException as err:  # noqa: B036 (handed to the caller's thread)
            outcome["error"] = err

    worker = threading.Thread(target=run, name=f"reward {name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        _stuck[name] = worker
        raise RewardTimeout()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
