"""Qwen2-VL: ChatML text, images and videos as merged 14-pixel patches, boxes in 0-1000.

An image of grid (t, h, w) patches becomes `<|vision_start|>` + t*h*w / merge_size**2 times
`<|image_pad|>` + `<|vision_end|>`; a video likewise with `<|video_pad|>` (t = frames / 2).
Positions are 3-D (mRoPE): the model's own `get_rope_index` computes them from the grids and
`mm_token_type_ids` (1 on image tokens, 2 on video tokens).

Boxes: Qwen2-VL reads and writes `(x1,y1),(x2,y2)` in 0-1000 of the image ("rel1000").
"""

from __future__ import annotations

import torch

from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import QwenImages, QwenVideos, qwen_mrope_positions, render_chatml, video_metadata

__all__ = ["Qwen2VLTemplate", "video_metadata"]

DEFAULT_SYSTEM = "You are a helpful assistant."

# What the Qwen vision families share: their module layout and the tokens never to sample.
QWEN_VL_COMPONENTS = {
    "backbone": "model",  # vision + LLM without lm_head: returns last_hidden_state
    "vision": "model.visual",
    "aligner": "model.visual.merger",
    "llm": "model.language_model",
    "lm_head": "lm_head",
}
QWEN_VL_NEVER_SAMPLE = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
)


def qwen_vl_part(part: dict) -> str:
    """One content part of a Qwen-VL prompt: each medium is start, ONE placeholder, end."""
    kind = part.get("type")
    if kind == "image":
        return "<|vision_start|><|image_pad|><|vision_end|>"
    if kind == "video":
        return "<|vision_start|><|video_pad|><|vision_end|>"
    return part.get("text", "")


@register_template("qwen2-vl")
class Qwen2VLTemplate(Template):
    """Template of Qwen2-VL; options: min_pixels, max_pixels (per image), video_min_pixels,
    video_max_pixels (per frame), video_fps, video_nframes, video_max_frames (frame sampling,
    read by the data loader that decodes videos)."""

    hf_model_types = ("qwen2_vl",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1000"
    default_max_pixels = 1280 * 28 * 28  # 1280 visual tokens (the Qwen2-VL cards' example bound); the processor allows 16k
    components = QWEN_VL_COMPONENTS
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    never_sample_tokens = QWEN_VL_NEVER_SAMPLE
    token_type_key = "mm_token_type_ids"
    token_types = {"image": 1, "video": 2}
    seconds_key: str | None = None  # Qwen2-VL positions do not advance with video time
    shared_prefix = True
    lean_decode = True  # Qwen2-style decoder layers (Qwen2.5-VL's too)
    frame_local_tower = True  # windows and full-attention blocks stop at a frame; positions per frame

    def build_media(self) -> dict:
        o = self.options
        return {
            "image": QwenImages(
                self.processor.image_processor,
                "<|image_pad|>",
                self.token_id("<|image_pad|>"),
                o.min_pixels,
                o.max_pixels,
            ),
            "video": QwenVideos(
                self.processor.video_processor,
                "<|video_pad|>",
                self.token_id("<|video_pad|>"),
                o.video_min_pixels,
                o.video_max_pixels,
                seconds_key=self.seconds_key,
            ),
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML with a default system turn; each medium -> start, ONE placeholder, end.

        [{"role": "user", "content": "<image>Hi"}] renders as
        <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n
        <|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\\n<|im_start|>assistant\\n
        """
        return render_chatml(messages, qwen_vl_part, DEFAULT_SYSTEM, add_generation_prompt)

    def position_ids(self, model, inputs: dict) -> torch.Tensor:
        """[3, N, seq_len] mRoPE positions from the model's `get_rope_index` (padding skipped)."""
        grid_keys = ("image_grid_thw", "video_grid_thw") + ((self.seconds_key,) if self.seconds_key else ())
        return qwen_mrope_positions(model, inputs, grid_keys)
