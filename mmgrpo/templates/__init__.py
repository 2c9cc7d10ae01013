"""Chat templates, placeholder expansion and box conventions: one file per model family.

from mmgrpo.templates import get_template
template = get_template("qwen2-vl", processor, max_pixels=28 * 28 * 256)

A family defined outside the package is one Python file that registers a template; load it with
`load_template_plugin("path/to/my_template.py")` (the CLI's `--template_plugin`), then use its
name as `--model_type` (see docs/custom_template.md).
"""

from __future__ import annotations

from mmgrpo.errors import ConfigError
from mmgrpo.registry import import_plugin
from mmgrpo.templates import (  # noqa: F401  (register the families)
    gemma3,
    gemma4,
    generic,
    glm4v,
    internvl,
    llava_onevision,
    qwen2,
    qwen2_5_omni,
    qwen2_5_vl,
    qwen2_audio,
    qwen2_vl,
    qwen3_5,
    qwen3_5_moe,
    qwen3_omni,
    qwen3_vl,
    qwen3_vl_moe,
)
from mmgrpo.templates.base import (
    PromptInputs,
    Template,
    get_template,
    register_template,
    template_names,
    templates_for_hf_type,
)

__all__ = [
    "PromptInputs",
    "Template",
    "get_template",
    "template_names",
    "load_template_plugin",
    "register_template",
    "templates_for_hf_type",
]

_LOADED_PLUGINS: dict[int, list[str]] = {}  # id(module) -> template names it registered


def load_template_plugin(spec: str) -> list[str]:
    """Import a file (`path/to/my_template.py`) or module (`my_pkg.my_template`) that registers
    templates; returns the names it registered. Loading the same plugin again is a no-op.
    """
    before = set(template_names())
    module = import_plugin(spec, "template plugin")
    if id(module) in _LOADED_PLUGINS:
        return list(_LOADED_PLUGINS[id(module)])
    added = sorted(set(template_names()) - before)
    if not added:
        raise ConfigError(
            f"template plugin {spec!r} registered no template; decorate a Template subclass with "
            "@register_template('my-family')"
        )
    _LOADED_PLUGINS[id(module)] = added
    return list(added)
