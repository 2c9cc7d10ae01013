"""Sequence parallelism (Ulysses): one row's tokens split across the N ranks of a group.

A long video row (tens of thousands of prompt tokens) is what runs a device out of memory in the
log-prob and update forwards: every decoder layer keeps activations for every token. Here the
decoder runs on 1/N of the tokens per rank:

    towers:     the vision tower encodes 1/N of the images, tiles and video frames on each rank;
                one all-gather gives every rank the whole row's features (tower_split.py)
    backbone:   embeddings and 3-D mRoPE positions on the whole row                 (every rank)
    split:      inputs_embeds and position_ids cut into N contiguous slices         (rank r: slice r)
    each layer: norms, projections, MLP on the rank's slice; attention exchanges heads for tokens
                with one all-to-all (queries, keys, values: [B, H, S/N, D] -> [B, H/N, S, D]),
                runs SDPA over the whole row for its H/N heads, and exchanges back
    log-probs:  each rank scores the completion tokens its slice predicts; one sum over the group
                gives every rank the row's log-probs [N_rows, T]

Positions are computed on the whole row before the split, so the mRoPE positions of an image
token do not depend on the slice it lands in (the breakage peers report when positions are
computed per slice). The attention mask (causal over the row, padding from the row's own mask) is
built once per forward from the whole row's mask, not from the slice.

Gradients: a rank's backward reaches the parameters through its own slice only (attention's
all-to-all carries the other slices' share of its keys and values back to them), so the group's
gradients must be summed (`sum_gradients`): the sum equals one process's gradient of the whole
row. Under data parallelism over the same ranks (FSDP2 averages over the world) a sum within the
group is a loss scaled by N.

    group = new_sequence_group(2)                                 # ranks 0-1, 2-3, ... of the world
    with ulysses(model, template, group) as split:
        hidden = backbone(**inputs).last_hidden_state             # this rank's slice of each row
    logps, _ = sequence_parallel_logprobs(hidden, lm_head.weight, split, prompt_len, completion_ids)
    logps.sum().backward(); sum_gradients(model, group)

The group-shared prefix runs split too (`split_shared_prefix_logprobs`): the prompts alone, each once,
then the G completions of each, split, reading the K/V (and Gated DeltaNet states) each rank kept of
its heads over the whole prompt.

Masks: causal over the whole row, or the row's [L, L] mask where a row is padded before its end, with a
layer's sliding window as a band; where the model builds the whole row's masks before its decoder
(Gemma: image blocks attend both ways), those. Gradient checkpointing: a layer recomputed in the
backward (after the split forward returned) re-enters the split as it was when the layer ran.

In training (`--sequence_parallel_size N --parallel fsdp2`): groups of N consecutive ranks read the
same prompts, train on their leader's rollout, run the policy's, reference's and teacher's log-prob
forwards split (with the shared prefix where the policy shares it), and scale the loss by N so that
FSDP2's average over the world sums each group's shares.

The vision towers are split across the group too (mmgrpo/forward/tower_split.py).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmgrpo.errors import ConfigError
from mmgrpo.forward.shared_prefix import model_parts, prepend_prompt, rows_of_prompts
from mmgrpo.forward.tower_split import split_tower

ATTENTION = "mmgrpo_ulysses"  # the decoder's attention implementation while a split forward runs


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (equal chunks, chunk i to rank i); its backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous like x: the exchange writes memory in order
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _SumOverGroup(torch.autograd.Function):
    """The group's sum of each rank's part; every rank then computes the same loss from it, so a
    rank's gradient of its part is the loss's gradient itself (no second sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Split:
    """The state of one split forward: the group, the row's padded length, this rank's slice and the
    whole row's attention mask."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mask = None  # [B, 1, L, L] bool, True = attend; None: causal, nothing padded before a row's end
        self.valid = None  # [B, L]: 1 at the row's tokens
        self.full = self.length = self.start = self.end = 0
        # the shared prefix (`split_shared_prefix_logprobs`): "prompts" keeps each layer's K/V or linear state of
        # this rank's heads over the whole prompts, "completions" reads them before the completion tokens
        self.phase = "rows"
        self.kept: dict = {}  # decoder module -> (keys, values) [B, h, P, d] or (conv inputs [B, c, kernel], state)
        self.prompt_valid = None  # [B, P] bool: the prompts' tokens
        self.typed: dict = {}  # layer type -> [B, 1, L, L]: the whole row's masks where the model built them (Gemma)
        self.windows: dict = {}  # sliding window -> the mask with its band, built once per forward
        self.group_size, self.prompt_of_row = None, None  # G (or None: unequal groups), [N]

    def cut(self, full_length: int) -> None:
        self.full = full_length
        self.length = -(-full_length // self.size) * self.size  # padded to a multiple of N
        local = self.length // self.size
        self.start, self.end = self.rank * local, (self.rank + 1) * local

    def mask_of(self, module: nn.Module) -> torch.Tensor | None:
        """The attention mask of one layer: the model's own where it built the whole row's (Gemma: its
        image blocks attend both ways, its sliding window), else the split's, with the layer's sliding
        window (`module.sliding_window`: key j seen by query i only where i - j < window) as a band."""
        window = getattr(module, "sliding_window", None)
        typed = self.typed.get("sliding_attention" if window else "full_attention")
        if typed is not None or not window:
            return typed if typed is not None else self.mask
        if window not in self.windows:
            keys = self.mask.shape[-1] if self.mask is not None else self.length
            device = self.valid.device
            query = torch.arange(self.length, device=device)[:, None] + keys - self.length  # the queries' row indices
            key = torch.arange(keys, device=device)[None]
            band = (key <= query) & (key > query - window)
            self.windows[window] = band[None, None] if self.mask is None else self.mask & band
        return self.windows[window]

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, S/N, D] (this rank's tokens, all heads) -> [B, H/N, S, D] (all tokens, its heads)."""
        batch, heads, local, dim = x.shape
        x = x.view(batch, self.size, heads // self.size, local, dim).transpose(0, 1)  # [N, B, H/N, S/N, D]
        x = _AllToAll.apply(x, self.group)  # chunk s now holds rank s's tokens
        return x.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, self.size * local, dim)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H/N, S, D] -> [B, H, S/N, D], the inverse exchange."""
        batch, part, length, dim = x.shape
        x = x.view(batch, part, self.size, length // self.size, dim).permute(2, 0, 1, 3, 4)  # [N, B, H/N, S/N, D]
        x = _AllToAll.apply(x, self.group)  # chunk s now holds head group s of this rank's tokens
        return x.transpose(0, 1).reshape(batch, self.size * part, length // self.size, dim)


_active: _Split | None = None


def _ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-interface signature: query [B, H, S/N, D], key/value [B, H_kv, S/N, D]
    -> ([B, S/N, H, D], None). `attention_mask` (built for the slice) is ignored: the whole row's is used."""
    split = _active
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % split.size:  # too few K/V heads to split: each query head's own copy
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = split.seq_to_heads(query), split.seq_to_heads(key), split.seq_to_heads(value)
    if split.phase == "prompts":  # the real tokens' K/V (the split's padding comes after them); once (not by a
        split.kept.setdefault(module, (k[:, :, : split.full], v[:, :, : split.full]))  # checkpointed layer's replay)
    elif split.phase == "completions":
        keys, values = split.kept[module]
        k = prepend_prompt(keys, k, split.group_size, split.prompt_of_row)
        v = prepend_prompt(values, v, split.group_size, split.prompt_of_row)
    mask = split.mask_of(module)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        is_causal=mask is None, enable_gqa=k.shape[1] != q.shape[1],
    )  # [B, H/N, S, D]
    return split.heads_to_seq(out).transpose(1, 2).contiguous(), None


