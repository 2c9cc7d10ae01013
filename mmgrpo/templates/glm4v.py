"""GLM-4.1V-Thinking, GLM-4.5V (MoE) and GLM-4.6V: GLM's chat format, Qwen-style merged patches, boxes in 0-1000.

- The prompt starts with `[gMASK]<sop>`; each turn is `<|system|>\\n`, `<|user|>\\n` or
  `<|assistant|>\\n` and its content, with no end-of-turn token: the model ends its turn by writing
  `<|user|>` (or `<|observation|>` to call a tool), which are its stop tokens with `<|endoftext|>`
  (GLM-4.1V's generation_config eos ids 151329, 151336, 151338). GLM-4.1V's official chat template has no tool role; tool results
  render here as `<|observation|>\\n` turns, GLM's tool-result role.
- An image is `<|begin_of_image|>` + t*h*w / merge_size**2 times `<|image|>` + `<|end_of_image|>`.
- A video's frames are images too: `<|begin_of_video|>`, then per temporal patch (two frames)
  `<|begin_of_image|>` + h*w / merge_size**2 `<|image|>` + `<|end_of_image|>` + its timestamp, then
  `<|end_of_video|>`, as Glm4vProcessor writes it. The timestamp is the first frame's second as an
  integer (`3`) for GLM-4.1V and GLM-4.5V, with one decimal (`3.0 seconds`) for GLM-4.6V
  (Glm46VProcessor): the only difference between the templates `glm4v` / `glm4v-moe` and `glm46v`.
- Video tokens are `<|image|>` tokens: `mm_token_type_ids` (1 image, 2 video) mark those between
  `<|begin_of_video|>` and `<|end_of_video|>` as video, as the processor's `create_mm_token_type_ids`.
  transformers' forward (Glm4vModel.get_placeholder_mask) then scatters image features into every
  `<|image|>` token, so it cannot take images and videos in one batch: `collate` refuses that
  with the samples named.
- Positions are 3-D (mRoPE on half of each head) from the model's `get_rope_index`; each video
  frame is its own grid there.
- Pixel budgets (`min_pixels` ...) are the processors': an image counts twice (Glm4vImageProcessor
  resizes it as two frames), a video's budget is per clip.

Boxes: GLM-4.1V and GLM-4.5V answer a grounding question with `[x1,y1,x2,y2]` inside
`<|begin_of_box|>...<|end_of_box|>`, x and y in 0-1000 of the original image from its top-left corner
(zai-org's GLM-V grounding notes: x = round(x_pixel / W * 1000), y = round(y_pixel / H * 1000); the
GLM-4.5V model card); nothing in transformers' GLM processors or models rescales coordinates: "rel1000". The box tokens are
special: decoded completions keep the bare `[x1,y1,x2,y2]`, which the box rewards parse.
GLM-4.1V-Thinking writes `<think>...</think><answer>...</answer>`; those tags are plain text.
"""

from __future__ import annotations

import torch

from mmgrpo.errors import DataError
from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import QwenImages, QwenVideos, qwen_mrope_positions, video_metadata

GLM_COMPONENTS = {
    "backbone": "model",  # vision + LLM without lm_head: returns last_hidden_state
    "vision": "model.visual",
    "aligner": "model.visual.merger",
    "llm": "model.language_model",
    "lm_head": "lm_head",
}
MEDIA_PARTS = {
    "image": "<|begin_of_image|><|image|><|end_of_image|>",
    "video": "<|begin_of_video|><|video|><|end_of_video|>",
}


def first_frame_seconds(video, temporal_patch: int) -> list[float]:
    """Second of the first frame of each temporal patch of a video's sampled frames (GLM's timestamps).

    >>> from mmgrpo.data.sample import Video
    >>> first_frame_seconds(Video(frames=[0] * 5, metadata={"fps": 2.0, "frames_indices": [0, 2, 4, 6, 8]}), 2)
    [0.0, 2.0, 4.0]
    """
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(**video_metadata(video))
    indices = metadata.frames_indices if metadata.frames_indices is not None else range(len(video.frames))
    fps = metadata.fps or 24  # Glm4vProcessor's fallback when the source fps is unknown
    return [index / fps for index in list(indices)[::temporal_patch]]


