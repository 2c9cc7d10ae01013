"""Per-modality hooks that several families share, composed by the family templates.

A hook adapts one modality of one family: it runs the Hugging Face image / video / audio
processor on a sample's media and says what each item's ONE placeholder becomes in the token
sequence (like a HF processor's `replace_image_token`).

    hook.placeholder, hook.token_id                # the token in the rendered text; the id counted per row
    hook.process(items) -> (tensors, expansions)   # the HF processor's tensors for these items, and per
                                                   # item token ids (or text, see Template.expand_in_text)
    hook.tokens_per_item(batch) -> list[int]       # `token_id` tokens each item of a batch occupies
    hook.patches_per_item(batch) -> list[int]      # rows each item owns in the `patch_keys` tensors
    hook.input_sizes(tensors) -> [(w, h), ...]     # images only: the resized model input of each image
    hook.processor_kwargs() -> dict                # optional: the HF processor options that give `process`'s
                                                   # result (a rollout engine such as vLLM runs the processor)

`item_keys` are tensors with one entry per item along dim 0 (grids, audio features ...),
`patch_keys` tensors whose dim 0 concatenates a variable number of rows per item (Qwen's
patches), `row_keys` tensors with one entry per prompt row. With these the template can split a
collated batch back into rows and repeat rows, whatever the family.

Here: Qwen's merged-patch images and videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni),
Whisper-feature audio (Qwen2-Audio, Qwen2.5-Omni), ChatML rendering and mRoPE positions.
Hooks used by one family only live in that family's file.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmgrpo.errors import DataError

# `Template.vllm_weight_names` of a SigLIP vision tower (LLaVA-OneVision, Gemma3): the original
# checkpoints name it `vision_tower.vision_model.*`; transformers 5 drops the `vision_model` level,
# in memory (`model.vision_tower.encoder...`) and in the folders it saves (`vision_tower.encoder...`).
SIGLIP_TOWER_NAMES = ((r"^(?:model\.)?vision_tower\.(?!vision_model\.)", "vision_tower.vision_model."),)


def video_metadata(video) -> dict:
    """A Video's metadata restricted to the fields transformers' VideoMetadata takes."""
    from dataclasses import fields

    from transformers.video_utils import VideoMetadata

    names = {f.name for f in fields(VideoMetadata)}
    metadata = {k: v for k, v in dict(video.metadata).items() if k in names}
    metadata.setdefault("total_num_frames", len(video.frames))
    return metadata


def sampled_fps(video) -> float:
    """Frames per second of the sampled frames (what a temporal patch's duration is computed from)."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(**video_metadata(video)).sampled_fps


def pixel_size(size: dict, min_pixels: int | None, max_pixels: int | None) -> dict:
    """A Qwen processor's {"shortest_edge", "longest_edge"} pixel budget with overrides."""
    return {
        "shortest_edge": min_pixels or size["shortest_edge"],
        "longest_edge": max_pixels or size["longest_edge"],
    }


class QwenImages:
    """Images as patches merged `merge_size` x `merge_size` (Qwen2-VL's image processor).

    An image of grid (t, h, w) patches becomes t*h*w / merge_size**2 placeholder tokens;
    pixel_values [sum of t*h*w, 3 * temporal_patch * patch**2], image_grid_thw [images, 3].
    """

    modality = "image"
    item_keys = ("image_grid_thw",)
    patch_keys = ("pixel_values",)
    row_keys = ()

    def __init__(self, image_processor, placeholder: str, token_id: int, min_pixels=None, max_pixels=None):
        self.image_processor = image_processor
        self.placeholder, self.token_id = placeholder, token_id
        self.size = pixel_size(image_processor.size, min_pixels, max_pixels)
        self.patch_size = image_processor.patch_size
        self.merge_size = image_processor.merge_size

    def processor_kwargs(self) -> dict:
        """The HF processor options that resize as `process` does (for a rollout engine's processor)."""
        return {"images_kwargs": {"size": dict(self.size)}}

    def process(self, images: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        out = self.image_processor(images=images, size=self.size, return_tensors="pt")
        tensors = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        return tensors, [[self.token_id] * n for n in self.tokens_per_item(tensors)]

    def tokens_per_item(self, batch: dict) -> list[int]:
        return (batch["image_grid_thw"].prod(dim=1) // self.merge_size**2).tolist()

    def patches_per_item(self, batch: dict) -> list[int]:
        return batch["image_grid_thw"].prod(dim=1).tolist()

    def input_sizes(self, processed: dict) -> list[tuple[int, int]]:
        """Resized (width, height) of each image, from its patch grid."""
        return [
            (int(w) * self.patch_size, int(h) * self.patch_size) for _, h, w in processed["image_grid_thw"]
        ]


class QwenVideos:
    """Videos as merged patches of frame pairs (Qwen2-VL's video processor; Qwen3-VL's takes the same call).

    Frames arrive sampled already (mmgrpo.processors.video): do_sample_frames=False with the
    video's metadata. `seconds_key` names the per-video tensor of seconds per temporal patch
    that time-aware positions need (Qwen2.5-VL "second_per_grid_ts", Qwen2.5-Omni
    "video_second_per_grid"); None for families without one.
    """

    modality = "video"
    patch_keys = ("pixel_values_videos",)
    row_keys = ()

    def __init__(
        self,
        video_processor,
        placeholder: str,
        token_id: int,
        min_pixels=None,
        max_pixels=None,
        seconds_key: str | None = None,
    ):
        self.video_processor = video_processor
        self.placeholder, self.token_id = placeholder, token_id
        self.size = pixel_size(video_processor.size, min_pixels, max_pixels)
        self.merge_size = video_processor.merge_size
        self.seconds_key = seconds_key
        self.item_keys = ("video_grid_thw",) + ((seconds_key,) if seconds_key else ())

    def processor_kwargs(self) -> dict:
        """The HF processor options that process frames as `process` does (already sampled: not again)."""
        return {"videos_kwargs": {"size": dict(self.size), "do_sample_frames": False}}

    def process(self, videos: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        out = self.video_processor(
            videos=[video.frames for video in videos],
            video_metadata=[video_metadata(video) for video in videos],
            size=self.size,
            do_sample_frames=False,
            return_tensors="pt",
        )
        # pixel_values_videos [sum of t*h*w, patch_dim]; video_grid_thw [videos, 3]
        processed = {
            "pixel_values_videos": out["pixel_values_videos"],
            "video_grid_thw": out["video_grid_thw"],
        }
        if self.seconds_key:
            temporal_patch = self.video_processor.temporal_patch_size
            processed[self.seconds_key] = torch.tensor(
                [temporal_patch / sampled_fps(v) for v in videos]
            )  # [videos]
        return processed, [[self.token_id] * n for n in self.tokens_per_item(processed)]

    def tokens_per_item(self, batch: dict) -> list[int]:
        return (batch["video_grid_thw"].prod(dim=1) // self.merge_size**2).tolist()

    def patches_per_item(self, batch: dict) -> list[int]:
        return batch["video_grid_thw"].prod(dim=1).tolist()


MIN_WHISPER_FRAMES = 3  # the fewest mel frames that give one LLM token (whisper_audio_tokens(3) == 1)


def whisper_audio_tokens(num_frames: int) -> int:
    """LLM tokens of a clip of `num_frames` mel frames: a stride-2 conv, then stride-2 pooling."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


class WhisperAudio:
    """Audio as Whisper log-mel features padded to the extractor's chunk (Qwen2-Audio, Qwen2.5-Omni).

    input_features [clips, mel_bins, chunk_frames], feature_attention_mask [clips, chunk_frames];
    a clip of L valid frames becomes whisper_audio_tokens(L) placeholder tokens. Clips longer
    than the extractor's chunk (30 s for the real models) are cut, as the HF processor does.
    """

    modality = "audio"
    item_keys = ("input_features", "feature_attention_mask")
    patch_keys = ()
    row_keys = ()

    def __init__(self, feature_extractor, placeholder: str, token_id: int):
        self.feature_extractor = feature_extractor
        self.placeholder, self.token_id = placeholder, token_id
        self.sampling_rate = feature_extractor.sampling_rate
        # the longest clip the encoder takes, in samples (one chunk); the data loader cuts longer clips with a warning
        self.max_samples = getattr(feature_extractor, "n_samples", None)

    def process(self, audios: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        out = self.feature_extractor(
            audios,
            sampling_rate=self.sampling_rate,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="pt",
        )
        tensors = {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}
        counts = self.tokens_per_item(tensors)
        for position, (audio, count) in enumerate(zip(audios, counts)):
            if count < 1:  # no placeholder token for the encoder's output: the forward would fail deep in transformers
                hop = getattr(self.feature_extractor, "hop_length", 160)
                raise DataError(
                    f"audio clip {position + 1} is {1000 * len(audio) / self.sampling_rate:.0f} ms long, shorter than the "
                    f"{1000 * MIN_WHISPER_FRAMES * hop / self.sampling_rate:.0f} ms the audio encoder needs for one token; "
                    "drop the row or pad the clip"
                )
        return tensors, [[self.token_id] * n for n in counts]

    def tokens_per_item(self, batch: dict) -> list[int]:
        return [whisper_audio_tokens(int(n)) for n in batch["feature_attention_mask"].sum(dim=1)]


def render_chatml(
    messages: list[dict],
    render_part: Callable[[dict], str],
    default_system: str | None,
    add_generation_prompt: bool,
) -> str:
    """ChatML: `<|im_start|>role\\n...<|im_end|>\\n` per turn, a default system turn if given.

    `render_part` turns one typed content part ({"type": "image"} ...) into text. Tool results
    (role "tool") render as in Qwen2.5's chat template: consecutive tool messages share one user
    turn, each wrapped in `\\n<tool_response>\\n...\\n</tool_response>`.
    """
    from mmgrpo.templates.base import Template

    text = ""
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        text += f"<|im_start|>system\n{default_system}<|im_end|>\n"
    for i, message in enumerate(messages):
        body = "".join(render_part(part) for part in Template.content_parts(message["content"]))
        if message["role"] != "tool":
            text += f"<|im_start|>{message['role']}\n{body}<|im_end|>\n"
            continue
        if i == 0 or messages[i - 1]["role"] != "tool":
            text += "<|im_start|>user"
        text += f"\n<tool_response>\n{body}\n</tool_response>"
        if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
            text += "<|im_end|>\n"
    if add_generation_prompt:
        text += "<|im_start|>assistant\n"
    return text


def rope_core(model):
    """The module that owns `get_rope_index` (ForConditionalGeneration.model, or under a PEFT wrapper)."""
    core = model
    for _ in range(4):
        if hasattr(core, "get_rope_index"):
            return core
        core = core.model
    raise TypeError(f"{type(model).__name__} has no get_rope_index; is --model_type right?")


def qwen_mrope_positions(model, inputs: dict, grid_keys: tuple[str, ...]) -> torch.Tensor:
    """[3, N, seq_len] mRoPE positions from a Qwen-VL model's own `get_rope_index` (padding skipped).

    transformers 5.x signature: get_rope_index(input_ids, mm_token_type_ids, attention_mask, **grids).
    """
    position_ids, _ = rope_core(model).get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        attention_mask=inputs["attention_mask"],
        **{key: inputs[key] for key in grid_keys if key in inputs},
    )
    return position_ids
