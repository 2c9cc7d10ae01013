"""Writing a model as an HF folder that `from_pretrained` loads, and `mmgrpo export`.

    save_model_folder(path, model, peft_model, processor, template, state_dict)   # weights, processor, mmgrpo.json
    mmgrpo export --merge_lora --model runs/x/checkpoint-50 --output_dir runs/x/merged

A LoRA run's folder holds the adapter (`adapter_config.json`, `adapter_model.safetensors`);
transformers' `from_pretrained` loads base + adapter from it, and `mmgrpo export --merge_lora`
writes a plain merged HF folder. `mmgrpo.json` records the model type, so `mmgrpo eval` and a
resumed run need no --model_type.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mmgrpo.errors import ConfigError
from mmgrpo.fusion.attach import save_fusion, split_fusion_state
from mmgrpo.models.loading import RUN_INFO_FILE


def save_pretrained(model: nn.Module, peft_model, path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Write an HF folder from a full state dict (HF names): the model, or a LoRA run's adapter, and
    any fusion modules as fusion_modules.safetensors + fusion_config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state_dict, fusion_state = split_fusion_state(state_dict)
    if fusion_state:  # fusion modules: their own safetensors and config beside the model's (mmgrpo/fusion/)
        save_fusion(model, path, fusion_state)
    if peft_model is None:
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        return
    adapter = {f"base_model.model.{key}": value for key, value in state_dict.items() if "lora_" in key}
    peft_model.save_pretrained(path, state_dict=adapter, safe_serialization=True)


def save_model_folder(path: Path, model: nn.Module, peft_model, processor, template,
                      state_dict: dict[str, torch.Tensor]) -> None:
    """The HF folder of a model (LoRA: its adapter), its processor and `mmgrpo.json` (the model type;
    not written without a template). The one writer of `mmgrpo.json`."""
    save_pretrained(model, peft_model, path, state_dict)
    processor.save_pretrained(path)
    if template is not None:
        info = {"model_type": template.name}
        plugin = template_plugin_source(template)
        if plugin:  # a template from --template_plugin: loading the checkpoint imports it again
            info["template_plugin"] = plugin
        (Path(path) / RUN_INFO_FILE).write_text(json.dumps(info) + "\n")


def template_plugin_source(template) -> str | None:
    """The file (absolute) or module a template plugin's class came from; None for a built-in family."""
    import sys

    module_name = type(template).__module__
    if module_name.startswith("mmgrpo."):
        return None
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    return str(Path(path).resolve()) if module_name.startswith("mmgrpo_plugin_") and path else module_name


# ---- mmgrpo export ---------------------------------------------------------------------------


def merge_lora(adapter_dir: str, output_dir: str, base_model: str | None = None, model_type: str | None = None) -> Path:
    """Base model + the adapter in `adapter_dir`, merged into plain weights, saved as an HF folder.

    model_type: the family's template (how its checkpoint loads); default: the one the training
    run recorded in the checkpoint (`mmgrpo.json`), else the Auto classes.
    """
    from peft import PeftModel

    from mmgrpo.models.loading import load_model, load_processor, saved_model_type
    from mmgrpo.templates import get_template

    config_file = Path(adapter_dir) / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigError(f"--model {adapter_dir}: no adapter_config.json; --merge_lora needs the checkpoint of a --train_type lora run.")
    base = base_model or json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{config_file} names no base model: pass --base_model.")
    has_processor = any((Path(adapter_dir) / name).is_file() for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"))
    processor = load_processor(adapter_dir if has_processor else base)
    model_type = model_type or saved_model_type(adapter_dir)
    template = get_template(model_type, processor) if model_type else None
    model = load_model(base, template=template)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    out = Path(output_dir)
    merged.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    return out
