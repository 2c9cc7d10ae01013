"""Qwen3-VL: Qwen2.5-VL's vocabulary and placeholders, timestamped video, boxes in 0-1000.

- No default system turn (Qwen2-VL and Qwen2.5-VL add "You are a helpful assistant.").
- An image becomes `<|vision_start|>` + t*h*w / merge_size**2 times `<|image_pad|>` + `<|vision_end|>`.
- A video's placeholder becomes, for each temporal patch (two frames), the text `<1.5 seconds>`
  (the mean timestamp of its frames, from the video's `frames_indices` and source fps) followed
  by `<|vision_start|>` + h*w / merge_size**2 `<|video_pad|>` + `<|vision_end|>`, inside the
  video's own start/end pair, exactly as Qwen3VLProcessor writes it.
- Positions are interleaved mRoPE from the model's `get_rope_index` (frames are split by their
  timestamps); the vision tower also feeds "deepstack" features into the first LLM layers.
- The video pixel budget (`video_min_pixels`, `video_max_pixels`) is per clip (all frames),
  as Qwen3VLVideoProcessor counts it; per frame for the other Qwen families.

Boxes: Qwen3-VL reads and writes `[x1, y1, x2, y2]` in 0-1000 of the image ("rel1000").
"""

from __future__ import annotations

import torch

from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import QwenImages, QwenVideos, qwen_mrope_positions, render_chatml, video_metadata
from mmgrpo.templates.qwen2_vl import QWEN_VL_COMPONENTS, QWEN_VL_NEVER_SAMPLE, qwen_vl_part


def frame_timestamps(video, temporal_patch: int) -> list[float]:
    """Mean timestamp in seconds of each temporal patch of a video's sampled frames.

    >>> from mmgrpo.data.sample import Video
    >>> frame_timestamps(Video(frames=[0] * 4, metadata={"fps": 2.0, "frames_indices": [0, 2, 4, 6]}), 2)
    [0.5, 2.5]
    """
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(**video_metadata(video))
    indices = list(
        metadata.frames_indices if metadata.frames_indices is not None else range(len(video.frames))
    )
    fps = metadata.fps or 24.0  # Qwen3VLProcessor's fallback when the source fps is unknown
    indices += [indices[-1]] * (-len(indices) % temporal_patch)  # a last, partial patch repeats its frame
    seconds = [index / fps for index in indices]
    return [
        (seconds[i] + seconds[i + temporal_patch - 1]) / 2 for i in range(0, len(seconds), temporal_patch)
    ]


class TimestampedVideos:
    """Qwen3-VL's video hook: Qwen's video patches, each temporal patch headed by its timestamp."""

    modality = "video"

    def __init__(self, videos: QwenVideos, tokenizer, vision_start_id: int, vision_end_id: int):
        self.videos = videos  # processing and token counting are Qwen2-VL's
        self.placeholder, self.token_id = videos.placeholder, videos.token_id
        self.item_keys, self.patch_keys, self.row_keys = videos.item_keys, videos.patch_keys, videos.row_keys
        self.tokenizer = tokenizer
        self.vision_start_id, self.vision_end_id = vision_start_id, vision_end_id

    def process(self, videos: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        tensors, _ = self.videos.process(videos)
        temporal_patch = self.videos.video_processor.temporal_patch_size
        expansions = []
        for video, (grid_t, grid_h, grid_w) in zip(videos, tensors["video_grid_thw"].tolist()):
            frame_tokens = [self.token_id] * (grid_h * grid_w // self.videos.merge_size**2)
            ids: list[int] = []
            for seconds in frame_timestamps(video, temporal_patch)[:grid_t]:
                # "<1.5 seconds>" sits between special tokens, so tokenizing it alone matches in context
                ids += self.tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False)["input_ids"]
                ids += [self.vision_start_id, *frame_tokens, self.vision_end_id]
            expansions.append(ids)
        return tensors, expansions

    def tokens_per_item(self, batch: dict) -> list[int]:
        return self.videos.tokens_per_item(batch)

    def patches_per_item(self, batch: dict) -> list[int]:
        return self.videos.patches_per_item(batch)


def qwen3_vl_media(template: Template) -> dict:
    """Qwen3-VL's media hooks (Qwen3.5 takes the same): Qwen images, timestamped Qwen videos."""
    o = template.options
    videos = QwenVideos(
        template.processor.video_processor, "<|video_pad|>", template.token_id("<|video_pad|>"),
        o.video_min_pixels, o.video_max_pixels,
    )
    return {
        "image": QwenImages(
            template.processor.image_processor, "<|image_pad|>", template.token_id("<|image_pad|>"),
            o.min_pixels, o.max_pixels,
        ),
        "video": TimestampedVideos(
            videos, template.tokenizer, template.token_id("<|vision_start|>"), template.token_id("<|vision_end|>")
        ),
    }


@register_template("qwen3-vl")
class Qwen3VLTemplate(Template):
    """Template of Qwen3-VL; options: min_pixels, max_pixels (per image), video_min_pixels,
    video_max_pixels (per clip), video_fps, video_nframes, video_max_frames."""

    hf_model_types = ("qwen3_vl",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1000"
    default_max_pixels = 1280 * 32 * 32  # 1280 visual tokens of 16-pixel patches merged 2x2
    components = QWEN_VL_COMPONENTS  # model.visual also holds the deepstack mergers
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    never_sample_tokens = QWEN_VL_NEVER_SAMPLE
    token_type_key = "mm_token_type_ids"
    token_types = {"image": 1, "video": 2}
    shared_prefix = True  # deepstack features are added at prompt positions only
    lean_decode = True  # Qwen3 layers: the lean step's per-head q/k RMSNorm
    frame_local_tower = True  # windows and full-attention blocks stop at a frame; positions per frame

    def build_media(self) -> dict:
        return qwen3_vl_media(self)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML without a default system turn; each medium -> start, ONE placeholder, end."""
        return render_chatml(messages, qwen_vl_part, None, add_generation_prompt)

    def position_ids(self, model, inputs: dict) -> torch.Tensor:
        """[3, N, seq_len] interleaved mRoPE positions from the model's `get_rope_index`."""
        return qwen_mrope_positions(model, inputs, ("image_grid_thw", "video_grid_thw"))
