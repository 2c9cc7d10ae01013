"""LLaVA-OneVision (Qwen2 LLM, SigLIP tower): ChatML, "anyres" image tiles, pooled video frames.

- ChatML with a default system turn, as in LLaVA-OneVision's training ("qwen_1_5" format):
  each medium renders as `<image>\\n` or `<video>\\n` where it stands in the message.
- A single image is cut into tiles (its best "anyres" grid of `image_grid_pinpoints`) plus a
  base view of the whole image; its placeholder becomes base + unpadded tile features + one
  newline token per feature row (the tiles are shrunk to at most 9 tiles' worth). A prompt with
  several images takes each image's base view only: tokens_per_tile + 1. The forward needs
  `pixel_values` [images, tiles, 3, S, S], `image_sizes` [images, 2] and `batch_num_images`
  [rows] (the per-prompt image count that tells the two cases apart).
- A video: each frame's tile features pooled 2x2, plus one newline token. All videos of a batch
  must have the same frame count (`--video_nframes`): the tower batches them as one tensor.
- Positions are plain 1-D RoPE.

Boxes: fractions 0-1 of the original image ("rel1", `[0.12, 0.30, 0.58, 0.91]`), the
normalised coordinates of the LLaVA grounding data.
"""

from __future__ import annotations

import math

import torch

from mmgrpo.errors import DataError
from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import SIGLIP_TOWER_NAMES, render_chatml

DEFAULT_SYSTEM = "You are a helpful assistant."
LLAVA_PARTS = {"image": "<image>\n", "video": "<video>\n"}


