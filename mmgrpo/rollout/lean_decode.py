"""One decode step of a Qwen-style decoder without the transformers module stack.

A rollout decode step feeds one token per row through the decoder. For the small models and
short contexts of RL rollouts the arithmetic is tiny and the cost is per-operation overhead:
transformers' layer stack spends about as long in Python (decorators, output capture, mask and
rotary set-up, the attention-interface lookup, cache objects) as in the operations themselves.
`LeanDecoder.step` runs the same operations, in the same order and dtype, straight on the
layers' weights:

    embed -> per layer: RMSNorm, q/k/v (+ Qwen3's q/k norms), RoPE, write K/V into the
    rollout's buffer, SDPA over it, o_proj, residual, RMSNorm, SwiGLU MLP, residual
    -> final RMSNorm
    (fusion modules after their layers where the model has them: mmgrpo/fusion/)

The buffer (`GroupedPrefixKV`) holds each prompt's K/V once, followed by its G rows' tokens,
and one SDPA call per prompt serves its G rows; transformers' cache would hold G copies.

The rotary cos/sin of every step are computed once per rollout by the model's own rotary
module (mRoPE included: a generated token has equal temporal/height/width positions), so
positions follow the model exactly. The template vouches that its family's decoder layers run
exactly this sequence (`Template.lean_decode`); `supports` then checks what the loaded layers
could still change: plain nn.Linear projections (a LoRA-wrapped projection adds its adapters in
its forward, which the step does not call), SiLU, no sliding window, no attention soft-capping.
Anything else decodes through transformers.
tests/test_lean_decode.py checks tokens identical and log-probs equal to 1e-5 (fp32) against
the transformers path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgrpo.fusion.attach import decoder_fusion


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Qwen RMSNorm, op for op: statistics in fp32, weight applied in x's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    """The weights one decoder layer's step reads (plain tensors: no module calls)."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.gqa = attn.num_key_value_groups > 1 if hasattr(attn, "num_key_value_groups") else False


