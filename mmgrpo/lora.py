"""Which weights train: full training with frozen parts, or LoRA adapters through peft.

    mmgrpo train --train_type lora --lora_rank 8 --lora_alpha 32 --target_modules all-linear --freeze_vit ...
    mmgrpo train --train_type full --freeze_vit --freeze_aligner ...        # train the LLM only
    mmgrpo export --merge_lora --model runs/x/checkpoint-50 --output_dir runs/x/merged

A model has three parts, located by the template's `components`: `vision` (the vision and audio
towers, aligner excluded), `aligner` (the projector into the LLM) and `llm` (the language model
and LM head). `--freeze_vit`, `--freeze_aligner`, `--freeze_llm` freeze a part: in full training
its weights get no gradient; with LoRA it gets no adapters.

--target_modules (LoRA), resolved to explicit module names:
    all-linear               every nn.Linear of the parts not frozen, the LM head excluded
    llm | vision | aligner   every nn.Linear of that part
    q_proj v_proj ...        the nn.Linear layers whose name ends with one of these, in parts not frozen

With LoRA the reference model of the KL term is the base model: the policy's own forward with
its adapters disabled (`peft_model.disable_adapter()`), so no second copy of the weights exists.
Checkpoints of a LoRA run hold the adapter (`adapter_config.json`, `adapter_model.safetensors`);
transformers' `from_pretrained` loads base + adapter from that folder, and `mmgrpo export
--merge_lora` writes a plain merged HF folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from mmgrpo.errors import ConfigError
from mmgrpo.fusion.attach import FUSION_ATTR, save_fusion, split_fusion_state

PARTS = ("vision", "aligner", "llm")


def part_of(name: str, components: dict[str, str]) -> str | None:
    """The part a module or parameter name belongs to, or None (outside every part).

    >>> components = {"vision": "model.visual", "aligner": "model.visual.merger", "llm": "model.language_model", "lm_head": "lm_head"}
    >>> [part_of(n, components) for n in ("model.visual.blocks.0.attn.qkv", "model.visual.merger.mlp.0", "lm_head")]
    ['vision', 'aligner', 'llm']
    """

    def under(key: str) -> bool:
        prefix = components.get(key)
        return bool(prefix) and (name == prefix or name.startswith(prefix + "."))

    if under("aligner"):  # before vision: Qwen's merger lives inside the vision tower
        return "aligner"
    if under("vision") or under("audio"):
        return "vision"
    if under("llm") or under("lm_head"):
        return "llm"
    return None


def frozen_parts(model_cfg) -> set[str]:
    flags = {"vision": model_cfg.freeze_vit, "aligner": model_cfg.freeze_aligner, "llm": model_cfg.freeze_llm}
    return {part for part, frozen in flags.items() if frozen}


def lora_targets(model: nn.Module, components: dict[str, str], model_cfg) -> list[str]:
    """Full names of the nn.Linear modules --target_modules selects; a ConfigError if none."""
    frozen = frozen_parts(model_cfg)
    wanted_parts, suffixes = set(), []
    for target in model_cfg.target_modules:
        if target == "all-linear":
            wanted_parts |= set(PARTS) - frozen
        elif target in PARTS:
            if target in frozen:
                raise ConfigError(f"--target_modules {target} contradicts --freeze_{'vit' if target == 'vision' else target}.")
            wanted_parts.add(target)
        else:
            suffixes.append(target)
    lm_head = components.get("lm_head")
    targets, linear_names = [], []
    for name, module in model.named_modules():
        part = part_of(name, components)
        if not isinstance(module, nn.Linear) or name == lm_head or part in frozen or name.startswith(FUSION_ATTR + "."):
            continue
        linear_names.append(name)
        if part in wanted_parts or any(name == s or name.endswith("." + s) for s in suffixes):
            targets.append(name)
    if not targets:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linear_names})
        frozen_text = f" (frozen: {', '.join(sorted(frozen))})" if frozen else ""
        raise ConfigError(
            f"--target_modules {' '.join(model_cfg.target_modules)} matches no linear layer of the parts that train"
            f"{frozen_text}. Use all-linear, llm, vision, aligner, or layer names such as {', '.join(leaves[:8]) or 'q_proj'}."
        )
    return targets


def freeze(model: nn.Module, components: dict[str, str], model_cfg) -> int:
    """Full training: no gradient for the frozen parts' weights. Returns the parameters left training."""
    frozen = frozen_parts(model_cfg)
    for name, param in model.named_parameters():
        if part_of(name, components) in frozen:
            param.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ConfigError(
            f"--freeze_{' --freeze_'.join(sorted('vit' if p == 'vision' else p for p in frozen))} leaves no weight to train: "
            "unfreeze a part, or use --train_type lora."
        )
    return trainable


