"""The tiny model of each family: its special tokens, chat template, config builder, model class and
processor builder (`RECIPES`). `mmgrpo.models.tiny` builds, caches and names the checkpoints.

Adding a family is one `TinyRecipe` entry in `RECIPES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mmgrpo.errors import ConfigError
from mmgrpo.models.tiny_tokenizer import (
    GEMMA3_CHAT_TEMPLATE,
    GEMMA4_CHAT_TEMPLATE,
    GLM4V_CHAT_TEMPLATE,
    QWEN3_OMNI_PARTS,
    QWEN_OMNI_PARTS,
    QWEN_VL_CHAT_TEMPLATE,
    QWEN_VL_PARTS,
    chatml_jinja,
    qwen3_5_jinja,
)

# Small pixel budgets suit tiny models: an image is 4 to 64 merged tokens, a video frame 4 to 16.
IMAGE_MIN_PIXELS = 28 * 28 * 4
IMAGE_MAX_PIXELS = 28 * 28 * 64
VIDEO_MIN_PIXELS = 28 * 28 * 4
VIDEO_MAX_PIXELS = 28 * 28 * 16

# The Qwen2-VL vocabulary's special tokens, in the real vocabulary's order (ids 151643 ...).
QWEN2_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2.5-VL appends tool-call and fill-in-the-middle tokens (ids 151657 ...).
QWEN2_5_VL_SPECIAL_TOKENS = QWEN2_VL_SPECIAL_TOKENS + (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)

# Qwen2-Audio's vocabulary: its audio tokens take the ids where Qwen2-VL has object-ref tokens.
QWEN2_AUDIO_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
)
# Qwen2.5-Omni's vocabulary (ids 151643 ...): Qwen2.5-VL's with audio tokens and renamed vision tokens.
QWEN2_5_OMNI_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)
# Qwen3-Omni's vocabulary: Qwen2.5-VL's (ids 151643 ...), then its audio tokens (the real ids 151669,
# 151670 and 151675; the think, tool-response and speech tokens between them are left out here).
QWEN3_OMNI_SPECIAL_TOKENS = QWEN2_5_VL_SPECIAL_TOKENS + ("<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
# LLaVA-OneVision (Qwen2 LLM): <image> and <video> follow Qwen2's ChatML tokens (ids 151646, 151647).
LLAVA_ONEVISION_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
# Gemma3's special tokens (their real ids are 0-3, 105, 106, 255999, 256000, 262144; here they follow
# the BPE vocabulary like every tiny family's).
GEMMA3_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
# Gemma's vocabulary holds runs of newlines as single tokens, and vLLM's Gemma3 processor looks
# them up by their text (it merges the "\n\n" around an image with the newlines beside it).
GEMMA3_NEWLINE_TOKENS = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")

# Gemma 4's special tokens (turns, the image / audio / video placeholders and their begin / end tokens,
# the thinking channel); here they follow the BPE vocabulary like every tiny family's.
GEMMA4_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|video|>",
    "<|channel>",
    "<channel|>",
    "<|think|>",
)
# Gemma 4's image budget is counted in soft tokens: 70 (the smallest its processor takes) pooled 2x2 from
# at most 280 patches of 8 pixels (the real models: 16-pixel patches pooled 3x3, 280 soft tokens).
GEMMA4_PATCH_SIZE = 8
GEMMA4_POOLING = 2
GEMMA4_MAX_SOFT_TOKENS = 70
GEMMA4_MEL_BINS = 32  # the audio tower's first conv has as many channels as there are mel bins (128 and 128 in the real ones)

# InternVL3 / 3.5's vocabulary (Qwen2.5's, ids 151643 ...) appends image, grounding and video tokens after
# Qwen2.5's tool and fill-in-the-middle ones (<img> is 151665, <IMG_CONTEXT> 151667 in the real vocabulary).
INTERNVL_SPECIAL_TOKENS = QWEN2_5_VL_SPECIAL_TOKENS + (
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<video>",
)
# InternVL tiles an image into squares of INTERNVL_TILE pixels (448 in the real models); InternViT's 14-pixel
# patches, pixel-shuffled 2x2, give (56 / 14 / 2)**2 = 4 tokens per tile (256 in the real models).
INTERNVL_TILE = 56
INTERNVL_TILE_TOKENS = (INTERNVL_TILE // 14 // 2) ** 2

# SigLIP towers (LLaVA-OneVision, Gemma3) see square tiles of TILE_SIZE pixels: (56 / 14)**2 = 16 patches.
TILE_SIZE = 56
# LLaVA-OneVision's "anyres" tilings of an image, in pixels (multiples of the tile).
LLAVA_GRID_PINPOINTS = [[TILE_SIZE * h, TILE_SIZE * w] for h in (1, 2, 3) for w in (1, 2, 3)]
# Gemma3 pools the 4x4 patches of its tile to 2x2 = 4 image tokens (256 in the real model).
GEMMA3_IMAGE_TOKENS = 4
# Whisper-style audio: the encoder's cost is fixed per clip (Qwen2-Audio pads every clip to the chunk),
# so tiny models use few mel bins and short chunks (the real models: 128 bins, 30 s).
AUDIO_MEL_BINS = 16
AUDIO_CHUNK_SECONDS = 4
# ...but the tiny Qwen2-Audio pads its clips to the real model's 30 s chunk: vLLM's Qwen2-Audio takes
# that chunk only (3000 mel frames, fixed in its input schema).
QWEN2_AUDIO_CHUNK_SECONDS = 30


# ---------------------------------------------------------------------------------------------
# Recipes: one entry per family
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyRecipe:
    """How to build one family's tiny checkpoint."""

    family: str  # the name after "tiny:", also the template name
    special_tokens: tuple[str, ...]
    chat_template: str
    make_config: Callable  # (dims, vocab_size, token_ids: dict[str, int]) -> PreTrainedConfig
    model_class: str  # transformers class name, built with `cls(config)`
    make_processor: Callable | None  # (dims) -> ((tokenizer) -> ProcessorMixin); None: the tokenizer alone
    eos_tokens: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")  # the first is the tokenizer's eos
    pad_token: str = "<|endoftext|>"
    bos_token: str = "<|endoftext|>"  # the config's bos id (a Qwen tokenizer adds no bos)
    tokenizer_bos: str | None = None  # a bos the tokenizer knows by name (Gemma3's chat template writes it)
    named_tokens: tuple[tuple[str, str], ...] = ()  # tokenizer attributes processors read, e.g. image_token
    text_tokens: tuple[str, ...] = ()  # plain text kept as one token each, after the special tokens
    init_weights: Callable | None = None  # (model) -> None: re-initialise what transformers zero-initialises


