"""The policy's weights as a rollout engine with its own copy (vLLM, an async copy) must receive them.

    for hf_name, tensor in rollout_weights(model, peft_model, strategy):   # lazy, one tensor at a time
        engine_model.load(hf_name, tensor)

Full training sends the trainable parameters; LoRA sends each adapted layer merged
(W + alpha / r x B @ A) under its base name. A weight goes with its whole sibling group
(`sibling_group`), because vLLM fuses siblings (q/k/v, gate/up) into one layer.
"""

from __future__ import annotations

from torch import nn

from mmgrpo.fusion.attach import FUSION_ATTR


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
