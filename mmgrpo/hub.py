"""The Hugging Face hub's local cache, read at call time: where a hub id's files are, and whether the
hub may be asked (a model by `mmgrpo.models.loading`, a dataset by `mmgrpo.data.catalog`)."""

from __future__ import annotations

import os


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, at call time (its constant is read once, at import)."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> str:
    """The HF hub cache folder from HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default,
    read at call time so a changed environment is seen."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return constants.HF_HUB_CACHE
