"""Random checkpoints of real model sizes, built offline: `random:qwen2.5-vl-3b`, `random:qwen2.5-vl-7b`,
`random:qwen3-vl-8b`, `random:qwen3.5-9b`, `random:qwen3-vl-30b-a3b` (a mixture of experts).

No weights can be downloaded here, but the published configurations are facts: each entry of
`REAL_SIZES` carries the numbers of the model's config.json (hidden and intermediate sizes, layers,
heads, KV heads, head_dim, the real vocabulary, tied or untied LM head, rope_theta, the mRoPE
sections, the vision tower's depth, width, window size, full-attention blocks, deepstack taps,
patch size and merger). `build_random` builds that model with random weights, the tiny models'
offline tokenizer (its ~1.5k trained tokens and the family's special tokens are ids inside the real
vocabulary, the rest are unused fillers) and the family's real processor with the published pixel
budgets, and caches it like a `tiny:` model. Anywhere a model path is accepted, a `random:` name is
too (`mmgrpo train --model random:qwen2.5-vl-3b?num_hidden_layers=2`):

    python -m mmgrpo.models.real_configs qwen2.5-vl-7b --num_hidden_layers 2 --vision_depth 2
    mmgrpo train --model "random:qwen2.5-vl-3b?num_hidden_layers=2&vision_depth=2" --max_steps 1 ...

Overrides after `?` change the depth only, so a full-width model runs on a CPU:
  num_hidden_layers  decoder layers (1 to the published number)
  vision_depth       vision blocks (1 to the published number). A reduced tower keeps the published
                     pattern's shape: Qwen2.5-VL's blocks are windowed except the published
                     full-attention indexes below the depth and the last block (block 31 of the real
                     tower is a full-attention one), so depth 2 is [window, full]; Qwen3-VL's deepstack
                     taps move to the same relative depth (index i of 27 -> i * depth // 27).
  seed               the random weights' seed
Everything else is the published configuration. Weights are written in bfloat16, as the published
checkpoints are: 1.1 GB for the 3B width at 2 + 2 layers, 7.5 GB for the whole 3B, 16.6 GB for 7B.
`load_model` upcasts them to float32 unless asked for another dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from mmgrpo.errors import ConfigError

RANDOM_PREFIX = "random:"
BUILDER_VERSION = 2  # bump when the output changes, so caches rebuild


@dataclass(frozen=True)
class RealSize:
    """One published model configuration (the numbers of its config.json)."""

    family: str  # the tiny recipe whose tokens, chat template and processor it uses; also the template name
    published: str  # the hub id whose config.json these numbers are
    text: dict  # decoder: sizes, heads, rope
    vision: dict  # vision tower
    tie_word_embeddings: bool
    config_class: str  # transformers config class
    processor_class: str  # transformers processor class
    pixels: tuple[int, int]  # the published image processor's pixel budget (min, max)

    @property
    def depths(self) -> dict[str, int]:
        return {"num_hidden_layers": self.text["num_hidden_layers"], "vision_depth": self.vision["depth"]}


_QWEN2_5_VL_VISION = {  # the same tower in every Qwen2.5-VL size; only its merger's output width differs
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "hidden_act": "silu",
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
}  # fmt: skip
_QWEN2_5_VL_PIXELS = (3136, 12845056)  # preprocessor_config.json: min_pixels, max_pixels

REAL_SIZES: dict[str, RealSize] = {
    "qwen2.5-vl-3b": RealSize(
        family="qwen2.5-vl", published="Qwen/Qwen2.5-VL-3B-Instruct",
        text={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
              "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
              "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "mrope_section": [16, 24, 24]},
        vision={**_QWEN2_5_VL_VISION, "out_hidden_size": 2048},
        tie_word_embeddings=True, config_class="Qwen2_5_VLConfig", processor_class="Qwen2_5_VLProcessor",
        pixels=_QWEN2_5_VL_PIXELS,
    ),
    "qwen2.5-vl-7b": RealSize(
        family="qwen2.5-vl", published="Qwen/Qwen2.5-VL-7B-Instruct",
        text={"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
              "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "mrope_section": [16, 24, 24]},
        vision={**_QWEN2_5_VL_VISION, "out_hidden_size": 3584},
        tie_word_embeddings=False, config_class="Qwen2_5_VLConfig", processor_class="Qwen2_5_VLProcessor",
        pixels=_QWEN2_5_VL_PIXELS,
    ),
    "qwen3-vl-8b": RealSize(
        family="qwen3-vl", published="Qwen/Qwen3-VL-8B-Instruct",
        text={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
              "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
              "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        vision={"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "hidden_act": "gelu_pytorch_tanh", "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "in_channels": 3, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                "out_hidden_size": 4096},
        tie_word_embeddings=False, config_class="Qwen3VLConfig", processor_class="Qwen3VLProcessor",
        pixels=(65536, 16777216),  # preprocessor_config.json: size shortest_edge, longest_edge
    ),
    # Qwen3.5-9B: the numbers of its config.json. transformers documents its Qwen3_5TextConfig defaults as
    # "the Qwen3.5-9B style configuration" (transformers/models/qwen3_5/configuration_qwen3_5.py: hidden 4096,
    # 32 layers, 16 heads over 4 KV heads of 256, Gated DeltaNet 16 key / 32 value heads of 128, untied),
    # and a config.json of a Qwen/Qwen3.5-9B fine-tune (empero-ai/Qwythos-9B, its architecture notes) gives
    # the same plus what the defaults lack: rope_theta 1e7, mRoPE [11, 11, 10] interleaved, 262,144
    # positions, the vision tower's out_hidden_size 4096. Every 4th layer is full attention
    # (full_attention_interval 4); a reduced depth keeps the pattern from the first layer (4 = one group).
    "qwen3.5-9b": RealSize(
        family="qwen3.5", published="Qwen/Qwen3.5-9B",
        text={"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
              "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu",
              "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
              "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        vision={"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "hidden_act": "gelu_pytorch_tanh", "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "in_channels": 3, "num_position_embeddings": 2304, "out_hidden_size": 4096},
        tie_word_embeddings=False, config_class="Qwen3_5Config", processor_class="Qwen3VLProcessor",
        pixels=(65536, 16777216),  # Qwen3-VL's processor budget, which Qwen3.5 ships
    ),
    # Qwen/Qwen3-VL-30B-A3B-Instruct config.json: every decoder layer a sparse block of 128 experts
    # (width 768), 8 per token, their weights renormalised ("norm_topk_prob": true, which transformers'
    # router always does), no shared expert; Qwen3-VL-8B's vision tower with a merger to 2048.
    "qwen3-vl-30b-a3b": RealSize(
        family="qwen3-vl-moe", published="Qwen/Qwen3-VL-30B-A3B-Instruct",
        text={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
              "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
              "mrope_section": [24, 20, 20], "mrope_interleaved": True, "attention_bias": False,
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "norm_topk_prob": True},
        vision={"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "hidden_act": "gelu_pytorch_tanh", "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "in_channels": 3, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                "out_hidden_size": 2048},
        tie_word_embeddings=False, config_class="Qwen3VLMoeConfig", processor_class="Qwen3VLProcessor",
        pixels=(65536, 16777216),  # preprocessor_config.json: size shortest_edge, longest_edge (Qwen3-VL's)
    ),
}  # fmt: skip

OVERRIDES = ("num_hidden_layers", "vision_depth", "seed")
# The special tokens' ids in the published vocabularies (a config built for shapes alone uses them).
PUBLISHED_TOKEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                       "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Names and configurations
# ---------------------------------------------------------------------------------------------


def parse_random_name(name: str) -> tuple[str, dict[str, int]]:
    """`random:<size>[?key=N&...]` -> (size, overrides), checked against `REAL_SIZES` and `OVERRIDES`.

    >>> parse_random_name("random:qwen2.5-vl-7b?num_hidden_layers=2&vision_depth=2")
    ('qwen2.5-vl-7b', {'num_hidden_layers': 2, 'vision_depth': 2})
    >>> parse_random_name("random:qwen2.5-vl-9b")
    Traceback (most recent call last):
    mmgrpo.errors.ConfigError: model 'random:qwen2.5-vl-9b': unknown size 'qwen2.5-vl-9b'; known: qwen2.5-vl-3b, qwen2.5-vl-7b, qwen3-vl-8b, qwen3.5-9b, qwen3-vl-30b-a3b
    """
    size, _, query = name.removeprefix(RANDOM_PREFIX).partition("?")
    if size not in REAL_SIZES:
        raise ConfigError(f"model {name!r}: unknown size {size!r}; known: {', '.join(REAL_SIZES)}")
    overrides = {}
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key not in OVERRIDES or not value.isdigit():
            raise ConfigError(
                f"model {name!r}: {item!r} is not KEY=INTEGER with a known override; known: {', '.join(OVERRIDES)} "
                f"(e.g. random:{size}?num_hidden_layers=2&vision_depth=2)"
            )
        overrides[key] = int(value)
    real = REAL_SIZES[size]
    for key, published in real.depths.items():
        if key in overrides and not 1 <= overrides[key] <= published:
            raise ConfigError(f"model {name!r}: {key}={overrides[key]} must be 1 to {published} (the published {real.published})")
    return size, overrides


def random_family(name: str) -> str:
    """The template name of a `random:` model: `random:qwen2.5-vl-7b?num_hidden_layers=2` -> 'qwen2.5-vl'."""
    return REAL_SIZES[parse_random_name(name)[0]].family


def reduced_vision(real: RealSize, depth: int) -> dict:
    """The vision config at `depth` blocks, keeping the published pattern's shape (module docstring).

    >>> reduced_vision(REAL_SIZES["qwen2.5-vl-3b"], 2)["fullatt_block_indexes"]
    [1]
    >>> reduced_vision(REAL_SIZES["qwen2.5-vl-3b"], 16)["fullatt_block_indexes"]
    [7, 15]
    >>> reduced_vision(REAL_SIZES["qwen3-vl-8b"], 2)["deepstack_visual_indexes"]
    [0, 1]
    """
    vision = {**real.vision, "depth": depth}
    published = real.vision["depth"]
    if "fullatt_block_indexes" in vision:
        kept = [i for i in real.vision["fullatt_block_indexes"] if i < depth]
        vision["fullatt_block_indexes"] = sorted({*kept, depth - 1})
    if "deepstack_visual_indexes" in vision:
        vision["deepstack_visual_indexes"] = sorted({i * depth // published for i in real.vision["deepstack_visual_indexes"]})
    return vision


def real_config(size: str, overrides: dict | None = None, token_ids: dict[str, int] | None = None):
    """The transformers config of `size` with the depth overrides; `token_ids`: the special tokens'
    ids (the offline tokenizer's); None: the published ids (for shapes only, e.g. `mmgrpo estimate`)."""
    import transformers

    overrides = overrides or {}
    real = REAL_SIZES[size]
    ids = token_ids or PUBLISHED_TOKEN_IDS
    rope_keys = ("rope_theta", "mrope_section", "mrope_interleaved", "partial_rotary_factor")
    text = {key: value for key, value in real.text.items() if key not in rope_keys}
    text["num_hidden_layers"] = overrides.get("num_hidden_layers", text["num_hidden_layers"])
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": real.text["rope_theta"],
                               "mrope_section": list(real.text["mrope_section"]),
                               **({"mrope_interleaved": True} if real.text.get("mrope_interleaved") else {}),
                               **({"partial_rotary_factor": real.text["partial_rotary_factor"]}
                                  if "partial_rotary_factor" in real.text else {})}  # fmt: skip
    text.update(tie_word_embeddings=real.tie_word_embeddings, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])  # fmt: skip
    vision = reduced_vision(real, overrides.get("vision_depth", real.vision["depth"]))
    config = getattr(transformers, real.config_class)(
        text_config=text, vision_config=vision, tie_word_embeddings=real.tie_word_embeddings,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    config.eos_token_id, config.pad_token_id, config.bos_token_id = ids["<|im_end|>"], ids["<|endoftext|>"], ids["<|endoftext|>"]
    return config


# ---------------------------------------------------------------------------------------------
# Building and caching
# ---------------------------------------------------------------------------------------------


def random_hash(size: str, overrides: dict) -> str:
    """A short hash of everything that determines the built files."""
    import tokenizers
    import transformers

    from mmgrpo.models import tiny_recipes, tiny_tokenizer

    key = {
        "size": size, "overrides": dict(sorted(overrides.items())), "builder": BUILDER_VERSION, "device": _init_device(),
        "source": hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (tiny_recipes, tiny_tokenizer))
                                 + Path(__file__).read_bytes()).hexdigest(),
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def build_random(size: str, cache_dir: str | os.PathLike | None = None, **overrides) -> Path:
    """Build (or find in the cache) the random checkpoint of a real size; returns its folder.

    Safe under concurrent callers, like `build_tiny` (a private temp folder renamed into place).
    Earlier builds of the same size and overrides are then removed (`remove_stale_builds`).
    """
    from mmgrpo.models.model_cache import default_cache_dir, publish_checkpoint

    query = "&".join(f"{key}={value}" for key, value in overrides.items())
    size, overrides = parse_random_name(f"{RANDOM_PREFIX}{size}" + (f"?{query}" if query else ""))
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"random-{size}-{random_hash(size, overrides)}"
    if (target / "config.json").exists():
        os.utime(target / "mmgrpo_random.json")  # in use: `remove_stale_builds` leaves it an hour
        return target
    publish_checkpoint(target, lambda folder: _write_checkpoint(size, overrides, folder))
    remove_stale_builds(target, size, overrides)
    return target