def _qwen_text_dims(dims: dict, vocab_size: int, ids: dict[str, int], mrope: bool = True) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(dims["rope_theta"] or 1000000.0)}
    if mrope:  # mRoPE splits the rotary half-dimension into (temporal, height, width) sections
        rope["mrope_section"] = _mrope(dims)
    return {
        "vocab_size": vocab_size,
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "head_dim": dims["head_dim"],
        "max_position_embeddings": dims["max_position_embeddings"],
        "rope_parameters": rope,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def _mrope(dims: dict) -> list[int]:
    """Split head_dim / 2 in the proportions of Qwen's [16, 24, 24] (of 64)."""
    half = dims["head_dim"] // 2
    temporal = half // 4
    spatial = (half - temporal) // 2
    return [temporal, spatial, half - temporal - spatial]


def _qwen_vl_ids(ids: dict[str, int]) -> dict:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _qwen2_vl_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen2VLConfig

    vision = {
        "depth": dims["vision_depth"],
        "embed_dim": dims["vision_embed_dim"],
        "hidden_size": dims["hidden_size"],  # the merger projects into the LLM width
        "num_heads": dims["vision_num_heads"],
        "mlp_ratio": 2,
        "patch_size": dims["patch_size"],
        "spatial_merge_size": dims["spatial_merge_size"],
        "temporal_patch_size": dims["temporal_patch_size"],
    }
    return Qwen2VLConfig(
        text_config=_qwen_text_dims(dims, vocab_size, ids), vision_config=vision, **_qwen_vl_ids(ids)
    )


def _qwen2_5_vision(dims: dict) -> dict:
    """Qwen2.5-VL's (and Qwen2.5-Omni's) windowed vision tower."""
    return {
        "depth": dims["vision_depth"],
        "hidden_size": dims["vision_embed_dim"],
        "intermediate_size": 2 * dims["vision_embed_dim"],
        "out_hidden_size": dims["hidden_size"],
        "num_heads": dims["vision_num_heads"],
        "patch_size": dims["patch_size"],
        "spatial_merge_size": dims["spatial_merge_size"],
        "temporal_patch_size": dims["temporal_patch_size"],
        "window_size": 112,
        "fullatt_block_indexes": [dims["vision_depth"] - 1],  # window attention elsewhere
    }


def _qwen2_5_vl_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen2_5_VLConfig

    vision = {**_qwen2_5_vision(dims), "tokens_per_second": 2}
    return Qwen2_5_VLConfig(
        text_config=_qwen_text_dims(dims, vocab_size, ids), vision_config=vision, **_qwen_vl_ids(ids)
    )


def _qwen3_vl_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen3VLConfig

    text = _qwen_text_dims(dims, vocab_size, ids)
    theta = float(dims["rope_theta"] or 5000000.0)
    text["rope_parameters"] = {**text["rope_parameters"], "rope_theta": theta, "mrope_interleaved": True}
    vision = {
        "depth": dims["vision_depth"],
        "hidden_size": dims["vision_embed_dim"],
        "intermediate_size": 2 * dims["vision_embed_dim"],
        "out_hidden_size": dims["hidden_size"],
        "num_heads": dims["vision_num_heads"],
        "patch_size": dims["patch_size"],
        "spatial_merge_size": dims["spatial_merge_size"],
        "temporal_patch_size": dims["temporal_patch_size"],
        "num_position_embeddings": 64,  # an 8x8 learned grid, interpolated to each image's grid
        "deepstack_visual_indexes": [0],  # block 0's features are added to the LLM's first layer
    }
    return Qwen3VLConfig(text_config=text, vision_config=vision, **_qwen_vl_ids(ids))


# Qwen3-VL-MoE at tiny size: the real structure (every decoder layer a sparse MoE block, top-k of
# several experts, the k weights renormalised, no shared experts), 4 experts and 2 per token (the
# real 30B-A3B: 128 and 8).
TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


def _qwen3_vl_moe_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen3VLMoeConfig

    dense = _qwen3_vl_config(dims, vocab_size, ids)  # Qwen3-VL's towers, rope and token ids
    # norm_topk_prob: as the real config.json has it (transformers' router always renormalises; vLLM reads the key)
    text = {**dense.text_config.to_dict(), **TINY_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    for key in ("model_type", "architectures", "transformers_version", "dtype"):
        text.pop(key, None)
    vision = {k: v for k, v in dense.vision_config.to_dict().items() if k not in ("model_type", "transformers_version")}
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **_qwen_vl_ids(ids))


def _whisper_encoder(dims: dict, chunk_seconds: int = AUDIO_CHUNK_SECONDS) -> dict:
    """A 2-layer Whisper-style audio encoder over AUDIO_MEL_BINS mel bins and clips of `chunk_seconds`."""
    return {
        "num_mel_bins": AUDIO_MEL_BINS,
        "encoder_layers": dims["vision_depth"],
        "encoder_attention_heads": dims["vision_num_heads"],
        "encoder_ffn_dim": 2 * dims["vision_embed_dim"],
        "d_model": dims["vision_embed_dim"],
        "max_source_positions": chunk_seconds * 50,  # mel frames (100 per second) after the stride-2 conv
    }


def _qwen2_audio_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen2AudioConfig

    text = {"model_type": "qwen2", **_qwen_text_dims(dims, vocab_size, ids, mrope=False)}
    audio = {"model_type": "qwen2_audio_encoder", **_whisper_encoder(dims, QWEN2_AUDIO_CHUNK_SECONDS)}
    return Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=ids["<|AUDIO|>"])


