"""Loading user code: a `.py` file or an importable module, executed once.

Templates (`--template_plugin my_template.py`) and rewards (`--reward_funcs my_reward.py:fn`)
come from the same loader, so both behave alike: a file runs once as a module named after its
absolute path (so its classes and functions pickle for DataLoader workers), loading it again
returns the same module, and a failing import is a ConfigError naming the file.

    >>> import math
    >>> import_plugin("math") is math
    True
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType

from mmgrpo.errors import ConfigError

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
