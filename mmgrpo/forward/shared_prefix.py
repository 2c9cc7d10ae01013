"""Run each prompt once for its G completions: the shared-prefix training forward.

In multimodal GRPO a prompt is long (hundreds of image tokens) and its G completions are short.
The naive log-prob forward repeats the prompt and its media G times:

    naive:   vision(image) x G,  decoder over G x (P + T) tokens
    shared:  vision(image) x 1,  decoder over P tokens, then G x T tokens reading the prompt's K/V

``shared_prefix_hidden`` runs the prompt (vision / audio tower included) once, keeps every
layer's keys and values, and runs the completion tokens against them, each of the G rows reading
its prompt's K/V through an `expand` view (differentiable: the gradients of all G completions
flow back into the one prompt forward, the media towers included). It is exact, not an
approximation: a decoder token sees the same keys, values, mask and positions as in the naive
forward, so log-probs and gradients match it to float rounding (tests/test_shared_prefix.py
checks 1e-5 in fp32).

    hidden = shared_prefix_hidden(model, template, prompt_batch, completion_ids, completion_mask, G)
    logps, _ = completion_logprobs(hidden, model.lm_head.weight, completion_ids)

What the family's model looks like comes from its template (mmgrpo/templates/base.py): the
*backbone* (``components["backbone"]``: the module that takes input_ids + media and returns
last_hidden_state), the text decoder inside it (``components["llm"]``), whether the family
allows the shared prefix at all (``shared_prefix``) and has sliding-window layers
(``sliding_window_layers``), and the positions (``prompt_positions``, from the template's one
``position_ids`` hook): [3, B, P] mRoPE for the Qwen-VL families and the Qwen2.5-Omni thinker,
[B, P] 1-D RoPE for the others, where a completion token t sits at ``next_position + t``. (The
policy's naive forward lets a 1-D model count 0..L-1 over the padding too: a per-row shift,
which RoPE ignores, so the two agree to float rounding.) A family registered by a plugin gets
these paths by declaring the same (tests/test_custom_template.py).

Media need nothing else: the prompt forward gets the collated media as the naive forward does
(Qwen2-Audio's clips, LLaVA-OneVision's tiles with `batch_num_images`, Gemma3's
`token_type_ids`, whose image blocks attend both ways within the prompt); a completion is text
and reads only the K/V. Sliding-window layers (Gemma3): the cache layers here report the whole
prompt + completion to transformers' mask builder, which applies the window on those indices
exactly as in the naive forward over prompt + completion.

Where it cannot apply, ``supports_shared_prefix`` says why and the caller runs the naive forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from mmgrpo.fusion.attach import continuing_rows

# Tested on CPU. flash_attention_2 should work (bottom-right causal, 2D mask) but is untested: off until a GPU test says so.
SUPPORTED_ATTENTION = ("sdpa", "eager")


# ---------------------------------------------------------------------------------------------
# Cache layers: a prompt forward records K/V, a completion forward reads them
# ---------------------------------------------------------------------------------------------


class _RecordingLayer(DynamicLayer):
    """Keeps the K/V of the one forward it sees. Idempotent: a gradient-checkpointing replay
    overwrites them with equal tensors instead of appending a second copy."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PrefixLayer(DynamicLayer):
    """Holds one prompt K/V per group and prepends it to each row's new K/V, storing nothing, so a
    checkpointing replay sees the same prefix again.

    Equal groups of G rows: the prompt's K/V is read through `expand`, never copied G times
    (the concatenation is the only [N, heads, P + T, head_dim] copy, as in the naive forward);
    its backward sums the G rows' gradients into the one prompt. Unequal groups: index_select.
    """

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, group: int | None, prompt_of_row: torch.Tensor
    ):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values  # [B, kv_heads, P, head_dim], one per prompt
        self.group, self.prompt_of_row = group, prompt_of_row  # G or None; [N]

    def update(self, key_states, value_states, *args, **kwargs):
        return (prepend_prompt(self.keys, key_states, self.group, self.prompt_of_row),
                prepend_prompt(self.values, value_states, self.group, self.prompt_of_row))