def _qwen2_5_omni_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen2_5OmniThinkerConfig

    text = {**_qwen_text_dims(dims, vocab_size, ids), "tie_word_embeddings": False}
    audio = {**_whisper_encoder(dims), "n_window": 50, "output_dim": dims["hidden_size"]}
    return Qwen2_5OmniThinkerConfig(
        audio_config=audio,
        vision_config=_qwen2_5_vision(dims),
        text_config=text,
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        user_token_id=ids["<|im_start|>"],  # unused by the thinker's forward
    )


def _qwen3_omni_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    """Qwen3-Omni's thinker: an MoE text model (every layer sparse: 4 experts, top-2, no shared
    expert, as the real thinker has none), Qwen3-VL's vision tower with a deepstack tap, and the
    AuT audio encoder (three stride-2 convolutions over 1-second chunks of mel frames, windowed
    attention)."""
    from transformers import Qwen3OmniMoeThinkerConfig

    text = _qwen_text_dims(dims, vocab_size, ids)
    theta = float(dims["rope_theta"] or 1000000.0)
    text["rope_parameters"] = {**text["rope_parameters"], "rope_theta": theta, "mrope_interleaved": True}
    text.update(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=dims["intermediate_size"] // 2,
        norm_topk_prob=True,  # as the real thinker
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    )
    vision = {
        "depth": dims["vision_depth"],
        "hidden_size": dims["vision_embed_dim"],
        "intermediate_size": 2 * dims["vision_embed_dim"],
        "out_hidden_size": dims["hidden_size"],
        "num_heads": dims["vision_num_heads"],
        "patch_size": dims["patch_size"],
        "spatial_merge_size": dims["spatial_merge_size"],
        "temporal_patch_size": dims["temporal_patch_size"],
        "num_position_embeddings": 64,  # an 8x8 learned grid, interpolated to each image's grid
        "deepstack_visual_indexes": [0],  # block 0's features are added to the LLM's first layer
        # read by vLLM, as in the real config.json: the learned grid's side is image_size / patch_size
        "image_size": 8 * dims["patch_size"],
        "apply_vit_abs_pos_embed": True,
    }
    audio = {
        "num_mel_bins": AUDIO_MEL_BINS,
        "encoder_layers": dims["vision_depth"],
        "encoder_attention_heads": dims["vision_num_heads"],
        "encoder_ffn_dim": 2 * dims["vision_embed_dim"],
        "d_model": dims["vision_embed_dim"],
        "output_dim": dims["hidden_size"],
        "downsample_hidden_size": 32,
        "n_window": 50,  # 100 mel frames (1 s) per convolution chunk, as the real encoder
        "n_window_infer": 400,  # attention windows of 4 chunks (the real one: 8)
        "max_source_positions": 200,
    }
    return Qwen3OmniMoeThinkerConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        audio_token_id=ids["<|audio_pad|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"],
        audio_end_token_id=ids["<|audio_end|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        position_id_per_seconds=13,  # the real checkpoint's value (its processor's too)
        user_token_id=ids["<|im_start|>"],  # unused by the thinker's forward
    )


def _siglip_vision(dims: dict) -> dict:
    """A 2-layer SigLIP vision tower on TILE_SIZE-pixel tiles of `patch_size` patches."""
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": dims["vision_embed_dim"],
        "intermediate_size": 2 * dims["vision_embed_dim"],
        "num_hidden_layers": dims["vision_depth"],
        "num_attention_heads": dims["vision_num_heads"],
        "image_size": TILE_SIZE,
        "patch_size": dims["patch_size"],
        "vision_use_head": False,
    }


def _llava_onevision_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import LlavaOnevisionConfig

    return LlavaOnevisionConfig(
        vision_config=_siglip_vision(dims),
        text_config={"model_type": "qwen2", **_qwen_text_dims(dims, vocab_size, ids, mrope=False)},
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
        image_grid_pinpoints=LLAVA_GRID_PINPOINTS,
    )


