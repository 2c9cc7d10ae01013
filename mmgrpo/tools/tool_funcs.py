"""The tool registry, tool plugins, and what a tool is given (`ToolContext`).

A tool is a plain function `f(arguments: dict, context: ToolContext) -> str | PIL.Image | list`:
`arguments` is the call's JSON object, `context` the episode it runs in (the images the model has
seen so far, the sample's dataset columns, the template's box convention). It returns what the
environment says back in the next turn: text, an image, or a list of both in order. Raising is
fine: the model is told the error (mmgrpo/tools/environment.py).

    >>> @register_tool("doc_echo")
    ... def echo(arguments, context):
    ...     return f"you said {arguments.get('text', '')!r}"
    >>> get_tool("doc_echo") is echo
    True
    >>> TOOLS.unregister("doc_echo")  # (keeps the registry as it was for other tests)

`--tools NAME` takes a registered name, `--tools path/to/file.py:fn` a function in your file
(loaded like reward plugins, mmgrpo/registry.py); the tool is called by the name it is
registered under, or by its function name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmgrpo.errors import ConfigError
from mmgrpo.registry import Registry, import_plugin

ToolFunc = Callable[..., Any]


def _load_builtins() -> None:
    # The built-in tools register themselves when the package is imported.
    import mmgrpo.tools  # noqa: F401


TOOLS = Registry("tool", flag="--tools", load=_load_builtins)


@dataclass
class ToolContext:
    """The episode a tool call runs in.

    images: every image the model has seen in this episode, in order: the sample's own, then
    those tools returned in earlier turns (`img_idx` counts over this list).
    image_sizes / input_sizes: (width, height) of each as given and as the model saw it (resized).
    """

    sample_id: str
    images: list  # PIL.Image.Image
    image_sizes: list[tuple[int, int]]
    input_sizes: list[tuple[int, int]]
    columns: dict = field(default_factory=dict)  # the sample's dataset columns (solution, ...)
    template: Any = None  # the model family's template: its box convention and pixel limits
    turn: int = 1  # the model turn that made the call (1 = the first)

    def box_to_image(self, box, img_idx: int = 0) -> list[float]:
        """A box in the model's coordinates, about image `img_idx` -> that image's pixels."""
        return self.template.box_to_image(box, self.image_sizes[img_idx], self.input_sizes[img_idx])

    @property
    def max_pixels(self) -> int | None:
        """The most pixels an image reaches the model with (the template's budget), if it has one."""
        return self.template.max_image_pixels if self.template is not None else None


def register_tool(name: str):
    """Decorator: register a tool under `name` (what `--tools` and the model's call name it).

    A second registration under the same name is a ConfigError, never a silent override.
    """

    def decorator(func: ToolFunc) -> ToolFunc:
        if not callable(func):
            raise ConfigError(f"tool '{name}' must be a function, got {type(func).__name__}")
        TOOLS.register(name, func)
        func.tool_name = name
        return func

    return decorator


def tool_names() -> list[str]:
    """Names of the registered tools, sorted."""
    return TOOLS.names()


def tool_name(func: ToolFunc) -> str:
    """The name the model calls a tool by."""
    return getattr(func, "tool_name", None) or func.__name__


def get_tool(spec: str | ToolFunc) -> ToolFunc:
    """A tool from a registered name or a `path/to/file.py:function` plugin (a callable: itself)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"--tools takes a registered name or 'path/to/file.py:function', got {spec!r}")
    spec = spec.strip()
    if spec in TOOLS or ":" not in spec:
        return TOOLS.get(spec, hint="For your own tool pass 'path/to/file.py:function_name'.")
    path, _, func_name = spec.rpartition(":")
    if not path.endswith(".py") or not func_name:
        raise ConfigError(f"tool plugin '{spec}' must be 'path/to/file.py:function_name'")
    module = import_plugin(path, "tool plugin")
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"tool plugin '{spec}': {path} defines no function '{func_name}'. Functions it defines: {', '.join(found) or 'none'}"
        )
    return func