def remove_stale_builds(target: Path, size: str, overrides: dict, idle_seconds: float = 3600.0) -> list[Path]:
    """Delete earlier builds of the same size and overrides (another builder version or library
    version made them; nothing resolves to them any more), so the cache holds one copy of each
    gigabyte-sized model, not one per upgrade. Builds built or resolved in the last hour are left
    alone, in case a process of the older version still reads one."""
    import shutil
    import time

    removed = []
    for folder in target.parent.glob(f"random-{size}-*"):
        info = folder / "mmgrpo_random.json"
        if folder == target or not info.is_file() or time.time() - info.stat().st_mtime < idle_seconds:
            continue
        try:
            if json.loads(info.read_text()).get("overrides") == overrides:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        except (OSError, ValueError):
            continue
    return removed


def _init_device() -> str:
    """Where the weights are drawn: a GPU draws the 3.75B of the whole 3B model in a second, one CPU
    core in about a minute (the draws differ by device, so the cache keys on it)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def random_init(model, std: float, seed: int) -> None:
    """Weights as transformers initialises these models: matrices (linear, embedding, convolution)
    normal(0, std), norm scales 1, biases 0; drawn in parameter order from `seed`."""
    import torch

    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied weight is listed once
            if param.ndim > 1:
                param.normal_(0.0, std, generator=generator)
            elif name.endswith(".weight") and ("norm" in name or ".ln_" in name):
                param.fill_(1.0)
            else:
                param.zero_()


def _write_checkpoint(size: str, overrides: dict, out: Path) -> None:
    import torch
    import transformers

    from mmgrpo.models.tiny_recipes import RECIPES, qwen_vl_processor
    from mmgrpo.models.tiny_tokenizer import build_tokenizer

    real, recipe = REAL_SIZES[size], RECIPES[REAL_SIZES[size].family]
    tokenizer = build_tokenizer(recipe.special_tokens, recipe.chat_template, real.text["vocab_size"],
                                eos_token=recipe.eos_tokens[0], pad_token=recipe.pad_token,
                                text_tokens=recipe.text_tokens)  # fmt: skip
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in recipe.special_tokens}
    config = real_config(size, overrides, ids)
    # Built on the meta device and given bf16 storage once (as the published weights are): one copy
    # of half the fp32 size in memory, and each weight drawn once (transformers' own init draws
    # every Linear twice, which is most of a build at these sizes).
    with torch.device("meta"):
        model = getattr(transformers, recipe.model_class)._from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=_init_device()).eval()
    model.tie_weights()
    random_init(model, config.get_text_config().initializer_range, overrides.get("seed", 0))
    model.to("cpu")
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[recipe.bos_token], eos_token_id=[ids[t] for t in recipe.eos_tokens],
        pad_token_id=ids[recipe.pad_token], do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
    )  # fmt: skip
    model.save_pretrained(out)
    del model
    if torch.cuda.is_available():  # the caching allocator would keep the GPU copy from the training that follows
        torch.cuda.empty_cache()
    dims = {"patch_size": real.vision["patch_size"], "spatial_merge_size": real.vision["spatial_merge_size"],
            "temporal_patch_size": real.vision["temporal_patch_size"]}  # fmt: skip
    # videos: transformers' budget for the class (Qwen2.5-VL: 100,352 to 602,112 pixels a frame), not the tiny models'
    qwen_vl_processor(real.processor_class, dims, real.pixels, library_video_budget=True)(tokenizer).save_pretrained(out)
    (out / "mmgrpo_random.json").write_text(
        json.dumps({"size": size, "published": real.published, "overrides": overrides}, indent=2) + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m mmgrpo.models.real_configs SIZE [--num_hidden_layers N ...]`: build and print the path."""
    import argparse

    parser = argparse.ArgumentParser(description="Build a random checkpoint of a real model size (cached) and print its folder.")
    parser.add_argument("size", choices=list(REAL_SIZES))
    parser.add_argument("--cache_dir", default=None, help="default: $MMGRPO_CACHE/models or ~/.cache/mmgrpo/models")
    for key in OVERRIDES:
        parser.add_argument(f"--{key}", type=int, default=None, help="default: the published number" if key != "seed" else "default 0")
    args = vars(parser.parse_args(argv))
    size, cache_dir = args.pop("size"), args.pop("cache_dir")
    print(build_random(size, cache_dir, **{key: value for key, value in args.items() if value is not None}))


if __name__ == "__main__":
    main()
