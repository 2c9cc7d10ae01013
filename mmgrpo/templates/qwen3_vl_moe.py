"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): Qwen3-VL's processor, chat format and
placeholders; a mixture-of-experts language model.

Everything the processor side does is Qwen3-VL's (mmgrpo/templates/qwen3_vl.py, by inheritance of
its class body: only the model differs). The decoder's MLP is, in every layer, a sparse block:
a linear router picks the top `num_experts_per_tok` of `num_experts` experts per token (softmax,
top-k, the k probabilities renormalised to sum to 1) and adds their SwiGLU outputs weighted by
those probabilities; there are no shared experts (config.json: 128 experts, 8 per token, no
shared-expert size). See docs/models.md, "Mixture of experts", for routing replay and the
router's auxiliary loss.

- shared_prefix: kept on. The prompt's keys and values do not depend on what kind of MLP the
  layers have, and each token is routed by its own hidden state alone, so a prompt run once
  routes exactly as inside each repeated row (tests/test_shared_prefix.py).
- lean_decode: off. The lean step's contract is a dense SwiGLU MLP per layer.
- vLLM: its loader takes the fused expert banks as the published checkpoints store them, the last
  two dims swapped from transformers' (`vllm_expert_banks_transposed`).

Boxes: as Qwen3-VL, `[x1, y1, x2, y2]` in 0-1000 of the image ("rel1000").
"""

from __future__ import annotations

from mmgrpo.templates.base import register_template
from mmgrpo.templates.qwen3_vl import Qwen3VLTemplate


@register_template("qwen3-vl-moe")
class Qwen3VLMoeTemplate(Qwen3VLTemplate):
    """Template of Qwen3-VL-MoE; the same options as Qwen3-VL's."""

    hf_model_types = ("qwen3_vl_moe",)  # config.json model_type(s): --model_type is inferred from them

    lean_decode = False  # sparse MoE blocks, not the lean step's dense SwiGLU MLP
    # vLLM 0.32 transposes the banks it loads (is_fused_checkpoint_transposed): measured on tiny:qwen3-vl-moe,
    # its log-probs then equal the policy's after a sync (tests/test_vllm_families.py)
    vllm_expert_banks_transposed = True
