"""Gemma 4 (google/gemma-4-*): images, videos, and audio on the models with an audio tower (E2B, E4B).

- `<bos>`; a system turn `<|turn>system\\n...<turn|>\\n` (each text part trimmed, then a space, as
  its chat template writes content parts); turns `<|turn>user|model\\n...<turn|>\\n` with text parts
  trimmed; an image renders as one `<|image|>`, an audio clip as one `<|audio|>`. The generation
  prompt is `<|turn>model\\n` and an empty thought channel `<|channel>thought\\n<channel|>`, as the
  chat template writes it with thinking off (its default).
- The processor replaces `<|image|>` by `<|image>` + N x `<|image|>` + `<image|>`, N the image's soft
  tokens: its patches (aspect ratio kept, at most `max_soft_tokens` x pooling**2 of them) pooled
  pooling x pooling. `pixel_values` [images, max_patches, 3 * patch**2] and `image_position_ids`
  [images, max_patches, 2] are padded to the budget ((-1, -1) marks a padding patch).
- `<|audio|>` becomes `<|audio>` + M x `<|audio|>` + `<audio|>`: M the clip's mel frames (10 ms hops)
  after two stride-2 convolutions. The clips of a prompt are padded to the longest
  (`input_features` [clips, frames, mel], `input_features_mask` [clips, frames]).
- The forward needs `mm_token_type_ids` (1 image, 2 video, 3 audio, 0 text and completions): on the models
  with `use_bidirectional_attention="vision"` an image's tokens attend to each other both ways in
  the sliding-window layers. Positions are plain 1-D RoPE.
- A video renders as one `<|video|>` and becomes, per frame, its "mm:ss" timestamp (from the sampled
  frame indices and fps), a space, `<|image>` + N x `<|video|>` + `<image|>`, frames joined by spaces.
  The timestamps are text that merges with its neighbours when tokenized, so expansion happens on
  the text (`expand_in_text`), for every medium. `pixel_values_videos` and `video_position_ids`
  [frames, max_patches, ...], `num_frames_per_video` [videos]; each frame's tokens are a separate
  bidirectional block (`mm_token_type_ids` 2).

Boxes: `[x1, y1, x2, y2]` in 0-1000 of the image ("rel1000"): Gemma 4 was released with native
JSON bounding-box output in a 1000 x 1000 space of the image (as summarised in e.g. datature.io's
"Gemma 4: what computer vision engineers need to know"); the key order of its JSON is the reward's
to parse or teach, as for Gemma3.
"""

from __future__ import annotations

import torch

from mmgrpo.errors import DataError
from mmgrpo.templates.base import Template, register_template


def conv_frames(mask: torch.Tensor) -> int:
    """LLM tokens of a clip whose mel-frame mask is `mask` [frames]: two stride-2 convolutions
    (kernel 3, padding 1) keep every other frame, twice.

    >>> conv_frames(torch.tensor([True] * 100 + [False] * 28))
    25
    """
    for _ in range(2):
        length = (len(mask) + 2 - 3) // 2 + 1
        mask = mask[::2][:length]
    return int(mask.sum())


