"""Tool calls in a model's turn: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The Qwen2.5 / Hermes convention: each call is one JSON object between the tags; `arguments` is
an object (or, as OpenAI's API writes it, a JSON string holding one). A turn may hold several
calls. A call that cannot be read (bad JSON, no name, arguments that are not an object, a tag
never closed) is still returned, with `error` saying what is wrong, so the environment can
answer it with an error message instead of ignoring it.

    >>> calls = parse_tool_calls('Let me look. <tool_call>{"name": "zoom", "arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>')
    >>> [(c.name, c.arguments, c.error) for c in calls]
    [('zoom', {'bbox_2d': [1, 2, 3, 4]}, None)]
    >>> parse_tool_calls("<answer>red</answer>")
    []
    >>> [c.error for c in parse_tool_calls('<tool_call>{"name": "zoom", "arguments": {</tool_call>')]
    ['the tool call is not valid JSON (Expecting property name enclosed in double quotes at column 32)']
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str | None  # None where the call could not be read
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call cannot run; None for a well-formed call


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` of a turn, in order (an unclosed last tag counts too).

    >>> [c.error for c in parse_tool_calls('<tool_call>{"name": "zoom"')]
    ['the tool call has no closing </tool_call>']
    >>> parse_tool_calls('<tool_call>{"name": "zoom", "arguments": "{\\\\"x\\\\": 1}"}</tool_call>')[0].arguments
    {'x': 1}
    """
    calls = []
    for match in _CALL_RE.finditer(text):
        closed = match.group(0).endswith(CALL_CLOSE)
        calls.append(_read_call(match.group(1)) if closed else ToolCall(None, error=f"the tool call has no closing {CALL_CLOSE}"))
    return calls


def _read_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(None, error=f"the tool call is not valid JSON ({err.msg} at column {err.colno})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"].strip():
        return ToolCall(None, error='a tool call is an object {"name": "<tool>", "arguments": {...}}')
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's API passes arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return ToolCall(call["name"], error=f"the arguments are not valid JSON ({err.msg})")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error=f"the arguments must be an object, not {type(arguments).__name__}")
    return ToolCall(call["name"].strip(), arguments)
