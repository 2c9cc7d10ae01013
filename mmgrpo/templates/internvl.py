"""InternVL3 / InternVL3.5 in the Hugging Face format (OpenGVLab/InternVL3-*-hf, InternVL3_5-*-HF):
an InternViT tower, a pixel-shuffle MLP projector and a Qwen2 (3.0) or Qwen3 (3.5) LLM.

- ChatML without a default system turn; an image renders as `<IMG_CONTEXT>\\n` where it stands.
- Dynamic tiling: an image is cut into the grid of square tiles (of the processor's `size`) whose
  aspect ratio is closest to the image's, between `min_patches` and `max_patches` tiles, plus a
  thumbnail of the whole image when there is more than one. `<IMG_CONTEXT>` becomes `<img>` +
  `image_seq_length` x tiles `<IMG_CONTEXT>` + `</img>`; `pixel_values` [tiles, 3, S, S] holds
  every tile of every image in order. A tile is the unit the batch is split and repeated by.
- Positions are plain 1-D RoPE; the forward needs no token types.
- Video (`<video>`: frames as "FrameN: <img>...</img>") is not taken yet.

Boxes: `<ref>object</ref><box>[[x1, y1, x2, y2]]</box>` with coordinates in 0-1000 of the image
("rel1000"), x first: InternVL's grounding data and its RefCOCO evaluation
(OpenGVLab/InternVL, internvl_chat/eval/refcoco/evaluate_grounding.py divides each coordinate by
1000 and scales by the image's width or height).
"""

from __future__ import annotations

import torch

from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import render_chatml

INTERNVL_PARTS = {"image": "<IMG_CONTEXT>\n", "video": "<video>\n"}


class TiledImages:
    """InternVL's image hook: each image as its tiles (and a thumbnail), `image_seq_length` tokens per tile."""

    modality = "image"
    item_keys = ("pixel_values",)  # an item here is one tile: a row's tiles follow from its token count
    patch_keys = ()
    row_keys = ()

    def __init__(self, processor, token_id: int, begin_id: int, end_id: int):
        self.image_processor = processor.image_processor
        self.placeholder, self.token_id = processor.image_token, token_id
        self.begin_id, self.end_id = begin_id, end_id
        self.tile_tokens = processor.image_seq_length

    def process(self, images: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        out = self.image_processor(images, crop_to_patches=True, return_tensors="pt")
        tiles = out["num_patches"].tolist() if hasattr(out["num_patches"], "tolist") else list(out["num_patches"])
        expansions = [[self.begin_id] + [self.token_id] * (self.tile_tokens * n) + [self.end_id] for n in tiles]
        return {"pixel_values": out["pixel_values"]}, expansions  # pixel_values [tiles, 3, S, S]

    def tokens_per_item(self, batch: dict) -> list[int]:
        return [self.tile_tokens] * batch["pixel_values"].shape[0]

    def input_sizes(self, tensors: dict) -> list[tuple[int, int]]:
        return []  # boxes are in 0-1000 of the original image: see InternVLTemplate.encode_media


@register_template("internvl")
class InternVLTemplate(Template):
    """Template of InternVL3 / 3.5 (HF format); image tiling follows the processor's saved settings."""

    hf_model_types = ("internvl",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1000"
    components = {
        "backbone": "model",  # vision tower + projector + LLM without lm_head
        "vision": "model.vision_tower",
        "aligner": "model.multi_modal_projector",
        "llm": "model.language_model",
        "lm_head": "lm_head",
    }
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    never_sample_tokens = ("<IMG_CONTEXT>", "<img>", "</img>", "<video>")
    shared_prefix = True  # the prompt's tiles run once per group; completions are text
    lean_decode = True  # the LLM is Qwen2 (InternVL3) or Qwen3 (3.5): Qwen-style decoder layers
    tile_local_tower = True  # InternViT encodes each 448-px tile (or frame) alone

    def build_media(self) -> dict:
        return {
            "image": TiledImages(
                self.processor, self.token_id("<IMG_CONTEXT>"), self.token_id("<img>"), self.token_id("</img>")
            )
        }

    def encode_media(self, sample) -> tuple[dict, dict, list]:
        """The hooks' tensors and expansions; each image's input size is its original size (boxes are relative)."""
        mm, expansions, _ = super().encode_media(sample)
        return mm, expansions, [tuple(image.size) for image in sample.images]

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML, no default system turn; each image -> `<IMG_CONTEXT>\\n`."""
        return render_chatml(
            messages,
            lambda part: INTERNVL_PARTS.get(part.get("type"), part.get("text", "")),
            None,
            add_generation_prompt,
        )
