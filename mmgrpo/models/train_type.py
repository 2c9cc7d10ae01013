"""Which weights train: full training with frozen parts, or LoRA adapters through peft.

    mmgrpo train --train_type lora --lora_rank 8 --lora_alpha 32 --target_modules all-linear --freeze_vit ...
    mmgrpo train --train_type full --freeze_vit --freeze_aligner ...        # train the LLM only

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

import copy
import logging

import torch
from torch import nn

from mmgrpo.config import ModelConfig, OptimConfig
from mmgrpo.errors import ConfigError
from mmgrpo.fusion.attach import FUSION_ATTR, check_fusion_model, fusion_for_training
from mmgrpo.models.loading import load_model, load_template, model_skeleton, template_options

PARTS = ("vision", "aligner", "llm")
logger = logging.getLogger("mmgrpo.models")


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


def frozen_parts(model_cfg: ModelConfig) -> set[str]:
    flags = {"vision": model_cfg.freeze_vit, "aligner": model_cfg.freeze_aligner, "llm": model_cfg.freeze_llm}
    return {part for part, frozen in flags.items() if frozen}


def lora_targets(model: nn.Module, components: dict[str, str], model_cfg: ModelConfig) -> list[str]:
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


def freeze(model: nn.Module, components: dict[str, str], model_cfg: ModelConfig) -> int:
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


def lora_config(model_cfg: ModelConfig, targets: list[str]):
    """peft's LoraConfig for --lora_rank, --lora_alpha, --lora_dropout on these module names."""
    from peft import LoraConfig

    return LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=model_cfg.lora_dropout,
                      target_modules=targets, bias="none")


def peft_rewrites(model: nn.Module, config) -> tuple[list[str], list[str]]:
    """(targets peft drops, parameter names it wraps instead): peft 0.21 rewrites the targets of models whose
    MoE layout changed in transformers 5 (model_type glm4v_moe, qwen3_omni_moe ...: its
    `convert_peft_config_for_transformers`, made to load adapters trained on transformers 4). A target named
    gate_proj, up_proj or down_proj, the towers' and the shared experts' included, becomes the fused routed
    experts' parameter (experts.gate_up_proj, experts.down_proj). Read on a copy of `config`; ([], []) where
    peft has no such step."""
    import copy as copy_module

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # transformers 4, or a peft without the rewrite
        return [], []
    rewritten = copy_module.deepcopy(config)
    convert_peft_config_for_transformers(rewritten, model=model, conversions=None)
    kept = set(rewritten.target_modules or [])
    return [t for t in config.target_modules if t not in kept], sorted(rewritten.target_parameters or [])


def check_lora_rewrites(model: nn.Module, model_cfg: ModelConfig, targets: list[str]) -> None:
    """--lora_dropout above 0 where peft would put LoRA on fused expert parameters (`peft_rewrites`): its
    adapter for a parameter takes no dropout, so peft stops with a ValueError; said here, before weights load."""
    dropped, wrapped = peft_rewrites(model, lora_config(model_cfg, targets))
    if not wrapped:
        return
    leaves = "/".join(sorted({name.rsplit(".", 1)[-1] for name in dropped}))
    moved = (f"peft moves this model's LoRA targets: its {len(dropped)} {leaves} layers get no adapter and the fused routed "
             f"experts' {', '.join(wrapped)} get one")
    if model_cfg.lora_dropout:
        raise ConfigError(
            f"--lora_dropout {model_cfg.lora_dropout}: {moved}, and peft's adapter on a fused parameter takes no dropout. "
            "Give --lora_dropout 0, or --target_modules without those layers (e.g. q_proj k_proj v_proj o_proj)."
        )
    logger.warning("--train_type lora: %s (--target_modules q_proj k_proj v_proj o_proj keeps the experts frozen).", moved)


def check_frozen_parts_exist(model_cfg: ModelConfig, components: dict[str, str]) -> None:
    """A ConfigError for a --freeze_* flag whose part the model lacks (the generic path, --model_type auto,
    finds parts on the model and may miss one: the flag would freeze nothing), naming the parts found.

    >>> check_frozen_parts_exist(ModelConfig(freeze_aligner=True), {"backbone": "model", "vision": "model.visual", "llm": "model.lm"})
    Traceback (most recent call last):
    ...
    mmgrpo.errors.ConfigError: --freeze_aligner: this model has no aligner that mmgrpo found (parts found: vision = model.visual, llm = model.lm), so the flag would freeze nothing; drop it (--freeze_vit freezes the vision tower with whatever projector lies inside it), or write a template that declares the part (docs/custom_template.md).
    """
    hint = " (--freeze_vit freezes the vision tower with whatever projector lies inside it)"
    found = ", ".join(f"{part} = {components[part]}" for part in ("vision", "audio", "aligner", "llm") if components.get(part))
    for flag, parts, what in (("freeze_vit", ("vision", "audio"), "vision or audio tower"), ("freeze_aligner", ("aligner",), "aligner"),
                              ("freeze_llm", ("llm",), "language model")):
        if getattr(model_cfg, flag) and not any(components.get(part) for part in parts):
            raise ConfigError(
                f"--{flag}: this model has no {what} that mmgrpo found (parts found: {found or 'none'}), so the flag would "
                f"freeze nothing; drop it{hint if flag == 'freeze_aligner' else ''}, or write a template that declares the "
                "part (docs/custom_template.md)."
            )