class GlmVideos:
    """GLM's video hook: Qwen's video patches, each temporal patch an image block with its timestamp.

    `token_id` is `<|video|>`'s, the placeholder: the expanded frames hold `<|image|>` tokens, which
    the template relabels inside video spans to count a row's video tokens (`media_per_row`).
    """

    modality = "video"

    def __init__(self, videos: QwenVideos, tokenizer, image_id: int, begin_image_id: int, end_image_id: int, stamp):
        self.videos = videos  # processing and token counting are Qwen2-VL's
        self.placeholder, self.token_id = videos.placeholder, videos.token_id
        self.item_keys, self.patch_keys, self.row_keys = videos.item_keys, videos.patch_keys, videos.row_keys
        self.tokenizer = tokenizer
        self.image_id, self.begin_image_id, self.end_image_id = image_id, begin_image_id, end_image_id
        self.stamp = stamp  # seconds -> the timestamp text after a frame

    def processor_kwargs(self) -> dict:
        return self.videos.processor_kwargs()

    def process(self, videos: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        tensors, _ = self.videos.process(videos)
        temporal_patch = self.videos.video_processor.temporal_patch_size
        expansions = []
        for video, (grid_t, grid_h, grid_w) in zip(videos, tensors["video_grid_thw"].tolist()):
            frame = [self.begin_image_id, *[self.image_id] * (grid_h * grid_w // self.videos.merge_size**2), self.end_image_id]
            seconds = first_frame_seconds(video, temporal_patch)[:grid_t]
            seconds += [seconds[-1] if seconds else 0] * (grid_t - len(seconds))  # as the processor pads them
            ids: list[int] = []
            for second in seconds:
                # the timestamp sits between special tokens, so tokenizing it alone matches in context
                ids += frame + self.tokenizer(self.stamp(second), add_special_tokens=False)["input_ids"]
            expansions.append(ids)
        return tensors, expansions

    def tokens_per_item(self, batch: dict) -> list[int]:
        return self.videos.tokens_per_item(batch)

    def patches_per_item(self, batch: dict) -> list[int]:
        return self.videos.patches_per_item(batch)


@register_template("glm4v")
class Glm4vTemplate(Template):
    """Template of GLM-4.1V-Thinking (and GLM-4.6V-Flash's dense LLM under GLM-4.1V's class); options:
    min_pixels, max_pixels (per image, counted twice), video_min_pixels, video_max_pixels (per clip),
    video_fps, video_nframes, video_max_frames."""

    hf_model_types = ("glm4v",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1000"
    components = GLM_COMPONENTS
    stop_tokens = ("<|user|>", "<|observation|>", "<|endoftext|>")
    never_sample_tokens = (
        "<|image|>",
        "<|video|>",
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
        "[MASK]",
        "[gMASK]",
        "[sMASK]",
        "<sop>",
        "<eop>",
    )
    token_type_key = "mm_token_type_ids"
    token_types = {"image": 1, "video": 2}
    shared_prefix = True  # full attention; positions from get_rope_index (tests/test_shared_prefix.py)
    separate_media_batches = True  # images or videos in a batch, not both (see `collate`)
    frame_local_tower = True  # attention (cu_seqlens), positions and embeddings stop at a frame
    # Not lean_decode: GLM's decoder layers norm the attention and MLP outputs again
    # (post_self_attn_layernorm, post_mlp_layernorm) and fuse gate and up projections.
    # vLLM 0.32's GLM-4V processor reads do_sample_frames from each video's metadata (a KeyError without
    # it); False: the frames come sampled, and its video ids then equal the template's (tests/test_vllm_prompts.py).
    vllm_video_metadata = {"do_sample_frames": False}

    @staticmethod
    def stamp(seconds: float) -> str:
        """The timestamp text after a video frame (Glm4vProcessor.replace_frame_token_id)."""
        return str(int(seconds))

    def build_media(self) -> dict:
        o = self.options
        image_id = self.token_id("<|image|>")
        videos = QwenVideos(
            self.processor.video_processor, "<|video|>", self.token_id("<|video|>"), o.video_min_pixels, o.video_max_pixels
        )
        return {
            "image": QwenImages(self.processor.image_processor, "<|image|>", image_id, o.min_pixels, o.max_pixels),
            "video": GlmVideos(
                videos,
                self.tokenizer,
                image_id,
                self.token_id("<|begin_of_image|>"),
                self.token_id("<|end_of_image|>"),
                self.stamp,
            ),
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """GLM's turns; each medium -> begin, ONE placeholder, end.

        [{"role": "user", "content": "<image>Hi"}] renders as
        [gMASK]<sop><|user|>\\n<|begin_of_image|><|image|><|end_of_image|>Hi<|assistant|>\\n
        """
        text = "[gMASK]<sop>"
        for message in messages:
            role = "observation" if message["role"] == "tool" else message["role"]
            parts = self.content_parts(message["content"])
            text += f"<|{role}|>\n" + "".join(MEDIA_PARTS.get(p.get("type"), p.get("text", "")) for p in parts)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def token_type_inputs(self, prompt_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """`mm_token_type_ids` [..., len]: 2 on `<|image|>` tokens inside a video span, 1 on the others."""
        opened = (prompt_ids == self.token_id("<|begin_of_video|>")).cumsum(-1)
        closed = (prompt_ids == self.token_id("<|end_of_video|>")).cumsum(-1)
        media = prompt_ids == self.media["image"].token_id
        types = torch.zeros_like(prompt_ids)
        types[media] = 1
        types[media & (opened > closed)] = 2
        return {self.token_type_key: types}

    def media_per_row(self, batch: dict) -> list[dict[str, torch.Tensor]]:
        """As the base class, with a video's `<|image|>` tokens counted as the video's."""
        types = self.token_type_inputs(batch["input_ids"])[self.token_type_key]
        relabelled = batch["input_ids"].masked_fill(types == 2, self.media["video"].token_id)
        return super().media_per_row({**batch, "input_ids": relabelled})

    def collate(self, prompts: list) -> dict:
        """The base collation; a batch of images and videos together is refused (see the module docstring)."""
        with_images = [p.id for p in prompts if p.images]
        with_videos = [p.id for p in prompts if p.videos]
        if with_images and with_videos:
            raise DataError(
                f"samples {', '.join(with_images[:3])} (images) and {', '.join(with_videos[:3])} (videos): "
                f"transformers' {self.name} forward takes images or videos in one batch, not both (it fills "
                "every <|image|> token from the images); train image and video datasets in separate runs"
            )
        return super().collate(prompts)

    def position_ids(self, model, inputs: dict) -> torch.Tensor:
        """[3, N, seq_len] mRoPE positions from the model's `get_rope_index` (each video frame its own grid)."""
        return qwen_mrope_positions(model, inputs, ("image_grid_thw", "video_grid_thw"))


@register_template("glm4v-moe")
class Glm4vMoeTemplate(Glm4vTemplate):
    """Template of GLM-4.5V (Glm4vMoeForConditionalGeneration): GLM-4.1V's format and processor."""

    hf_model_types = ("glm4v_moe",)


@register_template("glm46v")
class Glm46VTemplate(Glm4vTemplate):
    """Template of GLM-4.6V (Glm46VForConditionalGeneration): video timestamps as `3.0 seconds`."""

    hf_model_types = ("glm46v",)

    @staticmethod
    def stamp(seconds: float) -> str:
        """Glm46VProcessor.replace_frame_token_id's timestamp text."""
        return f"{seconds:.1f} seconds"