def prepend_prompt(prefix: torch.Tensor, new: torch.Tensor, group: int | None, prompt_of_row: torch.Tensor) -> torch.Tensor:
    """Each row's prompt K/V (prefix [B, heads, P, d], one per prompt) before its own (new [N, heads, T, d]):
    [N, heads, P + T, d]. Equal groups of G rows read the prompt through `expand` (a view: the
    concatenation is the only copy, and its backward sums the G rows' gradients into the one prompt);
    unequal groups (group None) through index_select."""
    if group is None:
        return torch.cat([prefix.index_select(0, prompt_of_row), new], dim=-2)
    batch, heads, _, head_dim = prefix.shape
    shared = prefix[:, None].expand(batch, group, *prefix.shape[1:])  # [B, G, kv, P, d], a view
    grouped = new.view(batch, group, heads, -1, head_dim)  # [B, G, kv, T, d]
    return torch.cat([shared, grouped], dim=-2).flatten(0, 1)  # [N, kv, P + T, d]


class _RecordingStateLayer(LinearAttentionLayer):
    """A linear-attention layer's state after the one forward it sees (a prompt's): the last
    `conv_kernel` inputs of its short causal convolution and the delta rule's recurrent state
    [B, heads, k_dim, v_dim]. As `_RecordingLayer`, idempotent: `has_previous_state` stays False,
    so a replay runs from no state again and records equal tensors, with their gradients."""

    def update_conv_state(self, conv_states, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs):
        kernel = conv_kernel_size or conv_states.shape[-1]
        tail = conv_states[..., -kernel:]  # [B, channels, <= kernel]; left padding is zeros, as in the forward
        self.conv_states[state_idx] = F.pad(tail, (kernel - tail.shape[-1], 0))
        self.conv_kernel_size[state_idx] = kernel
        return conv_states

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states


class _PrefixStateLayer(LinearAttentionLayer):
    """Starts each row from its prompt's recorded linear-attention state and stores nothing.

    The convolution reads the prompt's last inputs before the row's own (`update_conv_state`
    returns them concatenated), the delta rule starts from the prompt's recurrent state (a per-row
    copy, [N, heads, k_dim, v_dim]: the states are small beside K/V, and the rule updates its
    state out of place). `record_past` sends single-token completions down the same path instead
    of transformers' in-place decode kernel. Gradients reach the one prompt forward through both.
    """

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, prompt_of_row: torch.Tensor):
        super().__init__()
        self.conv_states[0] = conv.index_select(0, prompt_of_row)  # [N, channels, kernel]
        self.recurrent_states[0] = recurrent.index_select(0, prompt_of_row)
        self.has_previous_state[0] = True
        self.record_past = True

    def update_conv_state(self, conv_states, state_idx: int = 0, **kwargs):
        return torch.cat([self.conv_states[state_idx], conv_states], dim=-1)

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        return recurrent_states


def linear_layers(decoder: nn.Module) -> set[int]:
    """Indices of the decoder's linear-attention layers (Qwen3.5's Gated DeltaNet), from its config."""
    return {i for i, kind in enumerate(getattr(decoder.config, "layer_types", None) or ()) if kind == "linear_attention"}


def recording_cache(decoder: nn.Module) -> Cache:
    """A cache whose layers keep what the one forward they see (a prompt's) leaves for the next
    tokens: K/V of attention layers, the convolution and recurrent state of linear-attention ones."""
    linear = linear_layers(decoder)
    return Cache(layers=[_RecordingStateLayer() if i in linear else _RecordingLayer() for i in range(len(decoder.layers))])


def prefix_cache(recorded: Cache, group: int | None, prompt_of_row: torch.Tensor) -> Cache:
    """The completion forward's cache: every row reads its prompt's recorded K/V or state. A layer
    that recorded nothing (Gemma 4's KV-shared layers read an earlier layer's K/V, which that
    layer's update returns whole) stays empty."""

    def layer_of(layer):
        if isinstance(layer, _RecordingStateLayer):
            return _PrefixStateLayer(layer.conv_states[0], layer.recurrent_states[0], prompt_of_row)
        if not layer.is_initialized:
            return DynamicLayer()
        return _PrefixLayer(layer.keys, layer.values, group, prompt_of_row)

    return Cache(layers=[layer_of(layer) for layer in recorded.layers])


