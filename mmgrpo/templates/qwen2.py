"""Qwen2 / Qwen2.5 text models: ChatML, no media, plain 1-D positions (text-only GRPO).

The same ChatML serves the Qwen2.5 instruct models; their default system prompt differs
("You are Qwen, created by Alibaba Cloud. ..."): give it in the dataset's system turn to match.
"""

from __future__ import annotations

from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import render_chatml

DEFAULT_SYSTEM = "You are a helpful assistant."


@register_template("qwen2")
class Qwen2Template(Template):
    """Template of the Qwen2 / Qwen2.5 text models; takes text only."""

    hf_model_types = ("qwen2",)  # config.json model_type(s): --model_type is inferred from them

    components = {
        "backbone": "model",  # the decoder without lm_head: returns last_hidden_state
        "llm": "model",
        "lm_head": "lm_head",
    }
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    shared_prefix = True
    lean_decode = True

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML with a default system turn."""
        return render_chatml(
            messages, lambda part: part.get("text", ""), DEFAULT_SYSTEM, add_generation_prompt
        )
