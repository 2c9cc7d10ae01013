"""Qwen2.5-Omni (the thinker, which writes text): images, videos, audio, and videos with sound.

- ChatML with a default system turn; an image renders `<|vision_bos|><|IMAGE|><|vision_eos|>`,
  a video `<|vision_bos|><|VIDEO|><|vision_eos|>`, an audio clip `<|audio_bos|><|AUDIO|><|audio_eos|>`.
- Images and videos are Qwen2.5-VL's merged patches; audio is Whisper features (a clip of L mel
  frames gives ((L - 1) // 2 + 1 - 2) // 2 + 1 tokens; padding frames are skipped by the encoder).
- Positions are 3-D (mRoPE) from the model's `get_rope_index`; video time advances 25 position
  ids per second, so the forward needs `video_second_per_grid` (seconds per temporal patch).
- `use_audio_in_video=True`: each video's sound track joins it. The track is the video's
  `audio` attribute (a float32 mono array at 16 kHz, set by the loader). The `<|VIDEO|>`
  placeholder then becomes `<|audio_bos|>` + the video and audio tokens interleaved in 2-second
  chunks + `<|audio_eos|>`, and the batch carries `use_audio_in_video=True` for the forward. It
  holds for the whole batch, so with it on every video must have sound.

Boxes: like Qwen2.5-VL, absolute pixels of the resized model input ("abs_input").
"""

from __future__ import annotations

import numpy as np
import torch

from mmgrpo.errors import DataError
from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import QwenImages, QwenVideos, WhisperAudio, render_chatml, rope_core

DEFAULT_SYSTEM = "You are a helpful assistant."