def _gemma3_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Gemma3Config

    if dims["rope_theta"]:
        raise ConfigError("tiny:gemma3 takes no rope_theta override (its local and global rotary bases go together)")
    text = {
        "vocab_size": vocab_size,
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "head_dim": dims["head_dim"],
        "query_pre_attn_scalar": dims["head_dim"],
        "max_position_embeddings": dims["max_position_embeddings"],
        "sliding_window": 512,
        "layer_types": ["sliding_attention"] * (dims["num_hidden_layers"] - 1) + ["full_attention"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids["<eos>"],
        "pad_token_id": ids["<pad>"],
    }
    return Gemma3Config(
        text_config=text,
        vision_config=_siglip_vision(dims),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )


def _gemma3_init(model) -> None:
    """transformers zero-initialises Gemma3's image projection: without this the image has no effect."""
    import torch

    projection = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        projection.normal_(0.0, projection.shape[0] ** -0.5)


def _gemma4_text(dims: dict, vocab_size: int, ids: dict[str, int]) -> dict:
    """Gemma 4's decoder at tiny size, with the structure of its small (E2B / E4B) models.

    Layers come in groups of (sliding, sliding, full): `num_hidden_layers` counts the groups. The full
    layers have wider heads (`global_head_dim`) and rotate a quarter of them ("proportional" RoPE); the
    second half of the groups reuse the keys and values of the last layer of each type before them
    (KV sharing); every layer adds its slice of the per-layer embeddings (PLE). Images attend to
    themselves both ways in the sliding layers (`use_bidirectional_attention="vision"`, as in the
    26B and 31B models), the full layers' values are their keys (`attention_k_eq_v`, 31B), and each
    layer adds 4 experts under top-2 routing to its MLP (26B-A4B: 128 experts, top 8). No published
    checkpoint has all of these; the tiny model runs every path the template must serve.
    The final-logit soft-capping of the real models (30.0) is left off: at tiny scale the logits stay
    far below it; tests/test_softcap.py runs a capped copy.
    """
    if dims["rope_theta"]:
        raise ConfigError("tiny:gemma4 takes no rope_theta override (its local and global rotary bases go together)")
    groups = dims["num_hidden_layers"]
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * groups
    return {
        "vocab_size": vocab_size,
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "head_dim": dims["head_dim"],
        "global_head_dim": 2 * dims["head_dim"],
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "max_position_embeddings": dims["max_position_embeddings"],
        "sliding_window": 512,
        "layer_types": layer_types,
        "num_kv_shared_layers": 3 * (groups // 2),
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": vocab_size,
        "use_bidirectional_attention": "vision",
        "enable_moe_block": True,  # 26B-A4B: beside each layer's MLP, experts under top-k routing
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": dims["intermediate_size"] // 8,
        "final_logit_softcapping": None,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids["<eos>"],
        "pad_token_id": ids["<pad>"],
    }


def _gemma4_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Gemma4Config

    vision = {
        "hidden_size": dims["vision_embed_dim"],
        "intermediate_size": 2 * dims["vision_embed_dim"],
        "num_hidden_layers": dims["vision_depth"],
        "num_attention_heads": dims["vision_num_heads"],
        "num_key_value_heads": dims["vision_num_heads"],
        "head_dim": dims["vision_embed_dim"] // dims["vision_num_heads"],
        "patch_size": GEMMA4_PATCH_SIZE,
        "pooling_kernel_size": GEMMA4_POOLING,
        "position_embedding_size": GEMMA4_MAX_SOFT_TOKENS * GEMMA4_POOLING**2,  # the widest row of patches
        "use_clipped_linears": True,
        "default_output_length": GEMMA4_MAX_SOFT_TOKENS,  # the published configs carry it; vLLM reads it
    }
    audio = {
        "hidden_size": dims["vision_embed_dim"],
        "num_hidden_layers": dims["vision_depth"],
        "num_attention_heads": dims["vision_num_heads"],
        "subsampling_conv_channels": [GEMMA4_MEL_BINS, 8],
        "output_proj_dims": dims["vision_embed_dim"],
    }
    return Gemma4Config(
        text_config=_gemma4_text(dims, vocab_size, ids),
        vision_config=vision,
        audio_config=audio,
        boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"],
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"],
    )


def _gemma4_init(model) -> None:
    """What transformers leaves unlike a trained checkpoint: every patch position's embedding is ones
    (drawn here, so the tower tells positions apart), and the clipped linears' bounds are infinite
    (the real checkpoints hold finite ones; a checkpoint with inf is refused at save). Bounds of
    +-1e4 never bind at this size."""
    import torch

    table = model.model.vision_tower.patch_embedder.position_embedding_table
    with torch.no_grad():
        table.normal_(0.0, 0.02)
        for name, buffer in model.named_buffers():
            if name.endswith(("input_min", "output_min", "input_max", "output_max")):
                buffer.fill_(-1e4 if name.endswith("min") else 1e4)


def _internvl_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    """InternVL3.5's layout: an InternViT tower (CLS dropped, pixel shuffle 0.5), an MLP projector, Qwen3."""
    from transformers import InternVLConfig

    text = {"model_type": "qwen3", **_qwen_text_dims(dims, vocab_size, ids, mrope=False), "tie_word_embeddings": False}
    vision = {
        "hidden_size": dims["vision_embed_dim"],
        "intermediate_size": 2 * dims["vision_embed_dim"],
        "num_hidden_layers": dims["vision_depth"],
        "num_attention_heads": dims["vision_num_heads"],
        "image_size": INTERNVL_TILE,
        "patch_size": dims["patch_size"],
    }
    return InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=INTERNVL_TILE_TOKENS,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )


def _qwen2_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen2Config

    return Qwen2Config(**_qwen_text_dims(dims, vocab_size, ids, mrope=False), tie_word_embeddings=False)


def _qwen_patches(dims: dict) -> dict:
    return {
        "patch_size": dims["patch_size"],
        "merge_size": dims["spatial_merge_size"],
        "temporal_patch_size": dims["temporal_patch_size"],
    }


def _qwen_image_processor(dims: dict, pixels: tuple[int, int] = (IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS)):
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(min_pixels=pixels[0], max_pixels=pixels[1], **_qwen_patches(dims))


def _qwen_video_processor(dims: dict, cls_name: str = "Qwen2VLVideoProcessor", frames: int = 1, library_budget: bool = False):
    """Qwen's video processor; `frames` > 1 makes the pixel budget a per-clip one (Qwen3-VL's);
    `library_budget`: transformers' own budget for the class (a real size's, not the tiny one)."""
    import transformers

    if library_budget:
        return getattr(transformers, cls_name)(**_qwen_patches(dims))
    if frames == 1:
        budget = {"min_pixels": VIDEO_MIN_PIXELS, "max_pixels": VIDEO_MAX_PIXELS}
    else:
        budget = {"size": {"shortest_edge": VIDEO_MIN_PIXELS * 2, "longest_edge": VIDEO_MAX_PIXELS * frames}}
    video_processor = getattr(transformers, cls_name)(**budget, **_qwen_patches(dims))
    if hasattr(video_processor, "cap_pixels_per_frame"):
        video_processor.cap_pixels_per_frame = False  # the size budget is the cap
    return video_processor


def _whisper_features(chunk_seconds: int = AUDIO_CHUNK_SECONDS):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(
        feature_size=AUDIO_MEL_BINS,
        sampling_rate=16000,
        chunk_length=chunk_seconds,
        return_attention_mask=True,
    )


def qwen_vl_processor(processor_class: str, dims: dict, pixels: tuple[int, int] = (IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS),
                      library_video_budget: bool = False):
    """(tokenizer) -> a Qwen VL processor with `dims`' patch sizes; `pixels`: the image budget (min, max);
    `library_video_budget`: the video processor keeps transformers' budget (real sizes), else the tiny one."""

    def make(tokenizer):
        import transformers

        video_processor = _qwen_video_processor(
            dims,
            "Qwen3VLVideoProcessor" if processor_class == "Qwen3VLProcessor" else "Qwen2VLVideoProcessor",
            frames=8 if processor_class == "Qwen3VLProcessor" else 1,
            library_budget=library_video_budget,
        )
        return getattr(transformers, processor_class)(
            image_processor=_qwen_image_processor(dims, pixels),
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=tokenizer.chat_template,
        )

    return make


def _qwen2_audio_processor(dims: dict):
    def make(tokenizer):
        from transformers import Qwen2AudioProcessor

        return Qwen2AudioProcessor(
            feature_extractor=_whisper_features(QWEN2_AUDIO_CHUNK_SECONDS), tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )

    return make


def _qwen2_5_omni_processor(dims: dict):
    def make(tokenizer):
        from transformers import Qwen2_5OmniProcessor

        return Qwen2_5OmniProcessor(
            image_processor=_qwen_image_processor(dims),
            video_processor=_qwen_video_processor(dims),
            feature_extractor=_whisper_features(),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )

    return make


def _qwen3_omni_processor(dims: dict):
    def make(tokenizer):
        from transformers import Qwen3OmniMoeProcessor

        return Qwen3OmniMoeProcessor(
            image_processor=_qwen_image_processor(dims),
            video_processor=_qwen_video_processor(dims),
            feature_extractor=_whisper_features(),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )

    return make


def _llava_onevision_processor(dims: dict):
    def make(tokenizer):
        from transformers import (
            LlavaOnevisionImageProcessor,
            LlavaOnevisionProcessor,
            LlavaOnevisionVideoProcessor,
        )

        tile = {"height": TILE_SIZE, "width": TILE_SIZE}
        return LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(
                size=tile, image_grid_pinpoints=LLAVA_GRID_PINPOINTS
            ),
            tokenizer=tokenizer,
            video_processor=LlavaOnevisionVideoProcessor(size=tile),
            num_image_tokens=(TILE_SIZE // dims["patch_size"]) ** 2,
            vision_feature_select_strategy="full",
            vision_aspect_ratio="anyres_max_9",
            chat_template=tokenizer.chat_template,
        )

    return make


def _gemma3_processor(dims: dict):
    def make(tokenizer):
        from transformers import Gemma3ImageProcessor, Gemma3Processor

        return Gemma3Processor(
            image_processor=Gemma3ImageProcessor(size={"height": TILE_SIZE, "width": TILE_SIZE}),
            tokenizer=tokenizer,
            image_seq_length=GEMMA3_IMAGE_TOKENS,
            chat_template=tokenizer.chat_template,
        )

    return make


# ---------------------------------------------------------------------------------------------
# GLM-4.1V / GLM-4.5V / GLM-4.6V
# ---------------------------------------------------------------------------------------------

# GLM-4.1V's special tokens in the real vocabulary's order (ids 151329 ... 151344 for the first sixteen).
GLM4V_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<|begin_of_box|>",
    "<|end_of_box|>",
)
# The thinking format's tags: whole tokens in GLM's vocabulary, but not special (decoding keeps them).
GLM4V_TEXT_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")


