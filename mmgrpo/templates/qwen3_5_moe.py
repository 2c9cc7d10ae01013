"""Qwen3.5-MoE: Qwen3.5 (mmgrpo/templates/qwen3_5.py) with mixture-of-experts MLP blocks.

Every decoder layer's MLP routes each token to its top-k experts (Qwen3.5-35B-A3B: 8 of 256)
and adds a gated shared expert. Chat format, media, positions and boxes are Qwen3.5's; the
MoE checkpoints (35B-A3B, 122B-A10B, 397B-A17B) think by default, so the generation prompt
opens the thinking block. The shared prefix applies as for Qwen3.5 (a token's route depends on its
own hidden state only); decode steps run transformers' layers (the lean step has no MoE block).
The experts' weights are two 3-D tensors per layer (`mlp.experts.gate_up_proj`, `down_proj`), not
linear layers, and the router is one weight matrix: LoRA (`--target_modules all-linear`) adapts
attention, the linear-attention projections and the shared expert, not the router or the routed experts.
"""

from __future__ import annotations

from mmgrpo.templates.base import register_template
from mmgrpo.templates.qwen3_5 import Qwen3_5Template


@register_template("qwen3.5-moe")
class Qwen3_5MoeTemplate(Qwen3_5Template):
    """Template of Qwen3.5-MoE; the options of Qwen3.5."""

    hf_model_types = ("qwen3_5_moe",)
    thinking = True  # the MoE checkpoints' chat template opens the thinking block by default
    lean_decode = False  # MoE blocks: the lean step's MLP is SwiGLU, not a router and experts