class PatchImages:
    """Gemma 4's image hook: aspect-preserving patches, pooled into a variable number of soft tokens."""

    modality = "image"
    item_keys = ("pixel_values", "image_position_ids")
    patch_keys = ()
    row_keys = ()

    def __init__(self, processor, token_id: int):
        self.image_processor = processor.image_processor
        self.placeholder, self.token_id = processor.image_token, token_id
        self.begin, self.end = processor.boi_token, processor.eoi_token
        self.patch_size = self.image_processor.patch_size
        self.pooled = self.image_processor.pooling_kernel_size**2  # patches per soft token

    def process(self, images: list) -> tuple[dict[str, torch.Tensor], list[str]]:
        out = self.image_processor(images, return_tensors="pt")
        tensors = {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}
        return tensors, [f"{self.begin}{self.placeholder * n}{self.end}" for n in self.tokens_per_item(tensors)]

    def tokens_per_item(self, batch: dict) -> list[int]:
        real_patches = (batch["image_position_ids"] != -1).all(dim=-1).sum(dim=-1)  # [images]
        return (real_patches // self.pooled).tolist()

    def input_sizes(self, tensors: dict) -> list[tuple[int, int]]:
        """Resized (width, height) of each image, from its patches' largest (x, y) position."""
        corner = tensors["image_position_ids"].amax(dim=1) + 1  # [images, 2]
        return [(int(x) * self.patch_size, int(y) * self.patch_size) for x, y in corner.tolist()]


GEMMA4_MAX_AUDIO_SAMPLES = 480_000  # the feature extractor's max_length (30 s at 16 kHz): it truncates past it


class ConvAudio:
    """Gemma 4's audio hook: log-mel frames of 10 ms, subsampled 4x by the audio tower's convolutions."""

    modality = "audio"
    item_keys = ("input_features", "input_features_mask")
    patch_keys = ()
    row_keys = ()

    def __init__(self, processor, token_id: int):
        self.feature_extractor = processor.feature_extractor
        self.placeholder, self.token_id = processor.audio_token, token_id
        self.begin, self.end = processor.boa_token, processor.eoa_token
        self.sampling_rate = self.feature_extractor.sampling_rate
        self.max_samples = GEMMA4_MAX_AUDIO_SAMPLES

    def process(self, audios: list) -> tuple[dict[str, torch.Tensor], list[str]]:
        out = self.feature_extractor(audios, sampling_rate=self.sampling_rate, return_tensors="pt")
        # input_features [clips, frames, mel], input_features_mask [clips, frames]
        tensors = {"input_features": out["input_features"], "input_features_mask": out["input_features_mask"]}
        counts = self.tokens_per_item(tensors)
        for position, (audio, count) in enumerate(zip(audios, counts)):
            if count < 1:
                raise DataError(
                    f"audio clip {position + 1} is {1000 * len(audio) / self.sampling_rate:.0f} ms long, too short for "
                    "one audio token (its first mel frame); drop the row or pad the clip"
                )
        return tensors, [f"{self.begin}{self.placeholder * n}{self.end}" for n in counts]

    def tokens_per_item(self, batch: dict) -> list[int]:
        return [conv_frames(mask.bool()) for mask in batch["input_features_mask"]]


class FrameVideos:
    """Gemma 4's video hook: every frame patched and pooled like an image, after its "mm:ss" timestamp.

    Frames arrive sampled already (mmgrpo.processors.video): do_sample_frames=False with the video's
    metadata, whose frame indices and fps give the timestamps. pixel_values_videos and
    video_position_ids [frames of all videos, max_patches, ...], num_frames_per_video [videos].
    """

    modality = "video"
    item_keys = ("num_frames_per_video",)
    patch_keys = ("pixel_values_videos", "video_position_ids")  # one row per frame
    row_keys = ()

    def __init__(self, processor, token_id: int):
        self.video_processor = processor.video_processor
        self.placeholder, self.token_id = processor.video_token, token_id
        self.begin, self.end = processor.boi_token, processor.eoi_token
        self.pooled = self.video_processor.pooling_kernel_size**2

    def processor_kwargs(self) -> dict:
        """The HF processor options that process frames as `process` does (already sampled: not again)."""
        return {"videos_kwargs": {"do_sample_frames": False}}

    def process(self, videos: list) -> tuple[dict[str, torch.Tensor], list[str]]:
        from mmgrpo.templates.hooks import video_metadata

        out = self.video_processor(
            videos=[video.frames for video in videos],
            video_metadata=[video_metadata(video) for video in videos],
            do_sample_frames=False,
            return_metadata=True,
            return_tensors="pt",
        )
        tensors = {key: out[key] for key in ("pixel_values_videos", "video_position_ids", "num_frames_per_video")}
        texts = []
        for metadata, frame_tokens in zip(out["video_metadata"], out["num_soft_tokens_per_video"]):
            frame = f"{self.begin}{self.placeholder * int(frame_tokens)}{self.end}"
            texts.append(" ".join(f"{int(t // 60):02d}:{int(t % 60):02d} {frame}" for t in metadata.timestamps))
        return tensors, texts

    def frame_tokens(self, batch: dict) -> torch.Tensor:
        return (batch["video_position_ids"] != -1).all(dim=-1).sum(dim=-1) // self.pooled  # [frames]

    def patches_per_item(self, batch: dict) -> list[int]:
        return batch["num_frames_per_video"].tolist()

    def tokens_per_item(self, batch: dict) -> list[int]:
        per_frame = self.frame_tokens(batch)
        return [int(part.sum()) for part in per_frame.split(self.patches_per_item(batch))]


@register_template("gemma4")
class Gemma4Template(Template):
    """Template of Gemma 4 (images, videos, and audio where the checkpoint has an audio tower); option: video_nframes, video_fps (frame sampling)."""

    hf_model_types = ("gemma4",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1000"
    components = {
        "backbone": "model",  # vision + audio towers, their embedders, LLM without lm_head
        "vision": "model.vision_tower",
        "aligner": "model.embed_vision",
        "audio": "model.audio_tower",
        "llm": "model.language_model",
        "lm_head": "lm_head",
    }
    stop_tokens = ("<turn|>", "<eos>")
    never_sample_tokens = ("<|image|>", "<|image>", "<image|>", "<|audio|>", "<|audio>", "<audio|>", "<|video|>")
    shared_prefix = True  # mm_token_type_ids on the prompt forward only; KV-shared layers read the K/V their source returns
    sliding_window_layers = True  # sliding-window and full layers interleave, as in Gemma3
    tile_local_tower = True  # each image (video frame) encoded alone: a batch row, its padding masked and stripped
    token_type_key = "mm_token_type_ids"
    token_types = {"image": 1, "video": 2, "audio": 3}
    expand_in_text = True  # a video's "mm:ss" timestamps are text beside the prompt's own
    # Fast paths stay off: the decoder's KV-shared layers, per-layer embeddings and four norms per
    # layer are none of what the shared-prefix forward and the lean decode step assume.
    # vLLM 0.32 (gemma4_mm.py) loads the transformers names itself and expands prompts as the template
    # does (tests/test_vllm_prompts.py). Measured on CPU (docs/models.md): as loaded, it gives the
    # policy's log-probs to 2e-6 once the per-layer embedding row below agrees and image attention is
    # causal on both sides; after a weight sync too, MoE layers included (their experts are prepacked
    # for vLLM's CPU kernel again: mmgrpo/rollout/vllm_weights.py, reload_weights). On CPU its attention has no
    # bidirectional mode: checkpoints with use_bidirectional_attention="vision" stop at start-up
    # (mmgrpo/rollout/vllm_requests.py, one_way_media_attention).

    @property
    def vllm_mismatch(self) -> str:
        """At the positions of media tokens vLLM reads the per-layer embedding of token 0, transformers
        that of the pad token: the same row where the pad token is id 0 (the published vocabulary)."""
        pad = self.tokenizer.pad_token_id
        if pad in (0, None):
            return ""
        return (f"at image and audio tokens vLLM 0.32's Gemma 4 reads the per-layer embedding of token 0, transformers "
                f"that of the pad token (id {pad} in this vocabulary, 0 in the published one): 0.14 nat per token "
                "apart on the tiny model")

    def vllm_prompt_problem(self, prompt) -> str | None:
        if prompt.audios and not torch.cuda.is_available():
            return ("vLLM 0.32's Gemma 4 audio tower stops on CPU (its linear kernel takes no non-contiguous input), "
                    f"and this prompt has {len(prompt.audios)} audio clip(s); run vLLM on a GPU")
        return None

    def build_media(self) -> dict:
        media = {
            "image": PatchImages(self.processor, self.token_id("<|image|>")),
            "video": FrameVideos(self.processor, self.token_id("<|video|>")),
        }
        if getattr(self.processor, "feature_extractor", None) is not None and self.processor.audio_token:
            media["audio"] = ConvAudio(self.processor, self.token_id("<|audio|>"))
        return media

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """`<bos>`, a system turn if given, Gemma 4 turns; one `<|image|>` / `<|audio|>` per medium."""
        text = self.tokenizer.bos_token or ""
        if messages and messages[0]["role"] in ("system", "developer"):
            system = "".join(p.get("text", "").strip() + " " for p in self.content_parts(messages[0]["content"]))
            text += f"<|turn>system\n{system}<turn|>\n"
            messages = messages[1:]
        tags = {"image": "<|image|>", "audio": "<|audio|>", "video": "<|video|>"}
        for message in messages:
            role = "model" if message["role"] == "assistant" else message["role"]
            body = "".join(
                tags.get(part.get("type")) or part.get("text", "").strip()
                for part in self.content_parts(message["content"])
            )
            text += f"<|turn>{role}\n{body}<turn|>\n"
        if add_generation_prompt:
            text += "<|turn>model\n<|channel>thought\n<channel|>"
        return text
