"""Gemma3: Gemma's turn format, images as a fixed number of soft tokens, no video or audio.

- `<bos>`, then `<start_of_turn>user\\n...<end_of_turn>\\n` / `<start_of_turn>model\\n...`; a system
  turn's text is prefixed to the first user turn; text parts are trimmed; an image renders as
  one `<start_of_image>`.
- The processor replaces each `<start_of_image>` by the text `\\n\\n<start_of_image>` +
  image_seq_length (256) x `<image_soft_token>` + `<end_of_image>\\n\\n`: the "\\n\\n" merge with
  their neighbours when tokenized, so expansion happens on the text (`expand_in_text`).
  Pan-and-scan crops are not used.
- The forward needs `token_type_ids` (1 on image soft tokens, 0 elsewhere, completions
  included): image tokens attend to each other both ways. Positions are plain 1-D RoPE.
- Gemma3ForConditionalGeneration applies no final-logit soft-capping, whatever its text config
  says (transformers' Gemma3ForCausalLM does): `logit_softcap_field = None`.

Boxes: `[x1, y1, x2, y2]` in 0-1000 of the image ("rel1000"). Gemma3 has no grounding format
of its own; this is Gemini's normalisation in x-first order, to be taught by the reward.
"""

from __future__ import annotations

import torch

from mmgrpo.templates.base import Template, register_template
from mmgrpo.templates.hooks import SIGLIP_TOWER_NAMES


class SoftTokenImages:
    """Gemma3's image hook: one fixed-size tile per image, `image_seq_length` soft tokens."""

    modality = "image"
    item_keys = ("pixel_values",)
    patch_keys = ()
    row_keys = ()

    def __init__(self, processor, placeholder: str, token_id: int, image_token: str, end_token: str):
        self.image_processor = processor.image_processor
        self.placeholder, self.token_id = placeholder, token_id
        self.num_tokens = processor.image_seq_length
        self.sequence = f"\n\n{placeholder}{image_token * self.num_tokens}{end_token}\n\n"

    def process(self, images: list) -> tuple[dict[str, torch.Tensor], list[str]]:
        out = self.image_processor(images, do_pan_and_scan=False, return_tensors="pt")
        return {"pixel_values": out["pixel_values"]}, [self.sequence] * len(images)  # [images, 3, S, S]

    def tokens_per_item(self, batch: dict) -> list[int]:
        return [self.num_tokens] * batch["pixel_values"].shape[0]

    def input_sizes(self, tensors: dict) -> list[tuple[int, int]]:
        size = tensors["pixel_values"].shape[-1]
        return [(size, size)] * tensors["pixel_values"].shape[0]


@register_template("gemma3")
class Gemma3Template(Template):
    """Template of Gemma3 (4B and up, the image-text models); takes images only."""

    hf_model_types = ("gemma3",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "rel1000"
    logit_softcap_field = None  # its forward never caps the logits (see the module docstring)
    components = {
        "backbone": "model",  # vision tower + projector + LLM without lm_head
        "vision": "model.vision_tower",
        "aligner": "model.multi_modal_projector",
        "llm": "model.language_model",
        "lm_head": "lm_head",
    }
    stop_tokens = ("<end_of_turn>", "<eos>")
    never_sample_tokens = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    token_type_key = "token_type_ids"
    token_types = {"image": 1}
    expand_in_text = True
    # the original checkpoints' layout, which vLLM loads: language_model.model.*, multi_modal_projector.*
    # and the SigLIP tower under vision_tower.vision_model.* (the LM head is tied to the embeddings)
    vllm_weight_names = (
        (r"^model\.language_model\.", "language_model.model."),
        (r"^lm_head\.", "language_model.lm_head."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
        *SIGLIP_TOWER_NAMES,
    )
    shared_prefix = True  # token_type_ids on the prompt forward only; completions are text
    sliding_window_layers = True  # Gemma3 interleaves sliding-window and full layers
    tile_local_tower = True  # SigLIP encodes each 896-px image (pan-and-scan crop) alone

    def build_media(self) -> dict:
        return {
            "image": SoftTokenImages(
                self.processor,
                "<start_of_image>",
                self.token_id("<image_soft_token>"),
                "<image_soft_token>",
                "<end_of_image>",
            )
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """`<bos>` and Gemma turns; the system text opens the first user turn; one `<start_of_image>` per image."""
        text = self.tokenizer.bos_token or ""
        prefix = ""
        if messages and messages[0]["role"] == "system":
            prefix = "".join(p.get("text", "") for p in self.content_parts(messages[0]["content"])) + "\n\n"
            messages = messages[1:]
        for i, message in enumerate(messages):
            role = "model" if message["role"] == "assistant" else message["role"]
            body = "".join(
                "<start_of_image>" if part.get("type") == "image" else part.get("text", "").strip()
                for part in self.content_parts(message["content"])
            )
            text += f"<start_of_turn>{role}\n{prefix if i == 0 else ''}{body}<end_of_turn>\n"
        if add_generation_prompt:
            text += "<start_of_turn>model\n"
        return text
