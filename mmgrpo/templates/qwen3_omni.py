"""Qwen3-Omni (the thinker of Qwen3-Omni-30B-A3B, which writes text): images, videos, audio, and
videos with sound.

- ChatML without a default system turn; an image renders `<|vision_start|><|image_pad|><|vision_end|>`,
  a video `<|vision_start|><|video_pad|><|vision_end|>` (Qwen3-VL's vision tokens), an audio clip
  `<|audio_start|><|audio_pad|><|audio_end|>`.
- Images and videos are Qwen2-VL's merged patches, seen by Qwen3-VL's vision tower, whose deepstack
  taps add features to the first LLM layers at the visual tokens. The video pixel budget is the video
  processor's own (or video_min_pixels / video_max_pixels, per frame); Qwen3OmniMoeProcessor called
  without a size would put its class default (128 to 768 times 32 x 32 pixels per frame) in its place,
  so the rollout payload names the size (`rollout_processor_kwargs`) and vLLM resizes as training does.
- Audio is Whisper log-mel features padded to the prompt's longest clip (not to a fixed chunk), seen
  by the AuT encoder: it cuts a clip's frames into chunks of 2 * n_window (100) frames and
  downsamples each 8x, so a clip of L frames gives `aut_audio_tokens(L)` tokens.
- Positions are 3-D (mRoPE) from the model's `get_rope_index` (Qwen2.5-Omni's signature); video time
  advances `position_id_per_seconds` (13 in the real checkpoint) ids per second.
- `use_audio_in_video=True`: each video's sound track (`Video.audio`, float32 mono at 16 kHz) joins
  it. The `<|video_pad|>` placeholder becomes `<|audio_start|>`, the video and audio tokens merged by
  time, `<|audio_end|>`: one audio token is one position id (1/13 s), a temporal patch of the video
  sits at t * seconds_per_grid * 13, and its tokens go before every audio token whose index is not
  below that time (as Qwen3OmniMoeProcessor writes it; Qwen2.5-Omni cuts 2-second chunks instead).
- The text model is a mixture of experts (every layer: a router picks top-k of the experts; the
  real thinker has no shared expert). The shared-prefix paths take it (routing is per token); the
  lean decode step does not (it runs a SwiGLU MLP): lean_decode is off.

Boxes: Qwen3-Omni's model card gives no grounding format of its own; it shares Qwen3-VL's vision
tower and vocabulary, whose `[x1, y1, x2, y2]` in 0-1000 of the image ("rel1000") this follows.
"""

from __future__ import annotations

import math

import torch

from mmgrpo.templates.base import register_template
from mmgrpo.templates.hooks import QwenImages, QwenVideos, WhisperAudio, render_chatml
from mmgrpo.templates.qwen2_5_omni import Qwen2_5OmniTemplate
from mmgrpo.templates.qwen2_vl import QWEN_VL_NEVER_SAMPLE

QWEN3_OMNI_PARTS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
    "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
}