def _glm4v_text(dims: dict, vocab_size: int, ids: dict[str, int]) -> dict:
    """GLM-4.1V's language model: RoPE on half of each head (partial_rotary_factor 0.5), that half
    split into (temporal, height, width) sections in the proportions of the real [8, 12, 12]."""
    if dims["hidden_size"] != dims["num_attention_heads"] * dims["head_dim"]:
        raise ConfigError("tiny GLM-4V models take head_dim = hidden_size / num_attention_heads (their config has no head_dim)")
    rotary_half = dims["head_dim"] // 4  # half of the head rotates; mrope sections cover half of that
    temporal = rotary_half // 4
    spatial = (rotary_half - temporal) // 2
    return {
        "vocab_size": vocab_size,
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "max_position_embeddings": dims["max_position_embeddings"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(dims["rope_theta"] or 10000.0),
            "partial_rotary_factor": 0.5,
            "mrope_section": [temporal, spatial, rotary_half - temporal - spatial],
        },
        "pad_token_id": ids["<|endoftext|>"],
        # q/k/v have biases (transformers builds them whatever the config says); GLM-4.1V's config.json says
        # so and vLLM reads it: without it vLLM builds q/k/v without bias and ignores the synced ones
        "attention_bias": True,
    }


def _glm4v_vision(dims: dict) -> dict:
    """GLM-4.1V's vision tower: learned positions on a 4x4 grid (24x24 in the real one), interpolated
    to each image; a conv downsample and a SwiGLU merger into the LLM width."""
    return {
        "depth": dims["vision_depth"],
        "hidden_size": dims["vision_embed_dim"],
        "num_heads": dims["vision_num_heads"],
        "out_hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],  # the merger's
        "image_size": TILE_SIZE,
        "patch_size": dims["patch_size"],
        "spatial_merge_size": dims["spatial_merge_size"],
        "temporal_patch_size": dims["temporal_patch_size"],
    }


