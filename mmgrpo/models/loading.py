"""Load a model and its processor from a folder, a hub id or `tiny:<family>`.

model = load_model("tiny:qwen2-vl")            # float32, eval mode (any family in docs/models.md)
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
    """The model in eval mode.

    AutoModelForMultimodalLM for image / video / audio models (it covers AutoModelForImageTextToText
    and the audio LMs such as Qwen2-Audio), AutoModelForCausalLM for text models. A full
    Qwen2.5-Omni checkpoint (thinker + talker + vocoder) loads its thinker only: GRPO trains the
    part that writes text.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMultimodalLM

    path = checkpoint_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    if config.model_type == "qwen2_5_omni":
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration

        return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
            path, config=config.thinker_config, dtype=dtype, key_mapping={r"^thinker\.": ""}, **kwargs
        ).eval()
    multimodal = type(config) in AutoModelForMultimodalLM._model_mapping
    auto_class = AutoModelForMultimodalLM if multimodal else AutoModelForCausalLM
    return auto_class.from_pretrained(path, dtype=dtype, **kwargs).eval()


def load_processor(name_or_path: str, **kwargs):
    """AutoProcessor (a tokenizer alone for a text model) with left padding for generation."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint_path(name_or_path, PROCESSOR_FILES), **kwargs)
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = "left"  # not saved with a tokenizer: set at run time
    return processor
