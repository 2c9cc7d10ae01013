"""Tiny random checkpoints, built offline in seconds, for tests, demos and benchmarks.

No weights can be downloaded here, so every test model is built from a config object with
seeded random weights, a byte-level BPE tokenizer trained on a fixed built-in corpus, the
family's special tokens at fixed ids, a chat template and the family's real processor classes.
The tokenizer and chat templates are built in `mmgrpo.models.tiny_tokenizer`.
The same recipe always gives byte-identical files.

    python -c "from mmgrpo.models.tiny import build_tiny; print(build_tiny('qwen2-vl'))"
    python -m mmgrpo.models.tiny qwen2.5-vl --hidden_size 256 --vocab_size 151936

Anywhere a model path is accepted, `tiny:<family>` builds (once, then cached) and uses one:
`resolve_model_path("tiny:qwen2-vl")` -> `~/.cache/mmgrpo/models/qwen2-vl-<hash>`.
A variant names its dimensions after `?`: `tiny:qwen2-vl?vision_init_gain=3&seed=1`.

Each family's recipe (special tokens, chat template, config and processor builders) is in
`mmgrpo.models.tiny_recipes`; adding a family is one `TinyRecipe` entry in its `RECIPES`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mmgrpo.errors import ConfigError
from mmgrpo.models import tiny_recipes as _recipes_module
from mmgrpo.models import tiny_tokenizer as _tokenizer_module
from mmgrpo.models.model_cache import (  # noqa: F401  (re-exported: the reward model's builder imports them from here)
    default_cache_dir,
    publish_checkpoint,
)
from mmgrpo.models.real_configs import RANDOM_PREFIX  # real sizes with random weights
from mmgrpo.models.tiny_recipes import (
    QWEN2_5_VL_SPECIAL_TOKENS,  # noqa: F401  (re-exported: tests import it from here)
    RECIPES,
    TinyRecipe,
)
from mmgrpo.models.tiny_tokenizer import (
    BPE_VOCAB_SIZE,  # noqa: F401  (re-exported: tests import it from here)
    build_tokenizer,
)

BUILDER_VERSION = 1  # bump when a recipe's output changes, so caches rebuild
TINY_PREFIX = "tiny:"

# Size of every tiny model unless overridden (about 1M parameters).
DEFAULT_DIMS = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention takes only 32, 64, 80 and up
    "intermediate_size": 256,
    "vocab_size": None,  # None: the tokenizer's size rounded up to a multiple of 64
    "vision_depth": 2,
    "vision_embed_dim": 64,
    "vision_num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "max_position_embeddings": 4096,
    "seed": 0,
    # 0: the vision tower keeps transformers' init (normal, std 0.02). N > 0: its weight matrices
    # (patch embedding, blocks, merger/projector) are drawn with std N / sqrt(fan_in). At std 0.02
    # a 64-wide tower's MLPs see pre-activations of about 0.2, where GELU is almost linear, so the
    # tower is nearly a linear map of the pixels; gain 3 lets counting SFT leave chance at 16 visual
    # tokens (docs/benchmarks.md, "A wider vision init").
    "vision_init_gain": 0,
    # 0: the family's rotary base (1e6 for the Qwen2 LLMs, 5e6 for Qwen3-VL). N > 0: the language
    # model's rope_theta. With head_dim 32 and a base of 1e6, mRoPE turns an image's columns by
    # 2e-4 radians or less per visual token, so the LLM cannot tell where a token is and boxes do not
    # become learnable; with rope_theta 10 they do (docs/benchmarks.md, "Boxes with positions").
    "rope_theta": 0,
}

VISION_MODULES = ("visual.", "vision_tower.", "multi_modal_projector.")  # where a tiny model's vision tower lives


def _fan_in_init(model, gain: float) -> None:
    """Redraw the weights of the vision tower's linear and convolution layers with std gain / sqrt(fan_in)."""
    import torch

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)) and any(
                part in name + "." for part in VISION_MODULES
            ):
                module.weight.normal_(0.0, gain / module.weight[0].numel() ** 0.5)


