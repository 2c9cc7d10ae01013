"""Chat templates, placeholder expansion and box conventions: one file per model family.

from mmgrpo.templates import get_template
template = get_template("qwen2-vl", processor, max_pixels=28 * 28 * 256)

A family defined outside the package is one Python file that registers a template; load it with
`load_template_plugin("path/to/my_template.py")` (the CLI's `--template_plugin`), then use its
name as `--model_type` (see docs/custom_template.md).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

from mmgrpo.errors import ConfigError
from mmgrpo.templates import (  # noqa: F401  (register the families)
    gemma3,
    llava_onevision,
    qwen2,
    qwen2_5_omni,
    qwen2_5_vl,
    qwen2_audio,
    qwen2_vl,
    qwen3_vl,
)
from mmgrpo.templates.base import (
    PromptInputs,
    Template,
    get_template,
    known_templates,
    register_template,
)

__all__ = [
    "PromptInputs",
    "Template",
    "get_template",
    "known_templates",
    "load_template_plugin",
    "register_template",
]

_LOADED_PLUGINS: dict[str, list[str]] = {}  # plugin key -> template names it registered


def load_template_plugin(spec: str) -> list[str]:
    """Import a file (`path/to/my_template.py`) or module (`my_pkg.my_template`) that registers
    templates; returns the names it registered. Loading the same plugin again is a no-op.

    The file runs once as a module named after its path, so its classes pickle (DataLoader
    workers started by fork see it too).
    """
    is_file = spec.endswith(".py") or os.sep in spec or "/" in spec
    key = os.path.realpath(os.path.expanduser(spec)) if is_file else spec
    if key in _LOADED_PLUGINS:
        return list(_LOADED_PLUGINS[key])
    before = set(known_templates())
    try:
        if is_file:
            if not os.path.isfile(key):
                raise ConfigError(f"no such file {key}; give the path of a .py file")
            name = "mmgrpo_template_plugin_" + hashlib.sha256(key.encode()).hexdigest()[:12]
            module_spec = importlib.util.spec_from_file_location(name, key)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        else:
            importlib.import_module(spec)
    except ConfigError as err:
        raise ConfigError(f"template plugin {spec!r}: {err}") from err
    except Exception as err:
        raise ConfigError(f"template plugin {spec!r} failed to load: {type(err).__name__}: {err}") from err
    added = sorted(set(known_templates()) - before)
    if not added:
        raise ConfigError(
            f"template plugin {spec!r} registered no template; decorate a Template subclass with "
            "@register_template('my-family')"
        )
    _LOADED_PLUGINS[key] = added
    return list(added)
