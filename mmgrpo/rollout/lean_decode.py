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
could still change: nn.Linear projections or peft's LoRA layers over them (the step adds each
active adapter's B(A(x)) x scaling as peft's forward does; DoRA and other variants are refused),
SiLU, no sliding window, no attention soft-capping. Anything else decodes through transformers.

Hybrid decoders (Qwen3.5: three Gated DeltaNet layers to one gated attention layer) run here too:
a linear-attention layer's step updates its row's short-convolution window and delta-rule state
(`RowStates`, one copy per row: a state is small and each row's diverges from the first token);
an attention layer whose q_proj also yields a per-head output gate multiplies the attention's
output by its sigmoid, and rotary positions cover the part of each head the model rotates. Such
decoders' RMSNorms hold weight offsets from 1 (`zero_centered_norm`, the template's word).
tests/test_lean_decode.py checks tokens identical and log-probs equal to 1e-5 (fp32) against
the transformers path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgrpo.fusion.attach import decoder_fusion

WIDE_BLOCK_BYTES = 8 << 20  # weight rows per block of `wide_linear`: about 8 MB of them


def wide_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of a few rows (a decode step's) through a weight with many more outputs than inputs (an
    LM head, a SwiGLU gate or up projection), in blocks of about 8 MB of the weight's rows on the CPU.

    One GEMM of [8, 2048] by Qwen's [151,936, 2048] head takes 3.4 times a one-row product there,
    though it reads the same 1.24 GB of weights; in blocks it takes 1.76 times less (1.15-1.9x from 2 to
    16 rows, 1.3x at 64; the [11,008, 2048] gate and up projections 1.35-1.8x; benchmarks/wide_linear.py,
    one thread, fp32). Each output is the same dot product: equal to float rounding, and bit for bit in
    every shape benchmarked. Anywhere else (a GPU, one row, which a one-row kernel serves, many rows, a
    square or narrowing projection): F.linear.
    """
    outputs, inputs = weight.shape
    rows = x.numel() // inputs
    if (x.device.type != "cpu" or not 2 <= rows <= 64 or outputs < 4 * inputs
            or outputs * inputs * weight.element_size() < 2 * WIDE_BLOCK_BYTES):
        return F.linear(x, weight, bias)
    blocks = -(-outputs * inputs * weight.element_size() // WIDE_BLOCK_BYTES)
    block = -(-outputs // blocks)  # blocks of equal rows: no small last one, which a kernel may sum otherwise
    biases = bias.split(block) if bias is not None else [None] * blocks
    return torch.cat([F.linear(x, part, b) for part, b in zip(weight.split(block), biases)], dim=-1)


def _linear(x: torch.Tensor, module: nn.Module, wide: bool = False) -> torch.Tensor:
    """`module(x)` for an nn.Linear or a peft LoRA layer over one (`LeanDecoder.supports` admits no
    other), op for op: the base projection, then each active adapter's B(A(x)) x scaling added in
    the adapters' dtype and the sum cast back (peft's `lora.Linear.forward` in eval mode, where its
    dropout is the identity). wide: the base by `wide_linear`."""
    linear = wide_linear if wide else F.linear
    if type(module) is nn.Linear:  # the common case, on the hot path: one check
        return linear(x, module.weight, module.bias)
    base = module.base_layer
    out = linear(x, base.weight, base.bias)
    if module.merged or module.disable_adapters:
        return out
    dtype = out.dtype
    for name in module.active_adapters:
        if name in module.lora_A:
            a, b = module.lora_A[name], module.lora_B[name]
            low = F.linear(x if x.dtype == a.weight.dtype else x.to(a.weight.dtype), a.weight, a.bias)
            out = out + F.linear(low, b.weight, b.bias) * module.scaling[name]
    return out.to(dtype)


def _projection_refusal(name: str, module: nn.Module) -> str:
    """Why the step cannot run projection `module` ("" if it can): nn.Linear, or peft's LoRA layer
    over one without a variant (DoRA's magnitude and others change the forward)."""
    if type(module) is nn.Linear:
        return ""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        LoraLinear = None
    if LoraLinear is None or type(module) is not LoraLinear or type(module.base_layer) is not nn.Linear:
        return f"{name} is a {type(module).__name__}, not nn.Linear or a LoRA layer over one"
    if getattr(module, "lora_variant", None):
        return f"{name} has LoRA variants ({', '.join(sorted(module.lora_variant))}: DoRA or another), which change its forward"
    return ""


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Qwen RMSNorm, op for op: statistics in fp32, weight applied in x's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rms_norm_zero_centered(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Qwen3.5 / Qwen3-Next RMSNorm, op for op: all in fp32, scaled by 1 + weight."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
    return (normed * (1.0 + norm.weight.float())).type_as(x)


def _rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """Gated DeltaNet's output norm, op for op: RMSNorm (weight in x's dtype), then x SiLU(gate) in fp32."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(dtype)
    return (x * F.silu(gate.to(torch.float32))).to(dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    """The weights one decoder layer's step reads (plain tensors: no module calls)."""

    def __init__(self, layer: nn.Module):
        mlp = layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.linear = getattr(layer, "linear_attn", None)  # a Gated DeltaNet layer (hybrid decoders)
        if self.linear is not None:
            return
        attn = layer.self_attn
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.gqa = attn.num_key_value_groups > 1 if hasattr(attn, "num_key_value_groups") else False
        # q_proj twice the attention's width: each head's query, then its output gate (Qwen3.5)
        self.gated = self.q.out_features == 2 * self.o.in_features


class LeanDecoder:
    """Decode steps of `language_model` (a Qwen-style text decoder) over a rollout's K/V, one
    `GroupedPrefixKV` per layer (see there)."""

    def __init__(self, language_model: nn.Module, zero_centered_norm: bool = False):
        self.embed = language_model.embed_tokens
        self.norm = language_model.norm
        self.rms_norm = _rms_norm_zero_centered if zero_centered_norm else _rms_norm
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
        parts = ("input_layernorm", "post_attention_layernorm", "mlp")
        if not all(hasattr(layer, part) for layer in layers for part in parts):
            return False, f"decoder layers lack one of {', '.join(parts)}"
        if not all(hasattr(layer, "self_attn") or hasattr(layer, "linear_attn") for layer in layers):
            return False, "decoder layers without self_attn (or a Gated DeltaNet linear_attn)"
        if not all(hasattr(layer.mlp, part) for layer in layers for part in ("gate_proj", "up_proj", "down_proj")):
            return False, "MLPs that are not SwiGLU gate/up/down projections (mixture-of-experts blocks)"
        config = language_model.config
        if getattr(config, "hidden_act", "silu") != "silu":
            return False, f"hidden_act {config.hidden_act!r} (the lean step implements SiLU)"
        if getattr(config, "attn_logit_softcapping", None):  # Gemma 2: the step's SDPA does not cap scores
            return False, f"attention soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})"
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            return False, "sliding-window layers"
        if type(language_model.embed_tokens) is not nn.Embedding:
            return False, f"embedding {type(language_model.embed_tokens).__name__} (the lean step implements nn.Embedding)"
        # The step reads each projection's weights (`_linear`): another wrapper's forward would be
        # skipped silently, so anything but nn.Linear or plain LoRA over it decodes through transformers.
        for layer in layers:
            mixer = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
            for name, module in (*mixer.named_children(), *layer.mlp.named_children()):
                if "_proj" in name and (why := _projection_refusal(name, module)):  # q_proj ... in_proj_qkv, out_proj
                    return False, why
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
        norm = self.rms_norm
        for index, (layer, store) in enumerate(zip(self.layers, kv)):
            x = norm(hidden, layer.input_norm)
            if layer.linear is not None:
                hidden = hidden + store.step(x, layer.linear)
            else:
                hidden = hidden + self._attention(x, layer, store, cos, sin, step)
            x = norm(hidden, layer.post_norm)
            x = F.silu(_linear(x, layer.gate, wide=True)) * _linear(x, layer.up, wide=True)
            hidden = hidden + _linear(x, layer.down)
            if fusion is not None:
                hidden = fusion.after_layer(index, hidden)
        return norm(hidden, self.norm)[:, 0]  # [N, H]

    def _attention(self, x, layer: _Layer, store, cos, sin, step: int) -> torch.Tensor:
        """An attention layer's output [N, 1, H] for normed input x [N, 1, H]."""
        rows = x.shape[0]
        q = _linear(x, layer.q).view(rows, 1, -1, layer.head_dim * (2 if layer.gated else 1))
        gate = None
        if layer.gated:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(rows, 1, -1)
        k = _linear(x, layer.k).view(rows, 1, -1, layer.head_dim)
        v = _linear(x, layer.v).view(rows, 1, -1, layer.head_dim)
        if layer.q_norm is not None:
            q, k = self.rms_norm(q, layer.q_norm), self.rms_norm(k, layer.k_norm)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [N, heads, 1, D]
        rotated = cos.shape[-1]  # the part of each head the model rotates (all of it but for Qwen3.5's quarter)
        if rotated == layer.head_dim:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        else:
            q = torch.cat([q[..., :rotated] * cos + _rotate_half(q[..., :rotated]) * sin, q[..., rotated:]], dim=-1)
            k = torch.cat([k[..., :rotated] * cos + _rotate_half(k[..., :rotated]) * sin, k[..., rotated:]], dim=-1)
        attended = store.attend(q, k, v, step, layer.scaling, layer.gqa)[:, None]  # [N, 1, heads * D]
        if gate is not None:
            attended = attended * torch.sigmoid(gate)
        return _linear(attended, layer.o)


class RowStates:
    """One Gated DeltaNet layer's state per decoding row: the last `kernel` inputs of its short
    convolution [N, channels, kernel] and its delta-rule state [N, value_heads, k_dim, v_dim], each
    row's a copy of its prompt's at first. `step` runs the layer for one token per row, as
    transformers' cached decode does (its convolution update, then the recurrent delta rule:
    decay the state, write v - S k scaled by beta at k, read at q), updating the states in place.
    """

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, group: int):
        self.group = group
        self.conv, self.recurrent = conv.repeat_interleave(group, dim=0), recurrent.repeat_interleave(group, dim=0)

    def keep(self, prompts: torch.Tensor, mask=None) -> None:
        """Only the rows of `prompts` (indices into the current batch of prompts) decode on."""
        rows = (prompts[:, None] * self.group + torch.arange(self.group, device=prompts.device)).flatten()
        self.conv, self.recurrent = self.conv[rows], self.recurrent[rows]

    def step(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """The layer's output [N, 1, H] for normed input x [N, 1, H]."""
        rows = x.shape[0]
        mixed = _linear(x, layer.in_proj_qkv)[:, 0, :, None]  # [N, channels, 1]
        z = _linear(x, layer.in_proj_z).reshape(rows, -1, layer.head_v_dim)  # [N, v_heads, dv]
        b, a = _linear(x, layer.in_proj_b)[:, 0], _linear(x, layer.in_proj_a)[:, 0]  # [N, v_heads]
        window = torch.cat([self.conv[..., 1:], mixed.to(self.conv.dtype)], dim=-1)  # the last `kernel` inputs
        self.conv = window
        mixed = F.conv1d(window.to(layer.conv1d.weight.dtype), layer.conv1d.weight, layer.conv1d.bias, groups=window.shape[1])
        mixed = F.silu(mixed)[..., 0].to(x.dtype)  # [N, channels]
        q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        v_heads = layer.num_v_heads
        q = q.reshape(rows, -1, layer.head_k_dim).repeat_interleave(v_heads // layer.num_k_heads, dim=1).float()
        k = k.reshape(rows, -1, layer.head_k_dim).repeat_interleave(v_heads // layer.num_k_heads, dim=1).float()
        v = v.reshape(rows, v_heads, layer.head_v_dim).float()
        q, k = _l2norm(q), _l2norm(k)
        q = q / (q.shape[-1] ** 0.5)
        beta = b.sigmoid().float()[..., None]  # [N, v_heads, 1]
        decay = (-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)).exp()[..., None, None]
        state = self.recurrent.to(v) * decay  # [N, v_heads, dk, dv]
        delta = (v - (state * k[..., None]).sum(dim=-2)) * beta
        state = state + k[..., None] * delta[..., None, :]
        self.recurrent = state
        out = (state * q[..., None]).sum(dim=-2).to(x.dtype)  # [N, v_heads, dv]
        out = _rms_norm_gated(out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim), layer.norm)
        return _linear(out.reshape(rows, 1, -1), layer.out_proj)


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