def _glm4v_ids(ids: dict[str, int]) -> dict:
    return {
        "image_token_id": ids["<|image|>"],
        "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"],
        "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"],
        "video_end_token_id": ids["<|end_of_video|>"],
    }


def _glm4v_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Glm4vConfig

    return Glm4vConfig(
        text_config=_glm4v_text(dims, vocab_size, ids), vision_config=_glm4v_vision(dims), **_glm4v_ids(ids)
    )


def _glm4v_moe_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    """GLM-4.5V: the first layer dense, the others MoE: 4 routed experts (128 in the real one), top-2
    (8) of them per token, sigmoid router with normalised weights, one shared expert (1)."""
    from transformers import Glm4vMoeConfig

    text = {
        **_glm4v_text(dims, vocab_size, ids),
        # in GLM-4.5V's config.json (head_dim 128, no q/k norm) and read by vLLM's GLM-4 MoE; transformers ignores them
        "head_dim": dims["head_dim"],
        "use_qk_norm": False,
        "moe_intermediate_size": dims["intermediate_size"] // 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
    }
    return Glm4vMoeConfig(text_config=text, vision_config=_glm4v_vision(dims), **_glm4v_ids(ids))


def _glm46v_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    """GLM-4.6V's wrapper class over GLM-4.1V's dense LLM and tower (as GLM-4.6V-Flash has them)."""
    from transformers import Glm46VConfig

    return Glm46VConfig(
        text_config={"model_type": "glm4v_text", **_glm4v_text(dims, vocab_size, ids)},
        vision_config={"model_type": "glm4v_vision", **_glm4v_vision(dims)},
        **_glm4v_ids(ids),
    )


def _glm_router_init(model) -> None:
    """transformers zero-initialises GLM's MoE router: every expert would score the same."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.normal_(0.0, parameter.shape[1] ** -0.5)


def glm4v_processor(version: str, dims: dict):
    """(tokenizer) -> GLM's processor; version "4v" (GLM-4.1V, GLM-4.5V) or "46V" (GLM-4.6V).

    The image budget counts an image twice (GLM's resize treats it as two frames); the video
    budget is per clip, as Qwen3-VL's."""

    def make(tokenizer):
        import transformers

        patches = _qwen_patches(dims)
        image_processor = getattr(transformers, f"Glm{version}ImageProcessor")(
            size={"shortest_edge": 2 * IMAGE_MIN_PIXELS, "longest_edge": 2 * IMAGE_MAX_PIXELS}, **patches
        )
        video_processor = getattr(transformers, f"Glm{version}VideoProcessor")(
            size={"shortest_edge": 2 * VIDEO_MIN_PIXELS, "longest_edge": 8 * VIDEO_MAX_PIXELS}, **patches
        )
        return getattr(transformers, f"Glm{version}Processor")(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=tokenizer.chat_template,
        )

    return make


def _gemma4_processor(dims: dict):
    def make(tokenizer):
        from transformers import (
            Gemma4AudioFeatureExtractor,
            Gemma4ImageProcessor,
            Gemma4Processor,
            Gemma4VideoProcessor,
        )

        patches = {
            "patch_size": GEMMA4_PATCH_SIZE,
            "pooling_kernel_size": GEMMA4_POOLING,
            "max_soft_tokens": GEMMA4_MAX_SOFT_TOKENS,
        }
        return Gemma4Processor(
            feature_extractor=Gemma4AudioFeatureExtractor(feature_size=GEMMA4_MEL_BINS),
            image_processor=Gemma4ImageProcessor(**patches),
            tokenizer=tokenizer,
            video_processor=Gemma4VideoProcessor(**patches),
            image_seq_length=GEMMA4_MAX_SOFT_TOKENS,
            chat_template=tokenizer.chat_template,
        )

    return make


def _glm_recipe(family: str, make_config, model_class: str, version: str, **extra) -> TinyRecipe:
    return TinyRecipe(
        family=family,
        special_tokens=GLM4V_SPECIAL_TOKENS,
        chat_template=GLM4V_CHAT_TEMPLATE,
        make_config=make_config,
        model_class=model_class,
        make_processor=lambda dims: glm4v_processor(version, dims),
        eos_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),  # GLM-4.1V's generation_config
        text_tokens=GLM4V_TEXT_TOKENS,
        **extra,
    )


def _internvl_processor(dims: dict):
    def make(tokenizer):
        from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

        tile = {"height": INTERNVL_TILE, "width": INTERNVL_TILE}
        return InternVLProcessor(
            image_processor=GotOcr2ImageProcessor(
                size=tile, crop_to_patches=True, min_patches=1, max_patches=12,
                image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
            ),
            tokenizer=tokenizer,
            video_processor=InternVLVideoProcessor(size=tile),
            image_seq_length=INTERNVL_TILE_TOKENS,
            chat_template=tokenizer.chat_template,
        )

    return make


