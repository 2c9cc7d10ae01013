"""Qwen2-Audio: ChatML text and audio clips as Whisper features; no images, so no boxes.

Each audio part renders as `Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\\n` (numbered per
prompt), and `<|AUDIO|>` becomes one token per 40 ms of audio: a clip of L mel frames gives
((L - 1) // 2 + 1 - 2) // 2 + 1 tokens. Every clip is padded (or cut) to the feature
extractor's chunk (30 s for the real model) and the encoder always runs over the whole chunk,
so its cost is fixed per clip. Positions are plain 1-D RoPE; the forward needs
`input_features` [clips, mel_bins, frames] and `feature_attention_mask` [clips, frames].
"""

from __future__ import annotations

from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import WhisperAudio, render_chatml

DEFAULT_SYSTEM = "You are a helpful assistant."
VLLM_CHUNK_FRAMES = 3000  # vLLM's Qwen2-Audio takes the real model's 30 s chunk only (fixed in its input schema)


@register_template("qwen2-audio")
class Qwen2AudioTemplate(Template):
    """Template of Qwen2-Audio(-Instruct); takes audio (16 kHz mono); media options do not apply."""

    hf_model_types = ("qwen2_audio",)  # config.json model_type(s): --model_type is inferred from them

    components = {
        "backbone": "model",  # audio tower + LLM without lm_head: returns last_hidden_state
        "audio": "model.audio_tower",
        "aligner": "model.multi_modal_projector",
        "llm": "model.language_model",
        "lm_head": "lm_head",
    }
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    never_sample_tokens = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
    # vLLM's class loads the original layout only (it maps no other names): audio_tower.*,
    # multi_modal_projector.*, language_model.model.*, language_model.lm_head.*. transformers 5 holds
    # them under model.* and lm_head, and 5.19 saves the LLM as language_model.model.model.*.
    vllm_weight_names = (
        (r"^model\.(audio_tower|multi_modal_projector)\.", r"\1."),
        (r"^(?:model\.language_model|language_model\.model\.model)\.", "language_model.model."),
        (r"^lm_head\.", "language_model.lm_head."),
    )
    shared_prefix = True  # a prompt's clips run once, in its own row
    lean_decode = True  # its LLM is Qwen2

    def build_media(self) -> dict:
        return {
            "audio": WhisperAudio(self.processor.feature_extractor, "<|AUDIO|>", self.token_id("<|AUDIO|>"))
        }

    def vllm_unsupported(self) -> str | None:
        frames = self.processor.feature_extractor.nb_max_frames
        if frames != VLLM_CHUNK_FRAMES:
            return (f"its feature extractor pads audio clips to {frames} mel frames; vLLM's Qwen2-Audio takes "
                    f"{VLLM_CHUNK_FRAMES} (30 s) only")
        return None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML with a default system turn; the i-th audio -> `Audio i: <|audio_bos|><|AUDIO|><|audio_eos|>\\n`."""
        count = 0

        def part(p: dict) -> str:
            nonlocal count
            if p.get("type") == "audio":
                count += 1
                return f"Audio {count}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
            return p.get("text", "")

        return render_chatml(messages, part, DEFAULT_SYSTEM, add_generation_prompt)
