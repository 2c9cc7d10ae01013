"""mmgrpo's extension points: one small registry type, and loading user code that adds to one.

Rewards, tools, templates, loss types and advantage estimators are each a `Registry`: names to
objects, a second registration under a name is an error, and an unknown name is the same
one-line ConfigError everywhere, naming the flag and the choices.

    >>> colours = Registry("colour", flag="--colour")
    >>> red = colours.register("red", "#f00")
    >>> colours.get("red"), colours.names()
    ('#f00', ['red'])
    >>> colours.get("blue")
    Traceback (most recent call last):
    ...
    mmgrpo.errors.ConfigError: unknown colour 'blue' (--colour); choose one of: red

User code comes from `import_plugin`: a `.py` file or an importable module, executed once.
Templates (`--template_plugin my_template.py`), rewards (`--reward_funcs my_reward.py:fn`) and
tools come from the same loader, so all behave alike: a file runs once as a module named after
its absolute path (so its classes and functions pickle for DataLoader workers), loading it again
returns the same module, and a failing import is a ConfigError naming the file.

    >>> import math
    >>> import_plugin("math") is math
    True

An import is bounded in time ($MMGRPO_PLUGIN_TIMEOUT seconds, default 120): a plugin that loops,
sleeps or waits for input at import is interrupted (a signal to the main thread) and becomes a
ConfigError naming the file; one that cannot be interrupted (it swallows the interruption, or waits
in native code with the GIL released) ends the process `GRACE_S` seconds later with one line naming the file, instead of
hanging the run. A plugin that calls `sys.exit` while importing is a ConfigError too.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from mmgrpo.errors import ConfigError


class Registry:
    """Names -> objects at one extension point.

    kind: what is registered, as errors say it ("reward", "loss type"); flag: the option that
    names one (`--reward_funcs`); normalise: the key a name is stored under (templates accept
    'qwen2_5_vl' for 'qwen2.5-vl'); load: called before the first lookup (imports the built-ins).
    """

    def __init__(self, kind: str, flag: str | None = None, *, normalise: Callable[[str], str] | None = None,
                 load: Callable[[], None] | None = None):
        self.kind, self.flag = kind, flag
        self._normalise = normalise or (lambda name: name)
        self._load = load
        self._entries: dict[str, tuple[str, Any]] = {}  # key -> (name as registered, object)

    def register(self, name: str, obj: Any = None):
        """`register(name, obj)` adds obj and returns it; `@register(name)` decorates. A name taken
        already is a ConfigError, never a silent override."""
        if obj is None:
            return lambda decorated: self.register(name, decorated)
        key = self._normalise(name)
        if key in self._entries:
            raise ConfigError(f"{self.kind} {name!r} is already registered (by {describe(self._entries[key][1])}); "
                              f"choose another name for {describe(obj)}")
        self._entries[key] = (name, obj)
        return obj

    def unregister(self, name: str) -> None:
        self._entries.pop(self._normalise(name), None)

    def get(self, name: str, hint: str = "") -> Any:
        """The object registered as `name`; else the ConfigError every registry raises (`hint`: what
        else the flag accepts, e.g. a plugin form)."""
        self._ensure_loaded()
        entry = self._entries.get(self._normalise(name)) if isinstance(name, str) else None
        if entry is None:
            where = f" ({self.flag})" if self.flag else ""
            raise ConfigError(f"unknown {self.kind} {name!r}{where}; choose one of: {', '.join(self.names())}"
                              + (f". {hint}" if hint else ""))
        return entry[1]

    def names(self) -> list[str]:
        """The registered names, sorted."""
        self._ensure_loaded()
        return sorted(name for name, _ in self._entries.values())

    def items(self) -> list[tuple[str, Any]]:
        self._ensure_loaded()
        return sorted(self._entries.values(), key=lambda entry: entry[0])

    def __contains__(self, name: str) -> bool:
        self._ensure_loaded()
        return self._normalise(name) in self._entries

    def _ensure_loaded(self) -> None:
        if self._load is not None:
            load, self._load = self._load, None
            load()


def describe(obj) -> str:
    """Where an object comes from, for errors: `module.qualname`."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"

_LOADED: dict[str, ModuleType] = {}  # absolute file path or module name -> module


def is_file_spec(spec: str) -> bool:
    """A file path (`x.py`, `dir/x`) rather than a dotted module name."""
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def import_plugin(spec: str, what: str = "plugin") -> ModuleType:
    """The module of a `.py` file path or a module name, imported once.

    `what` names the kind of plugin in errors ("template plugin", "reward plugin").
    """
    key = os.path.realpath(os.path.expanduser(spec)) if is_file_spec(spec) else spec
    if key in _LOADED:
        return _LOADED[key]
    with _bounded_import(spec, what):
        return _import(spec, what, key)


