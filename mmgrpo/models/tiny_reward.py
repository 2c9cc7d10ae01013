"""A tiny random reward model built offline: the tiny Qwen2 with a one-label classification head.

    build_tiny_reward_model()   # -> ~/.cache/mmgrpo/models/reward-qwen2-<hash>, with its tokenizer
    build_tiny_reward_model(num_labels=3)   # a classifier that is NOT a reward model (bad-input tests)

`--reward_model tiny:reward-qwen2` uses it. Built like mmgrpo/models/tiny.py builds its models:
seeded, in a private folder renamed into the cache (concurrent callers are safe).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mmgrpo.models.tiny import build_tiny, default_cache_dir, publish_checkpoint

BUILDER_VERSION = 1
TINY_REWARD_MODEL = "tiny:reward-qwen2"  # the name --reward_model takes for it


def build_tiny_reward_model(num_labels: int = 1, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    source = build_tiny("qwen2")
    key = hashlib.sha256(f"{BUILDER_VERSION}:{source.name}:{num_labels}:{seed}".encode()).hexdigest()[:12]
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"reward-qwen2-{key}"
    if (target / "config.json").exists():
        return target
    config = AutoConfig.from_pretrained(source)
    config.num_labels = num_labels
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config).eval()

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(source).save_pretrained(folder)

    return publish_checkpoint(target, write)