# ---------------------------------------------------------------------------------------------
# Building and caching
# ---------------------------------------------------------------------------------------------


def _recipe(family: str) -> TinyRecipe:
    if family not in RECIPES:
        raise ConfigError(f"unknown tiny model family {family!r}; known: {', '.join(sorted(RECIPES))}")
    return RECIPES[family]


def _dims(overrides: dict) -> dict:
    unknown = set(overrides) - set(DEFAULT_DIMS)
    if unknown:
        raise ConfigError(
            f"unknown tiny model override(s) {sorted(unknown)}; known: {', '.join(sorted(DEFAULT_DIMS))}"
        )
    dims = {**DEFAULT_DIMS, **overrides}
    if dims["rope_theta"] < 0:
        raise ConfigError(f"tiny model: rope_theta {dims['rope_theta']} must be positive (or 0: the family's own)")
    if "num_attention_heads" not in overrides:  # a wider model keeps head_dim (vLLM's CPU attention needs 32, 64, ...)
        if dims["hidden_size"] % dims["head_dim"]:
            raise ConfigError(f"tiny model: hidden_size {dims['hidden_size']} is not a multiple of head_dim {dims['head_dim']}")
        dims["num_attention_heads"] = dims["hidden_size"] // dims["head_dim"]
        if "num_key_value_heads" not in overrides:
            dims["num_key_value_heads"] = max(1, dims["num_attention_heads"] // 2)
    return dims


def recipe_hash(family: str, **overrides) -> str:
    """A short hash of everything that determines the built files."""
    import tokenizers
    import transformers

    key = {
        "family": family,
        "dims": _dims(overrides),
        "builder": BUILDER_VERSION,
        # any builder, recipe or tokenizer edit rebuilds: hash the three modules' source
        "source": hashlib.sha256(
            b"".join(Path(f).read_bytes() for f in (__file__, _recipes_module.__file__, _tokenizer_module.__file__))
        ).hexdigest(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def build_tiny(family: str, cache_dir: str | os.PathLike | None = None, **overrides) -> Path:
    """Build (or find in the cache) the tiny random checkpoint of `family`; returns its folder.

    `overrides` change `DEFAULT_DIMS` entries, e.g. `hidden_size=256, vocab_size=151936`.
    Safe under concurrent callers: each builds in a private temp folder and renames it into
    place; the first rename wins and the others discard their copy.
    """
    recipe = _recipe(family)
    dims = _dims(overrides)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"{family}-{recipe_hash(family, **overrides)}"
    if (target / "config.json").exists():
        return target
    return publish_checkpoint(target, lambda tmp: _write_checkpoint(recipe, dims, tmp))


def _write_checkpoint(recipe: TinyRecipe, dims: dict, out: Path) -> None:
    import torch
    import transformers

    tokenizer = build_tokenizer(
        recipe.special_tokens,
        recipe.chat_template,
        dims["vocab_size"],
        eos_token=recipe.eos_tokens[0],
        pad_token=recipe.pad_token,
        bos_token=recipe.tokenizer_bos,
        named_tokens=dict(recipe.named_tokens),
        text_tokens=recipe.text_tokens,
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in recipe.special_tokens}
    config = recipe.make_config(dims, len(tokenizer), ids)
    config.eos_token_id = ids[recipe.eos_tokens[0]]
    config.pad_token_id = ids[recipe.pad_token]
    config.bos_token_id = ids[recipe.bos_token]

    torch.manual_seed(dims["seed"])
    model = getattr(transformers, recipe.model_class)(config).eval()
    if recipe.init_weights is not None:
        recipe.init_weights(model)
    if dims["vision_init_gain"]:
        _fan_in_init(model, dims["vision_init_gain"])
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[recipe.bos_token],
        eos_token_id=[ids[t] for t in recipe.eos_tokens],
        pad_token_id=ids[recipe.pad_token],
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    model.save_pretrained(out)
    if recipe.make_processor is None:
        tokenizer.save_pretrained(out)
    else:
        recipe.make_processor(dims)(tokenizer).save_pretrained(out)
    (out / "mmgrpo_tiny.json").write_text(
        json.dumps({"family": recipe.family, "dims": dims}, indent=2) + "\n"
    )


def parse_tiny_name(name: str) -> tuple[str, dict[str, int]]:
    """`tiny:<family>[?dim=N&dim=N]` -> (family, overrides of DEFAULT_DIMS).

    >>> parse_tiny_name("tiny:qwen2-vl?vision_init_gain=3&seed=1")
    ('qwen2-vl', {'vision_init_gain': 3, 'seed': 1})
    """
    family, _, query = name.removeprefix(TINY_PREFIX).partition("?")
    overrides = {}
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key not in DEFAULT_DIMS or not value.lstrip("-").isdigit():
            raise ConfigError(
                f"model {name!r}: {item!r} is not DIM=INTEGER with a tiny model dimension; known: "
                f"{', '.join(sorted(DEFAULT_DIMS))} (e.g. tiny:qwen2-vl?vision_init_gain=3)"
            )
        overrides[key] = int(value)
    return family, overrides


def tiny_family(name: str) -> str:
    """The family (and template name) of a `tiny:` model name: `tiny:qwen2-vl?seed=1` -> 'qwen2-vl'."""
    return name.removeprefix(TINY_PREFIX).partition("?")[0]


def resolve_model_path(name_or_path: str) -> str:
    """`tiny:<family>` (with `?dim=N&...` overrides, see `DEFAULT_DIMS`) or `random:<size>` (a real
    size with random weights, mmgrpo/models/real_configs.py) -> the built checkpoint's folder;
    anything else is returned unchanged.

    >>> resolve_model_path("Qwen/Qwen2-VL-2B-Instruct")
    'Qwen/Qwen2-VL-2B-Instruct'
    """
    name_or_path = str(name_or_path)
    if name_or_path.startswith(RANDOM_PREFIX):
        from mmgrpo.models.real_configs import build_random, parse_random_name

        size, overrides = parse_random_name(name_or_path)
        return str(build_random(size, **overrides))
    if not name_or_path.startswith(TINY_PREFIX):
        return name_or_path
    family, overrides = parse_tiny_name(name_or_path)
    return str(build_tiny(family, **overrides))


def built_model_family(name: str) -> str | None:
    """The template name a `tiny:` or `random:` model name implies, else None.

    >>> built_model_family("tiny:qwen2-vl?seed=1"), built_model_family("random:qwen2.5-vl-7b"), built_model_family("runs/x")
    ('qwen2-vl', 'qwen2.5-vl', None)
    """
    if name.startswith(TINY_PREFIX):
        return tiny_family(name)
    if name.startswith(RANDOM_PREFIX):
        from mmgrpo.models.real_configs import random_family

        return random_family(name)
    return None


def main(argv: list[str] | None = None) -> None:
    """`python -m mmgrpo.models.tiny FAMILY [--hidden_size N ...]`: build and print the path."""
    import argparse

    parser = argparse.ArgumentParser(
        description="Build a tiny random checkpoint (cached) and print its folder."
    )
    parser.add_argument("family", choices=sorted(RECIPES))
    parser.add_argument(
        "--cache_dir", default=None, help="default: $MMGRPO_CACHE/models or ~/.cache/mmgrpo/models"
    )
    for name, value in DEFAULT_DIMS.items():
        parser.add_argument(f"--{name}", type=int, default=None, help=f"default {value}")
    args = vars(parser.parse_args(argv))
    family, cache_dir = args.pop("family"), args.pop("cache_dir")
    print(build_tiny(family, cache_dir, **{k: v for k, v in args.items() if v is not None}))


if __name__ == "__main__":
    main()
