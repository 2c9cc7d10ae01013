"""The environment of a multi-turn rollout: it runs the tool calls of a model's turn and says
what goes back to the model in the next turn.

    env = ToolEnvironment.from_specs(["image_zoom_in_tool", "my_tools.py:search"], timeout=10)
    results = env.answer(turn_text, context)   # one ToolResult per call; [] when the turn calls nothing

Nothing a model writes or a tool does stops the rollout. Each of these becomes an error message
that the model reads in the next turn, and is counted (`ToolResult.error` names the kind, the
step logs `tools/errors`):

    parse     the call is not `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    unknown   the name is not one of the run's tools (the message lists them)
    raised    the tool raised (the message gives the exception's type and text)
    timeout   the tool did not return within `timeout` seconds
    result    the tool returned something other than text, an image, or a list of those

A tool that times out cannot be stopped from Python: its thread is left to finish in the
background (a daemon thread, so it never holds up the process's exit) and its result is dropped.
Tools run one after another, so keep them quick and free of shared state.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import PIL.Image

from mmgrpo.errors import ConfigError
from mmgrpo.tools.calls import ToolCall, parse_tool_calls
from mmgrpo.tools.tool_funcs import ToolContext, ToolFunc, get_tool, tool_name

logger = logging.getLogger("mmgrpo.tools")
ERROR_KINDS = ("parse", "unknown", "raised", "timeout", "result")


@dataclass
class ToolResult:
    """What one call sends back: a tool message's content parts and its images, in order."""

    parts: list[dict]  # {"type": "text", "text": ...} | {"type": "image"}
    images: list = field(default_factory=list)  # PIL images, one per image part
    error: str | None = None  # one of ERROR_KINDS, or None
    seconds: float = 0.0

    @classmethod
    def failure(cls, kind: str, message: str) -> ToolResult:
        return cls([{"type": "text", "text": f"Error: {message}"}], error=kind)


class ToolEnvironment:
    """The run's tools (by the name the model calls them) and how long a call may take."""

    def __init__(self, tools: list[ToolFunc], timeout: float = 10.0):
        self.tools: dict[str, ToolFunc] = {}
        for func in tools:
            name = tool_name(func)
            if name in self.tools:
                raise ConfigError(f"--tools names two tools called {name!r}; each tool needs its own name")
            self.tools[name] = func
        self.timeout = timeout
        self._warned: set[str] = set()

    @classmethod
    def from_specs(cls, specs: list[str], timeout: float = 10.0) -> ToolEnvironment:
        """`--tools` values (registered names, `file.py:fn` plugins) -> an environment."""
        return cls([get_tool(spec) for spec in specs], timeout=timeout)

    def answer(self, text: str, context: ToolContext) -> list[ToolResult]:
        """Run every tool call in a model turn's text, in order; [] when it makes none."""
        return [self.run(call, context) for call in parse_tool_calls(text)]

    def run(self, call: ToolCall, context: ToolContext) -> ToolResult:
        """One call -> its result, or an error message the model can act on."""
        if call.error is not None:
            return ToolResult.failure(
                "parse", f'{call.error}. Write <tool_call>{{"name": "<tool>", "arguments": {{...}}}}</tool_call>.'
            )
        func = self.tools.get(call.name)
        if func is None:
            return ToolResult.failure("unknown", f"unknown tool {call.name!r}; the tools are {', '.join(self.tools)}.")
        start = time.perf_counter()
        outcome: dict = {}

        def target():
            try:
                outcome["value"] = func(call.arguments, context)
            except Exception as err:  # the model is told; the run goes on
                outcome["error"] = err

        thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        seconds = time.perf_counter() - start
        if thread.is_alive():
            self._warn_once(call.name, f"tool {call.name!r} timed out after {self.timeout:g} s (--tool_timeout)")
            result = ToolResult.failure("timeout", f"{call.name} timed out after {self.timeout:g} s.")
        elif "error" in outcome:
            err = outcome["error"]
            self._warn_once(call.name, f"tool {call.name!r} raised {type(err).__name__}: {err}")
            result = ToolResult.failure("raised", f"{call.name} failed: {type(err).__name__}: {err}")
        else:
            result = self._as_result(call.name, outcome.get("value"))
        result.seconds = seconds
        return result

    def _as_result(self, name: str, value) -> ToolResult:
        items = value if isinstance(value, (list, tuple)) else [value]
        parts, images = [], []
        for item in items:
            if isinstance(item, str):
                parts.append({"type": "text", "text": item})
            elif isinstance(item, PIL.Image.Image):
                parts.append({"type": "image"})
                images.append(item.convert("RGB"))
            else:
                self._warn_once(name, f"tool {name!r} returned {type(item).__name__}: a tool returns str, a PIL image, or a list of those")
                return ToolResult.failure("result", f"{name} returned {type(item).__name__}, not text or an image.")
        return ToolResult(parts, images)

    def _warn_once(self, name: str, message: str) -> None:
        """The run's log hears about a failing tool once; the model hears about every failure."""
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("%s (the model gets an error message; counted as tools/errors)", message)