def check_trainable(model_cfg, skeleton: nn.Module, components: dict[str, str]) -> None:
    """The checks of `apply_train_type`, on a weightless (meta device) model, before loading weights."""
    if model_cfg.train_type == "lora":
        lora_targets(skeleton, components, model_cfg)
    elif model_cfg.train_type == "full":
        freeze(skeleton, components, model_cfg)


def apply_train_type(model: nn.Module, components: dict[str, str], model_cfg, seed: int = 0):
    """Freeze parts (full) or inject LoRA adapters (lora). Returns (model, peft_model or None).

    `model` stays the object the policy uses (peft injects its layers in place); the PeftModel
    around it saves adapters and disables them for the reference forward. `fusion`: every weight
    of the model is frozen (its fusion modules, added next, are what trains: mmgrpo/fusion/).
    """
    if model_cfg.train_type == "fusion":
        model.requires_grad_(False)
        return model, None
    if model_cfg.train_type != "lora":
        freeze(model, components, model_cfg)
        return model, None
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, components, model_cfg)
    config = LoraConfig(
        r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=model_cfg.lora_dropout,
        target_modules=targets, bias="none",
    )
    torch.manual_seed(seed)  # the same adapter initialisation on every rank
    peft_model = get_peft_model(model, config)
    return model, peft_model


def sibling_group(hf_name: str) -> str:
    """The modules a rollout engine may fuse into one layer: a parameter's module's parent.

    >>> sibling_group("model.layers.0.self_attn.q_proj.weight"), sibling_group("model.layers.0.mlp.up_proj.bias")
    ('model.layers.0.self_attn', 'model.layers.0.mlp')
    """
    return hf_name.rpartition(".")[0].rpartition(".")[0]


def rollout_weights(model: nn.Module, peft_model, strategy):
    """(HF name, full tensor) of the weights a rollout engine with its own copy (vLLM, an async copy)
    must reload after training changed some: in full training the trainable parameters; with LoRA
    each adapted layer's merged weight W + (alpha / r) * B @ A under its base name (the adapters
    themselves never). Parts that train nothing (`--freeze_vit`, a LoRA run's untargeted blocks)
    are never sent.

    Whole sibling groups: where a changed weight sits, every weight of the modules beside it
    (same parent: q/k/v/o projections with their biases, gate/up/down) goes too, changed or not.
    vLLM fuses siblings into one layer (qkv_proj, gate_up_proj) and re-processes a layer from the
    weights it receives: one that gets only some of its weights keeps uninitialised memory in the
    rest (tests/test_vllm_colocate.py checks LoRA on q_proj alone).

    One tensor at a time, in the model's order (a layer completes before the next starts),
    gathered from the shards where the strategy shards (a collective on every rank).
    """
    params = dict(model.named_parameters())
    if peft_model is None:
        adapted = {}
        changed = [n for n, p in params.items() if p.requires_grad]
    else:
        adapted = {f"{name}.base_layer.weight": module for name, module in model.named_modules()
                   if hasattr(module, "base_layer") and "default" in getattr(module, "lora_A", {})}
        changed = [n.replace(".base_layer.", ".") for n in adapted]
        changed += [n for n, p in params.items() if p.requires_grad and n.startswith(FUSION_ATTR + ".")]  # fusion modules
    groups = {sibling_group(n) for n in changed}
    for name in params:
        hf_name = name.replace(".base_layer.", ".")
        if ".lora_" in name or sibling_group(hf_name) not in groups:
            continue
        if name not in adapted:
            yield from ((hf_name, tensor) for _, tensor in strategy.full_tensors(model, [name]))
            continue
        prefix = name.removesuffix("base_layer.weight")
        names = [name, prefix + "lora_A.default.weight", prefix + "lora_B.default.weight"]
        tensors = dict(strategy.full_tensors(model, names))
        weight = tensors[name]
        delta = tensors[names[2]].float() @ tensors[names[1]].float() * adapted[name].scaling["default"]
        yield hf_name, (weight.float() + delta).to(weight.dtype)


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


def export_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mmgrpo export",
        description="Write a LoRA checkpoint as a plain Hugging Face folder: base weights with the adapter merged in.",
    )
    parser.add_argument("--model", required=True, help="A checkpoint folder of a --train_type lora run (holds adapter_config.json).")
    parser.add_argument("--output_dir", required=True, help="Where the merged model and its processor are written.")
    parser.add_argument("--merge_lora", action="store_true", help="Merge the adapter into the base weights (required).")
    parser.add_argument("--base_model", default=None, help="The base model (default: the one adapter_config.json names).")
    parser.add_argument("--model_type", default=None, help="The model family (default: the one the training run recorded in the checkpoint).")
    args = parser.parse_args(argv)
    if not args.merge_lora:
        raise ConfigError("mmgrpo export writes merged LoRA weights: pass --merge_lora.")
    out = merge_lora(args.model, args.output_dir, args.base_model, args.model_type)
    print(f"merged model written to {out}")