RECIPES: dict[str, TinyRecipe] = {
    "qwen2-vl": TinyRecipe(
        family="qwen2-vl",
        special_tokens=QWEN2_VL_SPECIAL_TOKENS,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
        make_config=_qwen2_vl_config,
        model_class="Qwen2VLForConditionalGeneration",
        make_processor=lambda dims: qwen_vl_processor("Qwen2VLProcessor", dims),
    ),
    "qwen2.5-vl": TinyRecipe(
        family="qwen2.5-vl",
        special_tokens=QWEN2_5_VL_SPECIAL_TOKENS,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
        make_config=_qwen2_5_vl_config,
        model_class="Qwen2_5_VLForConditionalGeneration",
        make_processor=lambda dims: qwen_vl_processor("Qwen2_5_VLProcessor", dims),
    ),
    "qwen3-vl": TinyRecipe(
        family="qwen3-vl",
        special_tokens=QWEN2_5_VL_SPECIAL_TOKENS,
        chat_template=chatml_jinja(None, QWEN_VL_PARTS),
        make_config=_qwen3_vl_config,
        model_class="Qwen3VLForConditionalGeneration",
        make_processor=lambda dims: qwen_vl_processor("Qwen3VLProcessor", dims),
    ),
    "qwen3-vl-moe": TinyRecipe(
        family="qwen3-vl-moe",
        special_tokens=QWEN2_5_VL_SPECIAL_TOKENS,
        chat_template=chatml_jinja(None, QWEN_VL_PARTS),
        make_config=_qwen3_vl_moe_config,
        model_class="Qwen3VLMoeForConditionalGeneration",
        make_processor=lambda dims: qwen_vl_processor("Qwen3VLProcessor", dims),
    ),
    "qwen2-audio": TinyRecipe(
        family="qwen2-audio",
        special_tokens=QWEN2_AUDIO_SPECIAL_TOKENS,
        chat_template=chatml_jinja(
            "You are a helpful assistant.",
            {"audio": "Audio {{ counts.audio }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"},
        ),
        make_config=_qwen2_audio_config,
        model_class="Qwen2AudioForConditionalGeneration",
        make_processor=_qwen2_audio_processor,
    ),
    "qwen2.5-omni": TinyRecipe(
        family="qwen2.5-omni",
        special_tokens=QWEN2_5_OMNI_SPECIAL_TOKENS,
        chat_template=chatml_jinja("You are a helpful assistant.", QWEN_OMNI_PARTS),
        make_config=_qwen2_5_omni_config,
        model_class="Qwen2_5OmniThinkerForConditionalGeneration",
        make_processor=_qwen2_5_omni_processor,
        named_tokens=(
            ("image_token", "<|IMAGE|>"),
            ("audio_token", "<|AUDIO|>"),
            ("video_token", "<|VIDEO|>"),
            ("vision_bos_token", "<|vision_bos|>"),
            ("vision_eos_token", "<|vision_eos|>"),
            ("audio_bos_token", "<|audio_bos|>"),
            ("audio_eos_token", "<|audio_eos|>"),
        ),
    ),
    "qwen3-omni": TinyRecipe(
        family="qwen3-omni",
        special_tokens=QWEN3_OMNI_SPECIAL_TOKENS,
        chat_template=chatml_jinja(None, QWEN3_OMNI_PARTS),
        make_config=_qwen3_omni_config,
        model_class="Qwen3OmniMoeThinkerForConditionalGeneration",
        make_processor=_qwen3_omni_processor,
        named_tokens=(
            ("image_token", "<|image_pad|>"),
            ("audio_token", "<|audio_pad|>"),
            ("video_token", "<|video_pad|>"),
            ("vision_bos_token", "<|vision_start|>"),
            ("vision_eos_token", "<|vision_end|>"),
            ("audio_bos_token", "<|audio_start|>"),
            ("audio_eos_token", "<|audio_end|>"),
        ),
    ),
    "llava-onevision": TinyRecipe(
        family="llava-onevision",
        special_tokens=LLAVA_ONEVISION_SPECIAL_TOKENS,
        chat_template=chatml_jinja(
            "You are a helpful assistant.", {"image": "<image>\n", "video": "<video>\n"}
        ),
        make_config=_llava_onevision_config,
        model_class="LlavaOnevisionForConditionalGeneration",
        make_processor=_llava_onevision_processor,
    ),
    "gemma3": TinyRecipe(
        family="gemma3",
        special_tokens=GEMMA3_SPECIAL_TOKENS,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        make_config=_gemma3_config,
        model_class="Gemma3ForConditionalGeneration",
        make_processor=_gemma3_processor,
        eos_tokens=("<eos>", "<end_of_turn>"),
        pad_token="<pad>",
        bos_token="<bos>",
        tokenizer_bos="<bos>",
        named_tokens=(
            ("boi_token", "<start_of_image>"),
            ("eoi_token", "<end_of_image>"),
            ("image_token", "<image_soft_token>"),
        ),
        text_tokens=GEMMA3_NEWLINE_TOKENS,
        init_weights=_gemma3_init,
    ),
    "gemma4": TinyRecipe(
        family="gemma4",
        special_tokens=GEMMA4_SPECIAL_TOKENS,
        chat_template=GEMMA4_CHAT_TEMPLATE,
        make_config=_gemma4_config,
        model_class="Gemma4ForConditionalGeneration",
        make_processor=_gemma4_processor,
        eos_tokens=("<eos>", "<turn|>"),
        pad_token="<pad>",
        bos_token="<bos>",
        tokenizer_bos="<bos>",
        named_tokens=(
            ("image_token", "<|image|>"),
            ("boi_token", "<|image>"),
            ("eoi_token", "<image|>"),
            ("audio_token", "<|audio|>"),
            ("boa_token", "<|audio>"),
            ("eoa_token", "<audio|>"),
        ),
        init_weights=_gemma4_init,
    ),
    "internvl": TinyRecipe(
        family="internvl",
        special_tokens=INTERNVL_SPECIAL_TOKENS,
        chat_template=chatml_jinja(None, {"image": "<IMG_CONTEXT>\n", "video": "<video>\n"}),
        make_config=_internvl_config,
        model_class="InternVLForConditionalGeneration",
        make_processor=_internvl_processor,
        named_tokens=(
            ("start_image_token", "<img>"),
            ("end_image_token", "</img>"),
            ("context_image_token", "<IMG_CONTEXT>"),
            ("video_token", "<video>"),
        ),
    ),
    "qwen2": TinyRecipe(
        family="qwen2",
        special_tokens=QWEN2_5_VL_SPECIAL_TOKENS,  # Qwen2.5's text vocabulary has the same specials
        chat_template=chatml_jinja("You are a helpful assistant.", {}),
        make_config=_qwen2_config,
        model_class="Qwen2ForCausalLM",
        make_processor=None,
    ),
    "glm4v": _glm_recipe("glm4v", _glm4v_config, "Glm4vForConditionalGeneration", "4v"),
    "glm4v-moe": _glm_recipe(
        "glm4v-moe", _glm4v_moe_config, "Glm4vMoeForConditionalGeneration", "4v", init_weights=_glm_router_init
    ),
    "glm46v": _glm_recipe("glm46v", _glm46v_config, "Glm46VForConditionalGeneration", "46V"),
}


