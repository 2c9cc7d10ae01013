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

DEFAULT_SYSTEM = "You are a helpful assistant."


@register_template("qwen2-vl")
class Qwen2VLTemplate(Template):
    """Template of Qwen2-VL; options: min_pixels, max_pixels (per image), video_min_pixels,
    video_max_pixels (per frame), video_fps, video_nframes, video_max_frames (frame sampling,
    read by the data loader that decodes videos)."""

    modalities = ("image", "video")
    box_convention = "rel1000"
    components = {
        "backbone": "model",  # vision + LLM without lm_head: returns last_hidden_state
        "vision": "model.visual",
        "aligner": "model.visual.merger",
        "llm": "model.language_model",
        "lm_head": "lm_head",
    }
    placeholder_tokens = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
    mm_token_types = {"image": 1, "video": 2}
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    never_sample_tokens = (
        "<|image_pad|>",
        "<|video_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
    )
    # modality -> (per-patch pixel tensor, per-item grid, other per-item tensors)
    media_layout = {
        "image": ("pixel_values", "image_grid_thw", ()),
        "video": ("pixel_values_videos", "video_grid_thw", ()),
    }

    def __init__(
        self,
        processor,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_min_pixels: int | None = None,
        video_max_pixels: int | None = None,
        video_fps: float | None = None,
        video_nframes: int | None = None,
        video_max_frames: int | None = None,
        **kwargs,
    ):
        super().__init__(processor, **kwargs)
        image_size, video_size = processor.image_processor.size, processor.video_processor.size
        self.image_size = {
            "shortest_edge": min_pixels or image_size["shortest_edge"],
            "longest_edge": max_pixels or image_size["longest_edge"],
        }
        self.video_size = {
            "shortest_edge": video_min_pixels or video_size["shortest_edge"],
            "longest_edge": video_max_pixels or video_size["longest_edge"],
        }
        self.video_sampling = {"fps": video_fps, "nframes": video_nframes, "max_frames": video_max_frames}
        self.patch_size = processor.image_processor.patch_size
        self.merge_size = processor.image_processor.merge_size
        self.video_merge_size = processor.video_processor.merge_size

    # -- rendering ---------------------------------------------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML with a default system turn; each medium -> start, ONE placeholder, end.

        [{"role": "user", "content": "<image>Hi"}] renders as
        <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n
        <|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\\n<|im_start|>assistant\\n
        """
        text = ""
        if not messages or messages[0]["role"] != "system":
            text += f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        for message in messages:
            body = "".join(self.render_part(part) for part in self.content_parts(message["content"]))
            text += f"<|im_start|>{message['role']}\n{body}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text

    @staticmethod
    def render_part(part: dict) -> str:
        kind = part.get("type")
        if kind == "image":
            return "<|vision_start|><|image_pad|><|vision_end|>"
        if kind == "video":
            return "<|vision_start|><|video_pad|><|vision_end|>"
        return part.get("text", "")

    # -- images ------------------------------------------------------------------------------

    def process_images(self, images: list) -> dict[str, torch.Tensor]:
        out = self.processor.image_processor(images=images, size=self.image_size, return_tensors="pt")
        # pixel_values [sum of t*h*w, 3 * temporal_patch * patch**2]; image_grid_thw [images, 3]
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def expand_image(self, processed: dict, index: int) -> list[int]:
        num_tokens = int(processed["image_grid_thw"][index].prod()) // self.merge_size**2
        return [self.placeholder_ids["image"]] * num_tokens

    def input_sizes(self, processed: dict) -> list[tuple[int, int]]:
        """Resized (width, height) of each image, from its patch grid."""
        return [
            (int(w) * self.patch_size, int(h) * self.patch_size) for _, h, w in processed["image_grid_thw"]
        ]

    # -- videos ------------------------------------------------------------------------------

    def process_videos(self, videos: list) -> dict[str, torch.Tensor]:
        # Frames are sampled already (mmgrpo.processors.video): do_sample_frames=False.
        out = self.processor.video_processor(
            videos=[video.frames for video in videos],
            video_metadata=[video_metadata(video) for video in videos],
            size=self.video_size,
            do_sample_frames=False,
            return_tensors="pt",
        )
        # pixel_values_videos [sum of t*h*w, patch_dim]; video_grid_thw [videos, 3]
        return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}

    def expand_video(self, processed: dict, index: int) -> list[int]:
        num_tokens = int(processed["video_grid_thw"][index].prod()) // self.video_merge_size**2
        return [self.placeholder_ids["video"]] * num_tokens

    # -- batches and positions ---------------------------------------------------------------

    def media_per_row(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Split concatenated media back per row: a row's placeholder count says how many grids it owns."""
        rows: list[dict[str, torch.Tensor]] = [{} for _ in range(batch["input_ids"].shape[0])]
        merge = {"image": self.merge_size, "video": self.video_merge_size}
        for modality, (pixel_key, grid_key, item_keys) in self.media_layout.items():
            if grid_key not in batch:
                continue
            grids = batch[grid_key]  # [items, 3]
            patches = grids.prod(dim=1)  # [items]
            patch_start = torch.cat([patches.new_zeros(1), patches.cumsum(0)])  # [items + 1]
            item = 0
            for row, types in enumerate(batch["mm_token_type_ids"]):
                tokens_left = int((types == self.mm_token_types[modality]).sum())
                first = item
                while tokens_left > 0:
                    tokens_left -= int(patches[item]) // merge[modality] ** 2
                    item += 1
                if item > first:
                    rows[row][grid_key] = grids[first:item]
                    rows[row][pixel_key] = batch[pixel_key][patch_start[first] : patch_start[item]]
                    for key in item_keys:
                        if key in batch:
                            rows[row][key] = batch[key][first:item]
        return rows

    def position_ids(self, model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[3, N, seq_len] mRoPE positions from the model's `get_rope_index` (padding skipped)."""
        core = model
        for _ in range(4):  # ForConditionalGeneration.model, or a PEFT wrapper's .model.model
            if hasattr(core, "get_rope_index"):
                break
            core = core.model
        rope_keys = (
            "image_grid_thw",
            "video_grid_thw",
            *[k for _, _, keys in self.media_layout.values() for k in keys],
        )
        position_ids, _ = core.get_rope_index(
            inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            attention_mask=inputs["attention_mask"],
            **{key: inputs[key] for key in rope_keys if key in inputs},
        )
        return position_ids


def video_metadata(video) -> dict:
    """A Video's metadata restricted to the fields transformers' VideoMetadata takes."""
    from dataclasses import fields

    from transformers.video_utils import VideoMetadata

    names = {f.name for f in fields(VideoMetadata)}
    metadata = {k: v for k, v in dict(video.metadata).items() if k in names}
    metadata.setdefault("total_num_frames", len(video.frames))
    return metadata