OMNI_PARTS = {
    "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}


def chunk_bounds(positions: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """(start, end) slices of increasing `positions`, cut where a value reaches the next chunk.

    >>> chunk_bounds(np.array([0, 10, 50, 60, 120]), 50)
    [(0, 2), (2, 4), (4, 5)]
    """
    bounds, start, chunk = [], 0, 1
    for i, value in enumerate(positions):
        if value >= chunk * per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    bounds.append((start, len(positions)))
    return bounds


@register_template("qwen2.5-omni")
class Qwen2_5OmniTemplate(Template):
    """Template of the Qwen2.5-Omni thinker; options: use_audio_in_video (default False), and
    min_pixels, max_pixels, video_min_pixels, video_max_pixels (per frame), video_fps, video_nframes."""

    hf_model_types = ("qwen2_5_omni", "qwen2_5_omni_thinker")  # config.json model_type(s): --model_type is inferred from them

    box_convention = "abs_input"
    default_max_pixels = 1280 * 28 * 28  # 1280 visual tokens, as for Qwen2.5-VL
    components = {
        "backbone": "model",  # vision + audio towers + LLM without lm_head: returns last_hidden_state
        "vision": "model.visual",
        "aligner": "model.visual.merger",
        "audio": "model.audio_tower",
        "llm": "model.language_model",
        "lm_head": "lm_head",
    }
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    # vLLM runs the thinker as part of a full Qwen2.5-Omni checkpoint (`thinker.model.*`,
    # `thinker.visual.*`, `thinker.audio_tower.*`, `thinker.lm_head.*` beside `talker.*` and
    # `token2wav.*`, which it skips). transformers 5.19 holds and saves a thinker as `model.*`,
    # `visual.*`, `audio_tower.*`, `lm_head.*`; 5.23 holds its towers and LLM under `model.`.
    vllm_weight_names = (
        (r"^model\.(visual|audio_tower)\.", r"\1."),
        (r"^model\.language_model\.", "model."),
        (r"^(?!thinker\.|talker\.|token2wav\.)", "thinker."),
    )
    # vLLM 0.32's thinker gives the log-probs of transformers' own forward on text, image and audio prompts
    # (5e-7 on the tiny model; video 4.6e-3, as Qwen2.5-VL's videos); a video with its sound, which it lays out
    # in other chunks, is refused per sample (`vllm_prompt_problem`, `check_media_tokens`).
    # transformers' module and class that hold the thinker's towers and LLM inside its `model` (5.23)
    thinker_model = ("qwen2_5_omni", "Qwen2_5OmniThinkerModel")
    shared_prefix = True  # audio, video with sound: the prompt forward takes them as the naive one does
    lean_decode = True  # the thinker's decoder layers are Qwen2-style
    frame_local_tower = True  # the thinker's vision tower is Qwen-VL's: windows, blocks and positions stop at a frame
    never_sample_tokens = (
        "<|IMAGE|>",
        "<|VIDEO|>",
        "<|AUDIO|>",
        "<|vision_bos|>",
        "<|vision_eos|>",
        "<|vision_pad|>",
        "<|audio_bos|>",
        "<|audio_eos|>",
    )

    def __init__(self, processor, use_audio_in_video: bool = False, **kwargs):
        self.use_audio_in_video = bool(use_audio_in_video)
        super().__init__(processor, **kwargs)
        # Video and sound are cut into chunks of this many temporal position ids (2 s at 25 ids/s).
        self.position_id_per_seconds = getattr(processor, "position_id_per_seconds", 25)
        self.tokens_per_chunk = int(
            self.position_id_per_seconds * getattr(processor, "seconds_per_chunk", 2.0)
        )

    def build_media(self) -> dict:
        o = self.options
        return {
            "image": QwenImages(
                self.processor.image_processor,
                "<|IMAGE|>",
                self.token_id("<|IMAGE|>"),
                o.min_pixels,
                o.max_pixels,
            ),
            "video": QwenVideos(
                self.processor.video_processor,
                "<|VIDEO|>",
                self.token_id("<|VIDEO|>"),
                o.video_min_pixels,
                o.video_max_pixels,
                seconds_key="video_second_per_grid",
            ),
            "audio": WhisperAudio(self.processor.feature_extractor, "<|AUDIO|>", self.token_id("<|AUDIO|>")),
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML with a default system turn; each medium -> bos, ONE placeholder, eos."""
        return render_chatml(
            messages,
            lambda part: OMNI_PARTS.get(part.get("type"), part.get("text", "")),
            DEFAULT_SYSTEM,
            add_generation_prompt,
        )

    # -- video with its sound ----------------------------------------------------------------

    def encode_media(self, sample) -> tuple[dict, dict, list]:
        if not (self.use_audio_in_video and sample.videos):
            return super().encode_media(sample)
        mm, expansions, input_sizes = {}, {}, []
        if sample.images:
            tensors, expansions["image"] = self.media["image"].process(sample.images)
            mm.update(tensors)
            input_sizes = self.media["image"].input_sizes(tensors)
        video_tensors, _ = self.media["video"].process(sample.videos)
        mm.update(video_tensors)
        # Audio items in prompt order, a video's track where the video is: features are scattered
        # into the <|AUDIO|> tokens in that order.
        clips, video_clip, standalone = [], {}, iter(sample.audios)
        videos = iter(enumerate(sample.videos))
        for message in sample.messages:
            for part in self.content_parts(message["content"]):
                if part.get("type") == "audio":
                    clips.append(next(standalone))
                elif part.get("type") == "video":
                    index, video = next(videos)
                    track = getattr(video, "audio", None)
                    if track is None or len(track) == 0:
                        raise DataError(
                            f"sample {sample.id}: video {index} has no sound track, but use_audio_in_video is on; "
                            "give videos with sound (Video.audio) or turn use_audio_in_video off"
                        )
                    video_clip[index] = len(clips)
                    clips.append(track)
        audio_tensors, clip_ids = self.media["audio"].process(clips)
        mm.update(audio_tensors)
        expansions["audio"] = [ids for i, ids in enumerate(clip_ids) if i not in video_clip.values()]
        expansions["video"] = [
            self.interleave(video_tensors, i, len(clip_ids[video_clip[i]])) for i in range(len(sample.videos))
        ]
        return mm, expansions, input_sizes

    def interleave(self, video_tensors: dict, index: int, num_audio_tokens: int) -> list[int]:
        """A video with sound: bos, then per 2-second chunk its video tokens and its audio tokens, eos."""
        grid_t, grid_h, grid_w = video_tensors["video_grid_thw"][index].tolist()
        merge = self.media["video"].merge_size
        frame_tokens = grid_h // merge * grid_w // merge
        seconds = float(video_tensors["video_second_per_grid"][index])
        # temporal position of every video token (frame-major), as the processor computes it
        video_positions = np.repeat(np.arange(grid_t), frame_tokens) * seconds * self.position_id_per_seconds
        video_chunks = chunk_bounds(video_positions, self.tokens_per_chunk)
        audio_chunks = chunk_bounds(np.arange(num_audio_tokens), self.tokens_per_chunk)
        video_id, audio_id = self.media["video"].token_id, self.media["audio"].token_id
        ids = [self.token_id("<|audio_bos|>")]
        for j in range(max(len(video_chunks), len(audio_chunks))):
            if j < len(video_chunks):
                ids += [video_id] * (video_chunks[j][1] - video_chunks[j][0])
            if j < len(audio_chunks):
                ids += [audio_id] * (audio_chunks[j][1] - audio_chunks[j][0])
        return ids + [self.token_id("<|audio_eos|>")]

    @classmethod
    def model_class(cls, config):
        """A full Qwen2.5-Omni checkpoint (thinker + talker + vocoder) loads its thinker only: GRPO
        trains the part that writes text. A thinker checkpoint loads as it is."""
        if config.model_type != "qwen2_5_omni":
            return super().model_class(config)
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration

        return Qwen2_5OmniThinkerForConditionalGeneration, config.thinker_config, {"key_mapping": {r"^thinker\.": ""}}

    def vllm_config(self, config: dict) -> dict:
        """A thinker checkpoint's config wrapped as a full model's without speech output: vLLM
        registers the thinker only under the full model's architecture (Qwen2_5OmniModel)."""
        if config.get("model_type") != "qwen2_5_omni_thinker":
            return config
        from transformers import Qwen2_5OmniConfig

        full = Qwen2_5OmniConfig(thinker_config=config, enable_audio_output=False).to_dict()
        return {**full, "architectures": ["Qwen2_5OmniModel"]}

    @property
    def transformers_problem(self) -> str:
        """Where the installed transformers (5.19, vLLM's venv) holds the thinker's towers beside its `model`
        (5.23 holds them inside), the policy's forward, which runs `model` as its backbone, skips them."""
        import importlib

        import transformers

        module, name = self.thinker_model
        if hasattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name):
            return ""
        return (f"transformers {transformers.__version__} holds the thinker's vision and audio towers beside its "
                "`model`, which the policy's forward runs as its backbone, so on prompts with media the policy's "
                "log-probs are not the thinker's (0.1 to 0.9 nat per token on the tiny models against vLLM's; "
                "text alone agrees); transformers 5.23 holds them inside")

    @property
    def vllm_mismatch(self) -> str:
        """The policy's own problem (`transformers_problem`): vLLM's log-probs are the thinker's, the policy's not."""
        return self.transformers_problem

    def vllm_prompt_problem(self, prompt) -> str | None:
        if self.use_audio_in_video and prompt.audios:
            return ("with use_audio_in_video vLLM 0.32 takes the videos' sound tracks and no other audio clip "
                    f"({len(prompt.audios)} here)")
        return None

    def batch_flags(self, prompts: list) -> dict:
        return {"use_audio_in_video": True} if self.use_audio_in_video else {}

    # -- positions ---------------------------------------------------------------------------

    def position_ids(self, model, inputs: dict) -> torch.Tensor:
        """[3, N, seq_len] mRoPE positions from the thinker's `get_rope_index` (padding skipped)."""
        feature_mask = inputs.get("feature_attention_mask")
        position_ids, _ = rope_core(model).get_rope_index(
            inputs["input_ids"],
            image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"),
            attention_mask=inputs["attention_mask"],
            use_audio_in_video=bool(inputs.get("use_audio_in_video", False)),
            audio_seqlens=feature_mask.sum(-1) if feature_mask is not None else None,
            second_per_grids=inputs.get("video_second_per_grid"),
        )
        return position_ids