# ---------------------------------------------------------------------------------------------
# Qwen3.5 (dense and MoE): Qwen3-VL's vocabulary and processor, a hybrid decoder
# ---------------------------------------------------------------------------------------------

# Qwen3's plain-text tool and thinking tokens: single tokens of the vocabulary, not special (decoding
# keeps them, so a format reward sees `</think>`).
QWEN3_5_TEXT_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")
# Every 4th decoder layer is full (gated) attention, the others Gated DeltaNet linear attention
# (the published configs' `full_attention_interval`: 3 linear : 1 full).
QWEN3_5_FULL_ATTENTION_INTERVAL = 4


def _qwen3_5_text(dims: dict, vocab_size: int, ids: dict[str, int]) -> dict:
    """The hybrid decoder at tiny size: the depth rounded up to whole (linear, linear, linear, full)
    groups, so `num_hidden_layers=2` (the default) gives the four layers of one group."""
    text = _qwen_text_dims(dims, vocab_size, ids)
    interval = QWEN3_5_FULL_ATTENTION_INTERVAL
    text["num_hidden_layers"] = -(-dims["num_hidden_layers"] // interval) * interval
    text["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(text["num_hidden_layers"])
    ]
    # Rotary on a quarter of each head (partial_rotary_factor 0.25, as published), its half-dimension
    # split into interleaved mRoPE sections in the published [11, 11, 10] proportions.
    half = int(dims["head_dim"] * 0.25) // 2
    temporal = spatial = max(1, half * 11 // 32)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": float(dims["rope_theta"] or 10000000.0),
        "partial_rotary_factor": 0.25,
        "mrope_section": [temporal, spatial, half - temporal - spatial],
        "mrope_interleaved": True,
    }
    # Gated DeltaNet heads: twice as many value heads as key heads, as in Qwen3.5-9B (16 key, 32 value)
    text.update(
        linear_num_key_heads=max(1, dims["num_key_value_heads"]),
        linear_num_value_heads=2 * max(1, dims["num_key_value_heads"]),
        linear_key_head_dim=dims["head_dim"],
        linear_value_head_dim=dims["head_dim"],
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    )
    return text


def _qwen3_5_vision(dims: dict) -> dict:
    """Qwen3.5's vision tower (Qwen3-VL's, without deepstack taps)."""
    return {
        "depth": dims["vision_depth"],
        "hidden_size": dims["vision_embed_dim"],
        "intermediate_size": 2 * dims["vision_embed_dim"],
        "out_hidden_size": dims["hidden_size"],
        "num_heads": dims["vision_num_heads"],
        "patch_size": dims["patch_size"],
        "spatial_merge_size": dims["spatial_merge_size"],
        "temporal_patch_size": dims["temporal_patch_size"],
        "num_position_embeddings": 64,  # an 8x8 learned grid, interpolated to each image's grid
    }


def _qwen3_5_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=_qwen3_5_text(dims, vocab_size, ids),
        vision_config=_qwen3_5_vision(dims),
        tie_word_embeddings=False,
        **_qwen_vl_ids(ids),
    )


# Qwen3.5-MoE at tiny size: 4 routed experts, 2 per token, one gated shared expert in every layer
# (Qwen3.5-35B-A3B: 256 experts, 8 per token, a shared expert; expert width a quarter of the hidden size).
QWEN3_5_MOE_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}


def _qwen3_5_moe_config(dims: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen3_5MoeConfig

    text = _qwen3_5_text(dims, vocab_size, ids)
    del text["intermediate_size"]  # every layer's MLP is the MoE block
    text.update(
        QWEN3_5_MOE_EXPERTS,
        moe_intermediate_size=dims["intermediate_size"] // 4,
        shared_expert_intermediate_size=dims["intermediate_size"] // 4,
    )
    return Qwen3_5MoeConfig(
        text_config=text, vision_config=_qwen3_5_vision(dims), tie_word_embeddings=False, **_qwen_vl_ids(ids)
    )


RECIPES["qwen3.5"] = TinyRecipe(
    family="qwen3.5",
    special_tokens=QWEN2_5_VL_SPECIAL_TOKENS,  # Qwen3.5's vocabulary has them in this order (ids 248044 ...)
    chat_template=qwen3_5_jinja(thinking=False),  # the small checkpoints (0.8B-9B) answer without thinking by default
    make_config=_qwen3_5_config,
    model_class="Qwen3_5ForConditionalGeneration",
    make_processor=lambda dims: qwen_vl_processor("Qwen3VLProcessor", dims),  # what Qwen3.5 checkpoints ship
    text_tokens=QWEN3_5_TEXT_TOKENS,
)
RECIPES["qwen3.5-moe"] = TinyRecipe(
    family="qwen3.5-moe",
    special_tokens=QWEN2_5_VL_SPECIAL_TOKENS,
    chat_template=qwen3_5_jinja(thinking=True),  # the MoE checkpoints (35B-A3B and up) think by default
    make_config=_qwen3_5_moe_config,
    model_class="Qwen3_5MoeForConditionalGeneration",
    make_processor=lambda dims: qwen_vl_processor("Qwen3VLProcessor", dims),
    text_tokens=QWEN3_5_TEXT_TOKENS,
)