PLUGIN_TIMEOUT_S = 120.0  # importing torch and transformers on a slow shared disk stays well under it
IMPORT_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") and hasattr(signal, "pthread_kill") else None
GRACE_S = 10.0  # past the time limit (at most the limit again): how long the interruption may take before the process ends


class _ImportTimeout(BaseException):  # noqa: N818 (a plugin's own `except Exception` must not swallow it)
    pass


def _plugin_timeout() -> float:
    value = os.environ.get("MMGRPO_PLUGIN_TIMEOUT", "")
    try:
        timeout = float(value) if value else PLUGIN_TIMEOUT_S
    except ValueError:
        raise ConfigError(f"$MMGRPO_PLUGIN_TIMEOUT={value!r} is not a number of seconds") from None
    if not timeout > 0 or timeout == float("inf"):
        raise ConfigError(f"$MMGRPO_PLUGIN_TIMEOUT={value!r}: give a positive, finite number of seconds")
    return timeout


class _bounded_import:  # noqa: N801 (used as a context manager, like contextlib's)
    """The import of `spec` in a time limit. A watchdog thread waits; at the limit it signals the main
    thread (a real-time signal, as mmgrpo/rewards/timeout.py does), whose handler raises inside the
    import, every 0.2 s until it ends; past the grace period it ends the process with one line."""

    def __init__(self, spec: str, what: str):
        self.spec, self.what, self.timeout = spec, what, _plugin_timeout()
        self.grace = min(GRACE_S, self.timeout)
        self.done, self.expired = threading.Event(), False
        self.interrupt = (IMPORT_SIGNAL is not None and threading.current_thread() is threading.main_thread())
        self.main = threading.get_ident()

    def __enter__(self):
        if self.interrupt:
            self.previous = signal.signal(IMPORT_SIGNAL, self._interrupt)
        threading.Thread(target=self._watch, name=f"import {self.spec}", daemon=True).start()

    def _interrupt(self, signum, frame):
        if self.expired and not self.done.is_set():  # a late signal, after the import ended: ignored
            raise _ImportTimeout()

    def _watch(self):
        if self.done.wait(self.timeout):
            return
        self.expired = True
        give_up = time.monotonic() + (self.grace if self.interrupt else 0)
        while self.interrupt and time.monotonic() < give_up:
            signal.pthread_kill(self.main, IMPORT_SIGNAL)
            if self.done.wait(0.2):
                return
        try:
            os.write(2, (f"mmgrpo: error: {self.what} {self.spec!r} has been importing for "
                         f"{self.timeout + (self.grace if self.interrupt else 0):.0f} s and cannot be interrupted (an "
                         "endless loop or a wait at module level?): exiting. Fix the file, or raise "
                         "$MMGRPO_PLUGIN_TIMEOUT if it is only slow\n").encode())
        finally:
            os._exit(2)

    def __exit__(self, kind, error, traceback):
        self.done.set()
        if self.interrupt:
            signal.signal(IMPORT_SIGNAL, self.previous)
        if kind is _ImportTimeout:
            raise ConfigError(
                f"{self.what} {self.spec!r} did not finish importing within {self.timeout:g} s "
                "($MMGRPO_PLUGIN_TIMEOUT): an endless loop or a wait at module level? Fix the file, or raise "
                "the limit if it is only slow"
            ) from None
        if kind is not None and issubclass(kind, SystemExit):
            raise ConfigError(
                f"{self.what} {self.spec!r} called sys.exit({error.code!r}) while importing; a plugin must "
                "define its functions or classes without ending the program"
            ) from None
        return False


def _import(spec: str, what: str, key: str) -> ModuleType:
    if not is_file_spec(spec):
        try:
            module = importlib.import_module(spec)
        except ConfigError as err:
            raise ConfigError(f"{what} {spec!r}: {err}") from err
        except Exception as err:
            raise ConfigError(f"{what} {spec!r} failed to load: {type(err).__name__}: {err}") from err
        _LOADED[key] = module
        return module
    if not os.path.isfile(key):
        raise ConfigError(
            f"{what} {spec!r}: file not found (looked at {key}); give a path relative to the working "
            "directory or an absolute one"
        )
    stem = os.path.splitext(os.path.basename(key))[0]
    name = f"mmgrpo_plugin_{stem}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    module_spec = importlib.util.spec_from_file_location(name, key)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except ConfigError as err:
        del sys.modules[name]
        raise ConfigError(f"{what} {spec!r}: {err}") from err
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(
            f"{what} {spec!r} failed to load: {type(err).__name__}: {err}; "
            f"fix the file (run `python {spec}` to see the full error)"
        ) from err
    except BaseException:  # Ctrl-C while importing: no half-imported module left behind
        del sys.modules[name]
        raise
    _LOADED[key] = module
    return module