def check_trainable(model_cfg: ModelConfig, skeleton: nn.Module, components: dict[str, str]) -> None:
    """The checks of `apply_train_type`, on a weightless (meta device) model, before loading weights."""
    check_frozen_parts_exist(model_cfg, components)
    if model_cfg.train_type == "lora":
        check_lora_rewrites(skeleton, model_cfg, lora_targets(skeleton, components, model_cfg))
    elif model_cfg.train_type == "full":
        freeze(skeleton, components, model_cfg)


def apply_train_type(model: nn.Module, components: dict[str, str], model_cfg: ModelConfig, seed: int = 0):
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
    from peft import get_peft_model

    targets = lora_targets(model, components, model_cfg)
    config = lora_config(model_cfg, targets)
    torch.manual_seed(seed)  # the same adapter initialisation on every rank
    peft_model = get_peft_model(model, config)
    return model, peft_model


def load_trainable_model(model_cfg: ModelConfig, optim_cfg: OptimConfig, path: str, template, strategy, seed: int):
    """The model to train (train mode, checkpointing, frozen parts, LoRA, fusion modules) on the
    strategy's load device, with its LoRA wrapper (or None). LoRA targets, --freeze_*,
    --fusion_layers and the per-component rates (`optim_cfg`: --vit_lr ...) are checked on a
    weightless skeleton first, so a typo fails before the weights load."""
    skeleton = model_skeleton(path, template)
    check_trainable(model_cfg, skeleton, template.components)
    check_fusion_model(model_cfg, optim_cfg, skeleton, template, path)
    model = load_model(path, template=template, attn_implementation=model_cfg.attn_implementation).to(
        strategy.load_device)  # with a checkpoint's fusion modules
    model.train()
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, peft_model = apply_train_type(model, template.components, model_cfg, seed=seed)
    fusion_for_training(model, template, model_cfg, seed=seed)  # --fusion_module (mmgrpo/fusion/)
    return model, peft_model


def reference_copy(model: torch.nn.Module, *, bf16: bool, share_frozen: bool) -> torch.nn.Module:
    """The frozen copy of the starting weights that the KL term compares with, in the compute dtype.

    Weights that do not train (`--freeze_vit`, `--freeze_aligner`, `--freeze_llm`) stay equal to
    the starting ones, so the copy holds the policy's own tensors for them instead of a second
    copy: a frozen 675M-parameter Qwen2-VL-7B vision tower is 2.7 GB less in fp32. Not under
    --bf16 (the copy is cast, the policy keeps fp32) nor under FSDP2 / ZeRO-3, which shard each
    model on its own.
    """
    shared = {id(p): p for p in model.parameters() if not p.requires_grad} if share_frozen and not bf16 else {}
    ref_model = copy.deepcopy(model, memo=dict(shared)).eval().requires_grad_(False)
    return ref_model.to(torch.bfloat16) if bf16 else ref_model


def teacher_checkpoint(name: str, model_cfg: ModelConfig, student_template) -> tuple[str, object]:
    """(path, template) of --teacher_model, checked against the student: the teacher reads the
    student's encoded prompts and completion ids, so its family (the prompt tokens, media
    placeholders, positions) and its tokenizer must be the student's; either differing is a
    ConfigError naming both. model_cfg: the student's loading options (pixel limits, attention)."""
    path, _, template = load_template(name, None, **template_options(model_cfg))
    if template.name != student_template.name:
        raise ConfigError(f"--teacher_model {name} is a {template.name} model and --model {model_cfg.model} a "
                          f"{student_template.name} one: the teacher reads the student's prompt tokens and media, so it "
                          "must be of the same family.")
    ours, theirs = student_template.tokenizer.get_vocab(), template.tokenizer.get_vocab()
    if ours != theirs:
        raise ConfigError(f"--teacher_model {name} has another tokenizer than --model {model_cfg.model} "
                          f"({len(theirs):,} against {len(ours):,} tokens, {len(set(theirs.items()) ^ set(ours.items())):,} "
                          "differing): a token's log-prob must mean the same token for both.")
    return path, template


def load_teacher(name: str, model_cfg: ModelConfig, student_template, *, bf16: bool, device: torch.device) -> nn.Module:
    """--teacher_model, frozen, in the compute dtype on `device`: the model whose log-probs of the
    student's completions are on-policy distillation's signal (`teacher_checkpoint`'s checks first)."""
    path, template = teacher_checkpoint(name, model_cfg, student_template)
    teacher = load_model(path, template=template, attn_implementation=model_cfg.attn_implementation)
    teacher = teacher.eval().requires_grad_(False).to(device)
    return teacher.to(torch.bfloat16) if bf16 else teacher