def _linear_attention(module, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """A Gated DeltaNet layer (Qwen3.5) on this rank's slice: the layer is exact only over the whole
    row (its short convolution reads the previous tokens, its delta rule carries a state through
    them), and its heads are independent, so it exchanges channels for tokens as attention does:
    each rank convolves and runs the delta rule over the whole row for 1/N of the heads (its query,
    key and value channels, its decay and beta), then the heads come back to their tokens for the
    gated norm and the output projection. The layer's own convolution and chunked delta-rule
    functions run (transformers' kernels where installed)."""
    import sys

    split, kernels = _active, sys.modules[type(module).__module__]
    size, batch, local = split.size, hidden_states.shape[0], hidden_states.shape[1]
    hidden_states = hidden_states * split.valid[:, split.start : split.end, None].to(hidden_states.dtype)
    k_heads, v_heads, dk, dv = module.num_k_heads // size, module.num_v_heads // size, module.head_k_dim, module.head_v_dim
    q, k, v = torch.split(module.in_proj_qkv(hidden_states), [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    parts = [q.view(batch, local, size, k_heads * dk), k.view(batch, local, size, k_heads * dk),
             v.view(batch, local, size, v_heads * dv), module.in_proj_b(hidden_states).view(batch, local, size, v_heads),
             module.in_proj_a(hidden_states).view(batch, local, size, v_heads)]  # fmt: skip
    # [B, S/N, N, c] -> [B, N, S/N, c] -> [B, 1, S, c]: this rank's head group over the whole row
    mine = split.seq_to_heads(torch.cat(parts, dim=-1).transpose(1, 2))[:, 0]  # [B, S, c]
    # the row's tokens only: the split's padding comes after them, and the delta rule's state must end at the last
    mine = mine[:, : split.full]
    q, k, v, b, a = torch.split(mine, [k_heads * dk, k_heads * dk, v_heads * dv, v_heads, v_heads], dim=-1)
    rank = split.rank
    channels = torch.cat([  # this rank's channels of the depthwise convolution: its q, k and v heads
        torch.arange(rank * k_heads * dk, (rank + 1) * k_heads * dk),
        module.key_dim + torch.arange(rank * k_heads * dk, (rank + 1) * k_heads * dk),
        2 * module.key_dim + torch.arange(rank * v_heads * dv, (rank + 1) * v_heads * dv),
    ]).to(hidden_states.device)
    bias = None if module.conv1d.bias is None else module.conv1d.bias[channels]
    inputs = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # [B, c, S]
    length, kernel, initial = inputs.shape[-1], module.conv_kernel_size, None
    if split.phase == "completions":  # each row goes on from its prompt's last inputs and state
        conv, state = (kept.index_select(0, split.prompt_of_row) for kept in split.kept[module])
        inputs, initial = torch.cat([conv, inputs], dim=-1), state
    mixed = kernels.causal_conv1d_fn(inputs, module.conv1d.weight[channels].squeeze(1), bias,
                                     activation=module.activation)[..., -length:]
    q, k, v = torch.split(mixed.transpose(1, 2), [k_heads * dk, k_heads * dk, v_heads * dv], dim=-1)
    heads = slice(rank * v_heads, (rank + 1) * v_heads)
    g = -module.A_log[heads].float().exp() * F.softplus(a.float() + module.dt_bias[heads])
    group = v_heads // k_heads  # each key head serves `group` consecutive value heads
    out, state = kernels.torch_chunk_gated_delta_rule(
        q.reshape(batch, length, k_heads, dk).repeat_interleave(group, dim=2),
        k.reshape(batch, length, k_heads, dk).repeat_interleave(group, dim=2),
        v.reshape(batch, length, v_heads, dv), g=g, beta=b.sigmoid(), initial_state=initial,
        output_final_state=split.phase == "prompts", use_qk_l2norm_in_kernel=True,
    )  # [B, S, v_heads/N, dv]
    if split.phase == "prompts":  # the convolution's last inputs (zeros before a short row) and the final state
        split.kept.setdefault(module, (F.pad(inputs[..., -kernel:], (max(kernel - length, 0), 0)), state))
    out = F.pad(out.reshape(batch, 1, length, v_heads * dv), (0, 0, 0, split.length - length))
    out = split.heads_to_seq(out)  # [B, N, S/N, v_heads/N * dv]
    out = out.transpose(1, 2).reshape(-1, dv)  # each token's heads in order
    z = module.in_proj_z(hidden_states).reshape(-1, dv)
    return module.out_proj(module.norm(out, z).reshape(batch, local, -1))


def _register() -> None:
    """The split's attention under its own name; masks are built as for SDPA: a model that builds the
    whole row's masks before its decoder (Gemma) gives them to the split, the decoder's own (of its
    slice) go unused."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def _padded_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """A whole row's [B, 1, S, S] bool mask padded to [B, 1, L, L]: padded keys hidden, a padded query
    (or one that sees nothing) sees itself, so no row of the softmax is empty."""
    extra = length - mask.shape[-1]
    keep = F.pad(mask.bool(), (0, extra, 0, extra), value=False)
    return keep | (torch.eye(length, dtype=torch.bool, device=keep.device) & ~keep.any(-1, keepdim=True))


def row_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1, L, L] bool (True = attend) of rows whose 2D mask is attention_mask [B, S], padded to
    L >= S: causal, padded keys hidden. A query that would see no key (left padding) sees itself,
    so no row of the softmax is empty; its output is never scored."""
    batch, seq = attention_mask.shape
    valid = F.pad(attention_mask.bool(), (0, length - seq), value=False)  # [B, L]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    keep = causal[None] & valid[:, None, :]  # [B, L, L]
    keep |= torch.eye(length, dtype=torch.bool, device=valid.device)[None] & ~keep.any(-1, keepdim=True)
    return keep[:, None]


def prefix_mask(prompt_valid: torch.Tensor, prompt_of_row: torch.Tensor, length: int) -> torch.Tensor:
    """[N or 1, 1, L, P + L] bool (True = attend) of completion rows padded to L, each after its prompt
    (prompt_valid [B, P]: the prompts' tokens): a row's tokens see its prompt's tokens and, causally,
    its own. One mask for all rows where no prompt is padded."""
    causal = torch.ones(length, length, dtype=torch.bool, device=prompt_valid.device).tril()
    if bool(prompt_valid.all()):
        return torch.cat([causal.new_ones(length, prompt_valid.shape[1]), causal], dim=-1)[None, None]
    rows = prompt_valid.index_select(0, prompt_of_row)  # [N, P]
    return torch.cat([rows[:, None].expand(-1, length, -1), causal.expand(rows.shape[0], -1, -1)], dim=-1)[:, None]


def check_heads(model: nn.Module, template, size: int) -> None:
    """A ConfigError unless `size` divides the decoder's attention heads (and a hybrid decoder's
    linear-attention key and value heads)."""
    _, decoder = model_parts(model, template)
    config = decoder.config
    for field in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"):
        heads = getattr(config, field, None)
        if heads and heads % size:
            raise ConfigError(f"--sequence_parallel_size {size} does not divide the decoder's {heads} heads ({field}): "
                              "give a divisor of it.")


@contextmanager
def ulysses(model: nn.Module, template, group):
    """Within it, the backbone's text decoder runs on this rank's slice of each row (see the module
    docstring); its output last_hidden_state is that slice, positions `split.start:split.end` of the
    row padded to a multiple of N. Yields the split (its `start`, `end`, `length` are set by each forward)."""
    _register()
    _, decoder = model_parts(model, template)
    check_heads(model, template, dist.get_world_size(group))
    split = _Split(group)

    def before(module, args, kwargs):
        embeds = kwargs["inputs_embeds"]  # the backbone merged the media into the embeddings
        full = embeds.shape[1]
        split.cut(full)
        mask = kwargs.get("attention_mask")
        typed = mask if isinstance(mask, dict) else {}  # Gemma: the whole row's masks by layer type, or None (causal)
        if typed or mask is None:  # the row's tokens: all, or those the last query (a prompt's last token) sees
            full_mask = typed.get("full_attention")
            mask = (full_mask[:, 0, -1].long() if full_mask is not None
                    else torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device))
        split.windows = {}
        split.typed = {kind: _padded_mask(m, split.length) for kind, m in typed.items()
                       if m is not None and split.phase != "completions"}  # a completion's are the split's: its prompt, then causal
        if split.phase == "completions":  # each row's prompt (its real tokens), then its own tokens causally
            split.mask = prefix_mask(split.prompt_valid, split.prompt_of_row, split.length)
        else:  # rows without padding (the split's own comes last, after every real token): causal attention, no
            # [L, L] mask; else the whole row's mask, as transformers builds one for a padded batch
            split.mask = None if bool(mask.all()) else row_mask(mask, split.length)
        if split.phase == "prompts":
            split.prompt_valid = mask.bool()
        split.valid = F.pad(mask, (0, split.length - full))  # [B, L]: the row's tokens (linear layers zero the rest)
        kwargs["inputs_embeds"] = F.pad(embeds, (0, 0, 0, split.length - full))[:, split.start : split.end]
        positions = kwargs.get("position_ids")  # [B, S] or [3|4, B, S], computed on the whole row
        if positions is None:  # a 1-D RoPE decoder would count its slice from 0
            positions = torch.arange(full, device=embeds.device).expand(embeds.shape[0], full)
        # the split's padding positions (after the row's end) are never scored
        kwargs["position_ids"] = F.pad(positions, (0, split.length - full))[..., split.start : split.end]
        kwargs["attention_mask"] = None
        per_layer = kwargs.get("per_layer_inputs")  # Gemma 4: [B, S, layers, d], the tokens' own inputs to each layer
        if per_layer is not None:
            kwargs["per_layer_inputs"] = F.pad(per_layer, (0, 0, 0, 0, 0, split.length - full))[:, split.start : split.end]
        visual = kwargs.get("visual_pos_masks")  # Qwen3-VL's deepstack: features added at the visual positions
        if visual is not None:
            mine = F.pad(visual, (0, split.length - full))[:, split.start : split.end]  # [B, S/N]
            in_slice = torch.zeros_like(visual)
            in_slice[:, split.start : split.end] = True
            keep = in_slice[visual]  # of the row's visual tokens (in the order the features are), those in the slice
            kwargs["visual_pos_masks"] = mine
            kwargs["deepstack_visual_embeds"] = [features[keep] for features in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    handle = decoder.register_forward_pre_hook(before, with_kwargs=True)
    linear = [layer.linear_attn for layer in decoder.layers if hasattr(layer, "linear_attn")]  # Gated DeltaNet
    checkpointed = [layer for layer in decoder.layers if getattr(layer, "gradient_checkpointing", False)]
    checkpoints = [layer._gradient_checkpointing_func for layer in checkpointed]
    for layer, checkpoint in zip(checkpointed, checkpoints):
        layer._gradient_checkpointing_func = partial(_replayable, checkpoint, split, decoder, linear)
    tower = split_tower(model, template, split)  # its forward an instance attribute, removed below
    try:
        with _installed(split, decoder, linear):
            yield split
    finally:
        handle.remove()
        for layer, checkpoint in zip(checkpointed, checkpoints):
            layer._gradient_checkpointing_func = checkpoint
        if tower is not None:
            del tower.forward


@contextmanager
def _installed(split: _Split, decoder: nn.Module, linear: list[nn.Module]):
    """The split's attention and Gated DeltaNet layers on the decoder, and `split` the active state, for
    one forward; what was there before comes back after (re-entrant)."""
    global _active
    config = decoder.config
    saved = _active, config._attn_implementation, [module.__dict__.get("forward") for module in linear]
    _active, config._attn_implementation = split, ATTENTION
    for module in linear:
        module.forward = partial(_linear_attention, module)  # an instance attribute
    try:
        yield
    finally:
        _active, config._attn_implementation = saved[:2]
        for module, forward in zip(linear, saved[2]):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _replayable(checkpoint, split: _Split, decoder: nn.Module, linear: list[nn.Module], function, *args, **kwargs):
    """A decoder layer's gradient checkpointing under the split: the backward recomputes the layer
    after `ulysses` has exited, so the recomputation runs inside the split again, as the state was
    when the layer ran (its phase, slice and mask: a shallow copy, as later forwards replace them)."""
    state = copy.copy(split)

    def run(*inputs, **options):
        with _installed(state, decoder, linear):
            return function(*inputs, **options)

    return checkpoint(run, *args, **kwargs)


def _scored(hidden: torch.Tensor, lm_head_weight: torch.Tensor, start: int, offset: int, completion_ids: torch.Tensor,
            **logprob_kwargs) -> list[torch.Tensor]:
    """This rank's share of the rows' completion log-probs (and entropies) [N, T], zeros elsewhere: its
    hidden states [N, S, H] sit at positions start .. start + S - 1, and position offset + t predicts
    completion token t. Zeros that still hang on the hidden states and the head where it predicts none."""
    batch, length = completion_ids.shape
    first, last = max(start, offset), min(start + hidden.shape[1], offset + length)  # its predicting positions
    count = 2 if logprob_kwargs.get("compute_entropy", False) else 1
    if last <= first:
        zero = torch.zeros(batch, length, dtype=torch.float32, device=hidden.device) + (hidden.sum() + lm_head_weight.sum()) * 0.0
        return [zero] * count
    from mmgrpo.grpo.logprobs import completion_logprobs

    found = completion_logprobs(hidden[:, first - start : last - start], lm_head_weight,
                                completion_ids[:, first - offset : last - offset], **logprob_kwargs)
    widths = (first - offset, offset + length - last)
    return [F.pad(part.float(), widths) for part in found[:count]]


def _summed(parts: list[torch.Tensor], group) -> tuple[torch.Tensor, torch.Tensor | None]:
    summed = _SumOverGroup.apply(torch.stack(parts), group)  # [1 or 2, N, T]
    return summed[0], (summed[1] if len(parts) > 1 else None)


def sequence_parallel_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, split: _Split,
                               prompt_len: int, completion_ids: torch.Tensor, **logprob_kwargs) -> tuple:
    """The rows' completion log-probs [B, T] (and entropies, where `compute_entropy`; else None) from
    this rank's slice of final hidden states hidden [B, S/N, H]: the rank scores the tokens its
    positions predict (position prompt_len - 1 + t predicts completion token t), the group's sum
    fills in the rest, on every rank. logprob_kwargs: `completion_logprobs`'s."""
    return _summed(_scored(hidden, lm_head_weight, split.start, prompt_len - 1, completion_ids, **logprob_kwargs),
                   split.group)


def split_shared_prefix_logprobs(model: nn.Module, template, group, prompt_inputs: dict, completion_ids: torch.Tensor,
                                 completion_mask: torch.Tensor, counts: list[int], lm_head_weight: torch.Tensor,
                                 **logprob_kwargs) -> tuple:
    """The shared prefix under the split: each prompt runs once for its G completions, its tokens split.

    prompts:      the prompts alone (B rows, media and whole-row positions as `shared_prefix_hidden`) run
                  split; each attention layer keeps its K/V of this rank's heads over the whole prompt
                  (what Ulysses' exchange gives it), each Gated DeltaNet layer its convolution's last
                  inputs and its delta-rule state for its heads
    completions:  the N rows' tokens, split too; each layer prepends its prompt's K/V to the row's
                  (`prepend_prompt`: G rows read one copy) or starts the convolution and the delta
                  rule from the prompt's; position next_position + t, as in one process
    scores:       completion token 0 from the prompt's last position (on the rank holding it), token t
                  from completion position t - 1; one sum over the group

    A rank keeps 1/N of the prompts' K/V heads, so they are split as the rows are. Equal to the
    naive forward over prompt + completion in one process (tests/test_sequence_parallel.py).
    Returns (logps [N, T], entropies or None), on every rank of the group.
    """
    core, _ = model_parts(model, template)
    prompt_ids = prompt_inputs["input_ids"]
    length, device, prompt_len = completion_ids.shape[1], completion_ids.device, prompt_ids.shape[1]
    group_size, prompt_of_row = rows_of_prompts(prompt_ids.shape[0], completion_ids.shape[0], counts, device)
    positions, next_position = template.prompt_positions(core, prompt_inputs)
    inputs = max(length - 1, 1)  # tokens 0 .. T-2 predict 1 .. T-1 (with T = 1, token 0 runs: every rank makes the same calls)
    completion_positions = next_position.index_select(-1, prompt_of_row)[..., None] + torch.arange(inputs, device=device)
    with ulysses(model, template, group) as split:
        split.phase = "prompts"
        prompt_hidden = core(**{k: v for k, v in prompt_inputs.items() if k != "position_ids"},
                             position_ids=positions, use_cache=False).last_hidden_state  # [B, P/N, H]
        at = prompt_len - 1 - split.start  # the prompts' last position in this rank's slice, where it holds it
        last = prompt_hidden[:, at : at + 1] if 0 <= at < prompt_hidden.shape[1] else prompt_hidden[:, :0]
        first = _scored(last.index_select(0, prompt_of_row), lm_head_weight, prompt_len - 1, prompt_len - 1,
                        completion_ids[:, :1], **logprob_kwargs)  # [N, 1]: token 0, or zeros on the other ranks
        split.phase, split.group_size, split.prompt_of_row = "completions", group_size, prompt_of_row
        hidden = core(input_ids=completion_ids[:, :inputs], attention_mask=completion_mask[:, :inputs],
                      position_ids=completion_positions, use_cache=False).last_hidden_state  # [N, T'/N, H]
        rest = _scored(hidden, lm_head_weight, split.start, -1, completion_ids, **logprob_kwargs)
    return _summed([F.pad(a, (0, length - 1)) + b for a, b in zip(first, rest)], group)


def sum_gradients(model: nn.Module, group) -> None:
    """Sum each trainable parameter's gradient over the sequence-parallel group (see the module
    docstring). A parameter this rank's slice never reached (the LM head on a slice of prompt tokens
    only) takes part with zeros: every rank makes the same calls."""
    for param in model.parameters():
        if param.requires_grad:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)


def new_sequence_group(size: int):
    """This rank's sequence-parallel group: consecutive ranks [k * size, (k + 1) * size) of the world.
    Every rank creates every group (torch.distributed's rule); a start-up error unless size divides
    the world size."""
    world = dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"--sequence_parallel_size {size} does not divide the world size {world}")
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine
