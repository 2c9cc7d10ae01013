"""Tools for multi-turn rollouts: the model calls them, the environment answers in the next turn.

    calls.py        `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` read from a turn
    registry.py     `@register_tool("name")`, `file.py:fn` plugins, what a tool gets (ToolContext)
    environment.py  runs a turn's calls with a timeout; every failure becomes an error message
    zoom.py         the built-in `image_zoom_in_tool`: crop a region of an image, enlarged

The rollout engine that drives the turns is mmgrpo/rollout/multiturn.py; docs/tools.md has the
whole recipe.
"""

from mmgrpo.tools.calls import ToolCall, parse_tool_calls
from mmgrpo.tools.environment import ERROR_KINDS, ToolEnvironment, ToolResult
from mmgrpo.tools.tool_funcs import ToolContext, get_tool, register_tool, tool_name, tool_names
from mmgrpo.tools.zoom import image_zoom_in_tool, zoom

__all__ = [
    "ERROR_KINDS",
    "ToolCall",
    "ToolContext",
    "ToolEnvironment",
    "ToolResult",
    "get_tool",
    "image_zoom_in_tool",
    "tool_names",
    "parse_tool_calls",
    "register_tool",
    "tool_name",
    "zoom",
]
