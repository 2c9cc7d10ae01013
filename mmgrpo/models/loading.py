"""Load a model and its processor from a folder, a hub id or `tiny:<family>`.

model = load_model("tiny:qwen2-vl")            # float32, eval mode
processor = load_processor("tiny:qwen2-vl")    # tokenizer padding_side = "left"
"""

from __future__ import annotations

import os

import torch

from mmgrpo.errors import ConfigError
from mmgrpo.models.tiny import resolve_model_path

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def checkpoint_path(name_or_path: str, needs: tuple[str, ...] = ("config.json",)) -> str:
    """A local folder holding one of `needs`, or a hub id (online only); else a ConfigError.

    `tiny:<family>` names are built first (see mmgrpo.models.tiny).
    """
    path = resolve_model_path(name_or_path)
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not any(os.path.isfile(os.path.join(local, name)) for name in needs):
            raise ConfigError(f"model {name_or_path!r}: the folder {local} has no {' or '.join(needs)}")
        return local
    is_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if not is_hub_id or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ConfigError(
            f"model {name_or_path!r}: no checkpoint folder at {local}; give a folder saved with "
            "save_pretrained, or tiny:<family> for a tiny random model"
        )
    return path


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, **kwargs):
    """The model in eval mode: AutoModelForImageTextToText, or AutoModelForCausalLM for text models."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    path = checkpoint_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    multimodal = type(config) in AutoModelForImageTextToText._model_mapping
    auto_class = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto_class.from_pretrained(path, dtype=dtype, **kwargs).eval()


def load_processor(name_or_path: str, **kwargs):
    """AutoProcessor (a tokenizer alone for a text model) with left padding for generation."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint_path(name_or_path, PROCESSOR_FILES), **kwargs)
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = "left"  # not saved with a tokenizer: set at run time
    return processor