def aut_audio_tokens(num_frames: int, n_window: int = 50) -> int:
    """LLM tokens of a clip of `num_frames` mel frames under the AuT encoder: each full chunk of
    2 * n_window frames gives 13 tokens, the rest three stride-2 halvings of itself.

    >>> aut_audio_tokens(100), aut_audio_tokens(150), aut_audio_tokens(1)
    (13, 20, 1)
    """
    chunk = 2 * n_window
    tail = (num_frames % chunk - 1) // 2 + 1
    return ((tail - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // chunk) * 13


class AuTAudio(WhisperAudio):
    """Qwen3-Omni's audio: Whisper features padded to the longest clip of the call (the HF
    processor's `padding=True`, no truncation), counted in AuT tokens."""

    def __init__(self, feature_extractor, placeholder: str, token_id: int, n_window: int):
        super().__init__(feature_extractor, placeholder, token_id)
        self.n_window = n_window
        self.max_samples = None  # AuT takes a clip of any length (no truncation)

    def process(self, audios: list) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        out = self.feature_extractor(
            audios,
            sampling_rate=self.sampling_rate,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        # input_features [clips, mel_bins, longest clip's frames]; feature_attention_mask [clips, frames]
        tensors = {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}
        return tensors, [[self.token_id] * n for n in self.tokens_per_item(tensors)]

    def tokens_per_item(self, batch: dict) -> list[int]:
        return [aut_audio_tokens(int(n), self.n_window) for n in batch["feature_attention_mask"].sum(dim=1)]


@register_template("qwen3-omni")
class Qwen3OmniTemplate(Qwen2_5OmniTemplate):
    """Template of the Qwen3-Omni thinker; options: use_audio_in_video (default False), and
    min_pixels, max_pixels, video_min_pixels, video_max_pixels (per frame), video_fps, video_nframes.

    What it shares with Qwen2.5-Omni (ordering the sound tracks among the audio clips, the batch flag,
    positions from `get_rope_index`) comes from that template; the tokens, the audio hook, the
    interleaving and the checkpoint layout are its own."""

    hf_model_types = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1000"
    components = {
        "backbone": "model",  # vision + audio towers + LLM without lm_head: returns last_hidden_state
        "vision": "model.visual",  # its deepstack mergers (model.visual.merger_list) too
        "aligner": "model.visual.merger",
        "audio": "model.audio_tower",
        "llm": "model.language_model",
        "lm_head": "lm_head",
    }
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    never_sample_tokens = (*QWEN_VL_NEVER_SAMPLE, "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
    shared_prefix = True  # router and experts act per token: a prompt's K/V serve its G completions exactly
    lean_decode = False  # MoE blocks: the lean step has a SwiGLU MLP, not a router and experts
    # vLLM loads the thinker of a full checkpoint (`thinker.model.layers.*`, `thinker.visual.*`,
    # `thinker.audio_tower.*`, `thinker.lm_head.*`) or a thinker folder (the same without `thinker.`),
    # experts one by one or fused, and maps both itself. transformers 5.19 holds a thinker under those
    # names; 5.23 holds its towers and LLM under `model.`: renamed back here.
    vllm_weight_names = (
        (r"^model\.(visual|audio_tower)\.", r"\1."),
        (r"^model\.language_model\.", "model."),
    )
    # vLLM 0.32 gives transformers' log-probs from the checkpoint and after a sync (experts too, on CPU:
    # mmgrpo/rollout/vllm_weights.py, reload_weights), on image, video, audio and text prompts
    # (tests/test_vllm_families.py); a video with its sound is refused per sample. Under transformers
    # 5.19 a run stops at start-up, as Qwen2.5-Omni's (`vllm_mismatch`: the policy's forward skips the towers).
    thinker_model = ("qwen3_omni_moe", "Qwen3OmniMoeThinkerModel")

    def build_media(self) -> dict:
        o = self.options
        return {
            "image": QwenImages(
                self.processor.image_processor, "<|image_pad|>", self.token_id("<|image_pad|>"), o.min_pixels, o.max_pixels
            ),
            "video": QwenVideos(
                self.processor.video_processor,
                "<|video_pad|>",
                self.token_id("<|video_pad|>"),
                o.video_min_pixels,
                o.video_max_pixels,
                seconds_key="video_second_per_grid",
            ),
            "audio": AuTAudio(
                self.processor.feature_extractor,
                "<|audio_pad|>",
                self.token_id("<|audio_pad|>"),
                getattr(self.processor, "n_window", 50),
            ),
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML without a default system turn; each medium -> start, ONE placeholder, end."""
        return render_chatml(
            messages, lambda part: QWEN3_OMNI_PARTS.get(part.get("type"), part.get("text", "")), None, add_generation_prompt
        )

    def interleave(self, video_tensors: dict, index: int, num_audio_tokens: int) -> list[int]:
        """A video with sound: `<|audio_start|>`, its video and audio tokens merged by time, `<|audio_end|>`.

        Times are in position ids: audio token k at k, the tokens of temporal patch t at
        t * seconds_per_grid * position_id_per_seconds, computed in float32 as the model's
        `get_rope_index` does, so the layout and the positions agree at exact ties too.
        """
        grid_t, grid_h, grid_w = video_tensors["video_grid_thw"][index].tolist()
        merge = self.media["video"].merge_size
        frame_tokens = grid_h // merge * grid_w // merge
        seconds = video_tensors["video_second_per_grid"][index].float()
        patch_times = torch.arange(grid_t) * seconds * self.position_id_per_seconds  # [grid_t]
        video_id, audio_id = self.media["video"].token_id, self.media["audio"].token_id
        ids, audio_done = [self.token_id("<|audio_start|>")], 0
        for time in patch_times.tolist():
            # the audio tokens strictly before this patch's time come first
            before = min(num_audio_tokens, max(audio_done, math.ceil(time)))
            ids += [audio_id] * (before - audio_done) + [video_id] * frame_tokens
            audio_done = before
        ids += [audio_id] * (num_audio_tokens - audio_done)
        return ids + [self.token_id("<|audio_end|>")]

    @classmethod
    def model_class(cls, config):
        """A full Qwen3-Omni checkpoint (thinker + talker + code2wav) loads its thinker only: GRPO
        trains the part that writes text. A thinker checkpoint loads as it is."""
        if config.model_type != "qwen3_omni_moe":  # the base Template's: the Auto classes
            return super(Qwen2_5OmniTemplate, cls).model_class(config)
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

        return Qwen3OmniMoeThinkerForConditionalGeneration, config.thinker_config, {"key_mapping": {r"^thinker\.": ""}}

    def vllm_config(self, config: dict) -> dict:
        """A thinker checkpoint's config wrapped as a full model's without speech output: vLLM
        registers the thinker only under the full model's architecture."""
        if config.get("model_type") != "qwen3_omni_moe_thinker":
            return config
        from transformers import Qwen3OmniMoeConfig

        full = Qwen3OmniMoeConfig(thinker_config=config, enable_audio_output=False).to_dict()
        return {**full, "architectures": ["Qwen3OmniMoeForConditionalGeneration"]}