class LeanDecoder:
    """Decode steps of `language_model` (a Qwen-style text decoder) over a rollout's K/V, one
    `GroupedPrefixKV` per layer (see there)."""

    def __init__(self, language_model: nn.Module):
        self.embed = language_model.embed_tokens
        self.norm = language_model.norm
        self.rotary = language_model.rotary_emb
        self.layers = [_Layer(layer) for layer in language_model.layers]
        # fusion modules (mmgrpo/fusion/) after some layers: their forward hooks are not called here
        self.fusion = decoder_fusion(language_model)

    @staticmethod
    def supports(language_model: nn.Module) -> tuple[bool, str]:
        """(True, "") if the decoder's parts are where the step reads them, with SiLU MLPs, a plain
        embedding, nn.Linear projections and no sliding window; else (False, why). Whether its
        layers' forward is the step's sequence is the template's word (`Template.lean_decode`)."""
        layers = getattr(language_model, "layers", None)
        if layers is None or not all(hasattr(language_model, a) for a in ("embed_tokens", "norm", "rotary_emb")):
            return False, f"{type(language_model).__name__} has no embed_tokens / layers / norm / rotary_emb"
        parts = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
        if not all(hasattr(layer, part) for layer in layers for part in parts):
            return False, f"decoder layers lack one of {', '.join(parts)}"
        config = language_model.config
        if getattr(config, "hidden_act", "silu") != "silu":
            return False, f"hidden_act {config.hidden_act!r} (the lean step implements SiLU)"
        if getattr(config, "attn_logit_softcapping", None):  # Gemma 2: the step's SDPA does not cap scores
            return False, f"attention soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})"
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            return False, "sliding-window layers"
        if type(language_model.embed_tokens) is not nn.Embedding:
            return False, f"embedding {type(language_model.embed_tokens).__name__} (the lean step implements nn.Embedding)"
        # The step reads `.weight` / `.bias` of each projection: a wrapped one (a LoRA layer adds
        # its adapters in forward) would be skipped silently, so anything but nn.Linear decodes
        # through transformers.
        for layer in layers:
            for name, module in (*layer.self_attn.named_children(), *layer.mlp.named_children()):
                if name.endswith("_proj") and type(module) is not nn.Linear:
                    return False, f"{name} is a {type(module).__name__}, not nn.Linear (LoRA adapters run in its forward)"
        return True, ""

    def rotary_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, T, head_dim] for positions [N, T] (or [3, N, T] mRoPE), by the model's own rotary module."""
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        return self.rotary(probe, positions)

    @torch.no_grad()
    def step(self, token: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: list, step: int) -> torch.Tensor:
        """token [N] (generated token number `step`, 0-based) -> final hidden state [N, H].

        cos, sin: [N, head_dim] of this step; kv: one K/V store per layer, which keeps the
        token's keys and values and attends over the prompt's and the row's tokens so far.
        """
        rows = token.shape[0]
        hidden = F.embedding(token, self.embed.weight)[:, None]  # [N, 1, H]
        cos, sin = cos[:, None, None], sin[:, None, None]  # [N, 1, 1, D]
        fusion = self.fusion
        if fusion is not None:
            fusion.continue_rows(rows)
        for index, (layer, store) in enumerate(zip(self.layers, kv)):
            x = _rms_norm(hidden, layer.input_norm)
            q = F.linear(x, layer.q.weight, layer.q.bias).view(rows, 1, -1, layer.head_dim)
            k = F.linear(x, layer.k.weight, layer.k.bias).view(rows, 1, -1, layer.head_dim)
            v = F.linear(x, layer.v.weight, layer.v.bias).view(rows, 1, -1, layer.head_dim)
            if layer.q_norm is not None:
                q, k = _rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [N, heads, 1, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            attended = store.attend(q, k, v, step, layer.scaling, layer.gqa)  # [N, heads * D]
            hidden = hidden + F.linear(attended[:, None], layer.o.weight, layer.o.bias)
            x = _rms_norm(hidden, layer.post_norm)
            x = F.silu(F.linear(x, layer.gate.weight, layer.gate.bias)) * F.linear(x, layer.up.weight, layer.up.bias)
            hidden = hidden + F.linear(x, layer.down.weight, layer.down.bias)
            if fusion is not None:
                hidden = fusion.after_layer(index, hidden)
        return _rms_norm(hidden, self.norm)[:, 0]  # [N, H]


class GroupedPrefixKV:
    """One layer's K/V as one [B, kv_heads, P + G * max_new, head_dim] buffer per prompt: the
    prompt's K/V written once (not G times), then its G rows' tokens step-major (column
    P + step * G + g holds row g's token of that step). A step is one SDPA call per prompt with
    its G rows as G queries, each masked to the prompt and its own columns (`group_mask`), so
    the prompt's K/V is held and read once per group. Against every row holding a copy of its
    prompt's K/V (one SDPA call over N rows, as transformers' cache does) it is even at a
    33-token prompt and 1.4-1.6x faster at 500-1200 tokens, G=8, on CPU (docs/speed.md).

    keys, values: the prompts' recorded K/V [B, kv_heads, P, head_dim]; mask: `group_mask`'s,
    shared by all layers.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, group: int, max_new: int, mask: torch.Tensor):
        batch, kv_heads, prompt_len, head_dim = keys.shape
        self.group, self.prompt_len, self.mask = group, prompt_len, mask
        self.keys = keys.new_empty(batch, kv_heads, prompt_len + group * max_new, head_dim)
        self.values = torch.empty_like(self.keys)
        self.keys[:, :, :prompt_len], self.values[:, :, :prompt_len] = keys, values

    @staticmethod
    def group_mask(prompt_mask: torch.Tensor, group: int, max_new: int) -> torch.Tensor:
        """[B, 1, G, P + G * max_new] bool, True = attend: query g sees its prompt's real tokens
        and the columns of its own row (P + step * G + g)."""
        batch, prompt_len = prompt_mask.shape
        own = torch.eye(group, dtype=torch.bool, device=prompt_mask.device).repeat(1, max_new)  # [G, G * max_new]
        prompt = prompt_mask.bool()[:, None, None, :].expand(batch, 1, group, prompt_len)
        return torch.cat([prompt, own.expand(batch, 1, group, -1)], dim=-1)

    def keep(self, prompts: torch.Tensor, mask: torch.Tensor) -> None:
        """Only `prompts` (indices into the current batch) decode on; mask: `group_mask`'s rows of them."""
        self.keys, self.values, self.mask = self.keys[prompts], self.values[prompts], mask

    def attend(self, q, k, v, step: int, scaling: float, gqa: bool) -> torch.Tensor:
        rows, heads, _, dim = q.shape
        batch, kv_heads = self.keys.shape[:2]
        start, end = self.prompt_len + step * self.group, self.prompt_len + (step + 1) * self.group
        self.keys[:, :, start:end] = k.view(batch, self.group, kv_heads, dim).transpose(1, 2)
        self.values[:, :, start:end] = v.view(batch, self.group, kv_heads, dim).transpose(1, 2)
        queries = q.view(batch, self.group, heads, dim).transpose(1, 2)  # [B, heads, G, D]
        out = F.scaled_dot_product_attention(
            queries, self.keys[:, :, :end], self.values[:, :, :end], attn_mask=self.mask[..., :end],
            scale=scaling, enable_gqa=gqa,
        )  # [B, heads, G, D]
        return out.transpose(1, 2).reshape(rows, heads * dim)