class AnyresImages:
    """LLaVA-OneVision's image hook: token counts of the anyres tiling, as its processor computes them."""

    modality = "image"
    item_keys = ("pixel_values", "image_sizes")
    patch_keys = ()
    row_keys = ("batch_num_images",)

    def __init__(self, processor, placeholder: str, token_id: int):
        self.image_processor = processor.image_processor
        self.placeholder, self.token_id = placeholder, token_id
        self.tile_tokens = processor.num_image_tokens  # features of one tile, e.g. (384 / 14)**2 = 729
        self.max_tiles = int(processor.vision_aspect_ratio.removeprefix("anyres_max_"))
        self.drop_cls = processor.vision_feature_select_strategy == "default"

    def process(self, images: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        out = self.image_processor([images], return_tensors="pt")  # one prompt: images nested once
        tensors = {
            "pixel_values": out["pixel_values"],  # [images, max_tiles, 3, S, S] (padded tiles)
            "image_sizes": out["image_sizes"],  # [images, 2] original (height, width)
            "batch_num_images": torch.tensor([len(images)]),  # [1]
        }
        return tensors, [[self.token_id] * n for n in self.tokens_per_item(tensors)]

    def tokens_per_item(self, batch: dict) -> list[int]:
        tile = batch["pixel_values"].shape[-1]
        single = [n == 1 for n in batch["batch_num_images"].tolist() for _ in range(n)]
        counts = []
        for (height, width), alone in zip(batch["image_sizes"].tolist(), single):
            count = self.anyres_tokens(height, width, tile) if alone else self.tile_tokens + 1
            counts.append(count - 1 if self.drop_cls else count)
        return counts

    def anyres_tokens(self, height: int, width: int, tile: int) -> int:
        """Base view + unpadded tile features + a newline per feature row, for one image alone."""
        from transformers.image_processing_utils import select_best_resolution

        best_height, best_width = select_best_resolution(
            [height, width], self.image_processor.image_grid_pinpoints
        )
        side = int(math.sqrt(self.tile_tokens))  # features per tile side
        rows, cols = side * (best_height // tile), side * (best_width // tile)
        # the image fills the tiled canvas along one axis; the padding along the other is dropped
        if width / height > cols / rows:
            rows -= 2 * ((rows - int(round(height * cols / width, 7))) // 2)
        else:
            cols -= 2 * ((cols - int(round(width * rows / height, 7))) // 2)
        features, newlines = rows * cols, rows
        shrink = math.sqrt(rows * cols / (self.max_tiles * side**2))
        if shrink > 1.1:  # more than anyres_max_9 tiles' worth: features are interpolated down
            features, newlines = int(rows // shrink) * int(cols // shrink), int(rows // shrink)
        return self.tile_tokens + features + newlines

    def input_sizes(self, tensors: dict) -> list[tuple[int, int]]:
        """Original (width, height): boxes are fractions of the image, the input size is not needed."""
        return [(int(w), int(h)) for h, w in tensors["image_sizes"].tolist()]


class PooledVideos:
    """LLaVA-OneVision's video hook: every frame one tile, its features pooled 2x2, one newline."""

    modality = "video"
    item_keys = ("pixel_values_videos",)
    patch_keys = ()
    row_keys = ()

    def __init__(self, processor, placeholder: str, token_id: int):
        self.video_processor = processor.video_processor
        self.placeholder, self.token_id = placeholder, token_id
        side = int(math.sqrt(processor.num_image_tokens))
        self.frame_tokens = math.ceil(side / 2) ** 2

    def process(self, videos: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        if len({len(video.frames) for video in videos}) > 1:
            raise DataError(
                "LLaVA-OneVision takes videos of one frame count per batch; sample a fixed number "
                "of frames (--video_nframes)"
            )
        out = self.video_processor(videos=[video.frames for video in videos], return_tensors="pt")
        tensors = {"pixel_values_videos": out["pixel_values_videos"]}  # [videos, frames, 3, S, S]
        return tensors, [[self.token_id] * n for n in self.tokens_per_item(tensors)]

    def tokens_per_item(self, batch: dict) -> list[int]:
        videos, frames = batch["pixel_values_videos"].shape[:2]
        return [frames * self.frame_tokens + 1] * videos


@register_template("llava-onevision")
class LlavaOnevisionTemplate(Template):
    """Template of LLaVA-OneVision (llava-hf/llava-onevision-qwen2-*); options: video_fps,
    video_nframes (frame sampling). Image tiling follows the processor's saved settings."""

    hf_model_types = ("llava_onevision",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1"
    components = {
        "backbone": "model",  # vision tower + projector + LLM without lm_head
        "vision": "model.vision_tower",
        "aligner": "model.multi_modal_projector",
        "llm": "model.language_model",
        "lm_head": "lm_head",
    }
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    never_sample_tokens = ("<image>", "<video>")
    # the llava-hf checkpoints' layout, which vLLM loads: language_model.model.*, language_model.lm_head.*,
    # multi_modal_projector.*, image_newline and the SigLIP tower under vision_tower.vision_model.*
    vllm_weight_names = (
        (r"^model\.language_model\.", "language_model.model."),
        (r"^lm_head\.", "language_model.lm_head."),
        (r"^model\.(multi_modal_projector\.|image_newline$)", r"\1"),
        *SIGLIP_TOWER_NAMES,
    )
    shared_prefix = True  # batch_num_images stays per prompt
    lean_decode = True  # the llava-onevision-qwen2 checkpoints' LLM is Qwen2

    def build_media(self) -> dict:
        return {
            "image": AnyresImages(self.processor, "<image>", self.token_id("<image>")),
            "video": PooledVideos(self.processor, "<video>", self.token_id("<video>")),
        }

    def vllm_prompt_problem(self, prompt) -> str | None:
        if len(prompt.images) > 1:
            return ("vLLM 0.32 tiles every image of a prompt with several (anyres), transformers takes each one's base "
                    f"view ({len(prompt.images)} images here): keep one image per prompt")
        return None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML with a default system turn; each medium -> `<image>\\n` or `<video>\\n`."""
        return render_chatml(
            messages,
            lambda part: LLAVA_PARTS.get(part.get("type"), part.get("text", "")),
            DEFAULT_SYSTEM,
            add_generation_prompt,
        )

    def collate(self, prompts: list) -> dict:
        frame_counts = {
            p.mm["pixel_values_videos"].shape[1] for p in prompts if "pixel_values_videos" in p.mm
        }
        if len(frame_counts) > 1:
            raise DataError(
                f"LLaVA-OneVision takes videos of one frame count per batch, got {sorted(frame_counts)} "
                f"(samples {', '.join(p.id for p in prompts if 'pixel_values_videos' in p.mm)}); "
                "sample a fixed number of frames (--video_nframes)"
            )
        return super().collate(prompts)