# ---------------------------------------------------------------------------------------------
# Model parts and positions
# ---------------------------------------------------------------------------------------------


def model_parts(model: nn.Module, template) -> tuple[nn.Module, nn.Module]:
    """(backbone, text decoder) of `model` at the template's component paths."""
    return model.get_submodule(template.components["backbone"]), model.get_submodule(template.components["llm"])


@contextmanager
def _cache_through_checkpointing(decoder: nn.Module):
    """Let decoder layers keep their cache under gradient checkpointing.

    transformers drops `past_key_values` inside a checkpointed layer, because a cache that
    appends would be appended to twice by the backward replay. Both cache layers here are
    idempotent, so the replay is harmless: allow it on these layer instances for one call.
    """
    layers = [m for m in decoder.modules() if getattr(m, "gradient_checkpointing", False)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True  # instance attribute, shadows the class default
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def _checkpointing_reentrant(decoder: nn.Module) -> bool:
    """True if some decoder layer uses reentrant checkpointing (its forward runs without grad,
    so K/V recorded inside it would carry no gradient)."""
    for module in decoder.modules():
        if getattr(module, "gradient_checkpointing", False):
            func = getattr(module, "_gradient_checkpointing_func", None)
            if getattr(func, "keywords", {}).get("use_reentrant", True) is not False:
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Support check
# ---------------------------------------------------------------------------------------------


def supports_shared_prefix(model: nn.Module, template) -> tuple[bool, str]:
    """(True, "") if the shared-prefix forward and rollout are exact for this model, else
    (False, reason): the caller then runs the naive path and prints the reason once.

    The template says whether its family allows it at all and where the parts are; the model's
    configuration is then checked for attention this module handles (full; sliding-window where
    the template declares such layers).
    """
    if not template.shared_prefix:
        return False, f"template {template.name!r} does not declare shared_prefix"
    try:
        _, decoder = model_parts(model, template)
    except AttributeError as error:
        return False, f"template {template.name!r}: {error}"
    if not hasattr(decoder, "layers"):
        return False, f"{template.components['llm']} ({type(decoder).__name__}) has no decoder layers"
    text_config = decoder.config
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    handled = {"full_attention"}
    handled |= {"sliding_attention"} if template.sliding_window_layers else set()
    handled |= {"linear_attention"} if template.linear_attention_layers else set()
    sliding = getattr(text_config, "use_sliding_window", False)
    if not layer_types <= handled or (sliding and not template.sliding_window_layers):
        shared = " and ".join(sorted(handled))
        return False, f"layer types {sorted(layer_types)}: template {template.name!r} shares only {shared} layers"
    bidirectional = getattr(text_config, "use_bidirectional_attention", False)
    if bidirectional and bidirectional != "vision":  # "vision": within a prompt's image blocks only (Gemma 4)
        return False, "bidirectional text attention (use_bidirectional_attention) cannot decode from a prefix"
    attention = text_config._attn_implementation
    if attention not in SUPPORTED_ATTENTION:
        return False, f"attention implementation {attention!r} is not one of {', '.join(SUPPORTED_ATTENTION)}"
    if _checkpointing_reentrant(decoder):
        return (
            False,
            "reentrant gradient checkpointing would cut the gradient through the shared K/V; use use_reentrant=False",
        )
    return True, ""


# ---------------------------------------------------------------------------------------------
# The shared-prefix forward
# ---------------------------------------------------------------------------------------------


def rows_of_prompts(num_prompts: int, num_rows: int, num_generations: int | list[int], device) -> tuple:
    """(G where every prompt has G rows else None, the prompt of each row [N]) for rows that are
    contiguous per prompt and in prompt order."""
    counts = [num_generations] * num_prompts if isinstance(num_generations, int) else list(num_generations)
    if len(counts) != num_prompts or sum(counts) != num_rows:
        raise ValueError(
            f"{num_rows} completion rows do not match {num_prompts} prompts x {num_generations} rows"
        )
    group = counts[0] if len(set(counts)) == 1 else None
    prompt_of_row = torch.repeat_interleave(torch.arange(num_prompts, device=device), torch.tensor(counts, device=device))
    return group, prompt_of_row


def shared_prefix_hidden(
    model: nn.Module,
    template,
    prompt_inputs: dict,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    num_generations: int | list[int],
) -> torch.Tensor:
    """Final hidden states that predict each completion token, with each prompt run once.

    Args:
        model: the HF model (its backbone and decoder are found at the template's component paths).
        template: the family's template (components, positions).
        prompt_inputs: the collated, left-padded batch of B prompts (input_ids, attention_mask and
            the family's media: pixel_values, image_grid_thw, input_features, token_type_ids ...
            as `template.collate` gives).
        completion_ids, completion_mask: [N, T], the rows of prompt b contiguous and in prompt
            order; right-padded (mask 1 up to and including EOS).
        num_generations: G (N = B * G), or the number of rows of each prompt (a list of B
            counts summing to N), e.g. for a micro-batch that splits groups.

    Returns:
        hidden [N, T, H]: hidden[:, t] predicts completion_ids[:, t] (hidden[:, 0] is the prompt's
        last state). Equal to slicing the naive forward over prompt + completion.
    """
    core, decoder = model_parts(model, template)
    if _checkpointing_reentrant(decoder):
        raise ValueError(
            "shared_prefix_hidden needs non-reentrant gradient checkpointing (use_reentrant=False)"
        )
    length, device = completion_ids.shape[1], completion_ids.device
    group, prompt_of_row = rows_of_prompts(prompt_inputs["input_ids"].shape[0], completion_ids.shape[0], num_generations, device)

    # [3, B, P] and [3, B] (mRoPE) or [B, P] and [B]
    positions, next_position = template.prompt_positions(core, prompt_inputs)
    recorded = recording_cache(decoder)
    prompt_kwargs = {k: v for k, v in prompt_inputs.items() if k != "position_ids"}
    with _cache_through_checkpointing(decoder):
        # use_cache=False: the layers use a cache that is passed in regardless, and checkpointed
        # layers would otherwise warn that they turn use_cache off
        prompt_hidden = core(
            **prompt_kwargs, position_ids=positions, past_key_values=recorded, use_cache=False
        ).last_hidden_state  # [B, P, H]
    # The prompt's last state predicts completion token 0 of every row of its group.
    first = prompt_hidden[:, -1:].index_select(0, prompt_of_row)  # [N, 1, H]

    # Tokens 0 .. T-2 go in; their states predict tokens 1 .. T-1. With T = 1 token 0 still goes
    # in and its state is dropped: every call runs both forwards, so ranks whose sharded weights
    # are gathered inside each layer call (FSDP2, ZeRO-3) make the same collective calls.
    inputs = max(length - 1, 1)
    steps = torch.arange(inputs, device=device)  # [T']
    # [3, N, T'] or [N, T']
    completion_positions = next_position.index_select(-1, prompt_of_row)[..., None] + steps
    prompt_mask = prompt_inputs["attention_mask"][prompt_of_row]  # [N, P]
    attention_mask = torch.cat(
        [prompt_mask, completion_mask[:, :inputs].to(prompt_mask.dtype)], dim=1
    )  # [N, P + T']
    prefix = prefix_cache(recorded, group, prompt_of_row)
    # A completion is text: no media, and (Gemma3) no token_type_ids, which Gemma3Model does
    # not require; its masks then come from the cache's sizes, the sliding window included.
    # fusion modules (mmgrpo/fusion/): row i reads the memory of prompt prompt_of_row[i]
    with _cache_through_checkpointing(decoder), continuing_rows(model, prompt_of_row):
        completion_hidden = core(
            input_ids=completion_ids[:, :inputs],
            attention_mask=attention_mask,
            position_ids=completion_positions,
            past_key_values=prefix,
            use_cache=False,
        ).last_hidden_state  # [N, T', H]
    return torch.cat([first, completion_hidden[:, : length - 1]], dim=1)  # [N, T, H]
