"""Tiny checkpoints of families no template declares, for the generic path (--model_type auto).

Each is a real transformers class built from a config object (about 1M parameters, seeded), its
real processor classes around the tiny BPE tokenizer (mmgrpo.models.tiny_tokenizer) and a chat
template in the family's format, saved with save_pretrained. They live here, not as `tiny:`
recipes: a `tiny:<family>` name is also the family's template name (mmgrpo/models/tiny.py), and
these families have none; the generic path is reached with --model_type auto or by inference.

    folder = build_generic("llava_next", tmp_path)     # one of GENERIC_FAMILIES
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmgrpo.models.tiny_tokenizer import build_tokenizer, chatml_jinja

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 2048}
TILE = 56  # vision towers see 56-pixel tiles of 14-pixel patches: 16 patches

# Mistral's format: <s>[INST]...[/INST]answer</s>; each image one [IMG], expanded by the Pixtral processor
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'user' %}[INST]{% for part in message.content %}"
    "{% if part.type == 'image' %}[IMG]{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}[/INST]"
    "{% elif message.role == 'assistant' %}{% for part in message.content %}{{ part.text }}{% endfor %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
# SmolVLM / Idefics3's format: User:<image>text<end_of_utterance>\nAssistant: answer<end_of_utterance>\n
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}"
    "{{ message.role | capitalize }}{% if message.content[0].type == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message.content %}"
    "{% if part.type == 'image' %}<image>{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _text(tokenizer, ids: dict, model_type: str, **extra) -> dict:
    return {"model_type": model_type, "vocab_size": len(tokenizer), **TEXT, **extra,
            "bos_token_id": ids.get("bos"), "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}


def _llava_next():
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    tokenizer = build_tokenizer(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"),
                                chatml_jinja("You are a helpful assistant.", {"image": "<image>\n"}), None)
    ids = {"eos": tokenizer.convert_tokens_to_ids("<|im_end|>"), "pad": tokenizer.pad_token_id}
    pinpoints = [[TILE, TILE], [TILE, 2 * TILE], [2 * TILE, TILE]]
    config = LlavaNextConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": TILE, "patch_size": 14,
                       "projection_dim": 32},
        text_config=_text(tokenizer, ids, "qwen2"), image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=pinpoints, vision_feature_layer=-1, vision_feature_select_strategy="default",
    )
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                                                image_grid_pinpoints=pinpoints),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )
    return LlavaNextForConditionalGeneration(config), processor, ids


def _mistral3():
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralImageProcessor,
        PixtralProcessor,
    )

    tokenizer = build_tokenizer(("<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"),
                                MISTRAL_CHAT_TEMPLATE, None, eos_token="</s>", pad_token="<pad>", bos_token="<s>")
    ids = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id}
    config = Mistral3Config(
        vision_config={"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "head_dim": 16, "image_size": 2 * TILE, "patch_size": 14},
        text_config=_text(tokenizer, ids, "mistral", sliding_window=None),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1,
    )
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 2 * TILE}, patch_size=14),
        tokenizer=tokenizer, patch_size=14, spatial_merge_size=2, chat_template=tokenizer.chat_template,
    )
    return Mistral3ForConditionalGeneration(config), processor, ids


def _idefics3():
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    tokenizer = build_tokenizer(("<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<image>",
                                 "<fake_token_around_image>", "<global-img>"),
                                IDEFICS3_CHAT_TEMPLATE, None, eos_token="<end_of_utterance>")
    ids = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    config = Idefics3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": TILE, "patch_size": 14},
        text_config=_text(tokenizer, ids, "llama"), scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE}),
        tokenizer=tokenizer, image_seq_len=(TILE // 14) ** 2 // 4, chat_template=tokenizer.chat_template,
    )
    return Idefics3ForConditionalGeneration(config), processor, ids


def _lfm2_vl():
    from transformers import (
        Lfm2VlConfig,
        Lfm2VlForConditionalGeneration,
        Lfm2VlImageProcessor,
        Lfm2VlProcessor,
    )

    tokenizer = build_tokenizer(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<|image_start|>",
                                 "<|image_end|>", "<|img_thumbnail|>"), chatml_jinja(None, {"image": "<image>"}), None)
    ids = {"eos": tokenizer.convert_tokens_to_ids("<|im_end|>"), "pad": tokenizer.pad_token_id}
    text = _text(tokenizer, ids, "lfm2", layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False,
                 norm_eps=1e-5)
    config = Lfm2VlConfig(
        vision_config={"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 14, "num_patches": 64},
        text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), projector_hidden_size=64,
        downsample_factor=2,
    )
    image_processor = Lfm2VlImageProcessor(encoder_patch_size=14, tile_size=TILE, min_image_tokens=4,
                                           max_image_tokens=16, max_tiles=4)
    processor = Lfm2VlProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    return Lfm2VlForConditionalGeneration(config), processor, ids


BUILDERS = {"llava_next": _llava_next, "mistral3": _mistral3, "idefics3": _idefics3, "lfm2_vl": _lfm2_vl}
GENERIC_FAMILIES = tuple(BUILDERS)


def build_generic(family: str, root: Path, *, chat_template: bool = True) -> Path:
    """Build `family`'s tiny checkpoint under `root` (once per root) and return its folder."""
    out = Path(root) / (family if chat_template else family + "-no-chat-template")
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model, processor, ids = BUILDERS[family]()
    model.eval()
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=ids["eos"], pad_token_id=ids["pad"], bos_token_id=ids.get("bos"))
    if not chat_template:
        processor.chat_template = None
        processor.tokenizer.chat_template = None
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "built.json").write_text(json.dumps({"family": family}))
    return out
