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

    hidden = shared_prefix_hidden(model.model, prompt_batch, completion_ids, completion_mask, G)
    logps, _ = completion_logprobs(hidden, model.lm_head.weight, completion_ids)

Families (``SHARED_PREFIX_FAMILIES``): all eight template families. Each has a *core* (the module
that takes input_ids + media and returns last_hidden_state: Qwen2VLModel, LlavaOnevisionModel,
Gemma3Model, Qwen2Model for text ...), a text decoder inside it (the rollout's decode loop) and
one of two position schemes:

- mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, the Qwen2.5-Omni thinker): the prompt's [3, B, P]
  positions come from the model's own ``get_rope_index``; completion token t sits at
  ``next_position + t``, where ``next_position`` is where the prompt's text positions continue
  (found by appending one text token to the prompt in ``get_rope_index``).
- 1-D RoPE (Qwen2, Qwen2-Audio, LLaVA-OneVision, Gemma3): what `generate` gives a left-padded
  batch, ``attention_mask.cumsum(-1) - 1`` over the real tokens, and next_position = the number
  of real prompt tokens. (The policy's naive forward lets the model count 0..L-1 over the
  padding too: a per-row shift, which RoPE ignores, so the two agree to float rounding.)

Media need nothing else: the prompt forward gets the collated media as the naive forward does
(Qwen2-Audio's clips, LLaVA-OneVision's tiles with `batch_num_images`, Gemma3's
`token_type_ids`, whose image blocks attend both ways within the prompt); a completion is text
and reads only the K/V. Sliding-window layers (Gemma3): the cache layers here report the whole
prompt + completion to transformers' mask builder, which applies the window on those indices
exactly as in the naive forward over prompt + completion.

Where it cannot apply, ``supports_shared_prefix`` says why and the caller runs the naive forward.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from mmgrpo.templates.base import positions_from_mask


@dataclass(frozen=True)
class PrefixFamily:
    """What the shared-prefix paths need to know about one template family's model."""

    # config.model_type of the core: the module without LM head that takes input_ids + media
    model_type: str
    # positions from the core's get_rope_index ([3, B, P]); else 1-D from the attention mask ([B, P])
    mrope: bool
    # the core's text decoder, which runs the rollout's decode steps; None: the core itself
    decoder: str | None = "language_model"
    # sliding-window layers handled (the decoder takes a {layer type: mask} mapping)
    sliding: bool = False

    def text_decoder(self, core: nn.Module) -> nn.Module:
        return getattr(core, self.decoder) if self.decoder else core


# Template name -> family; checked by tests/test_shared_prefix.py.
SHARED_PREFIX_FAMILIES = {
    "qwen2-vl": PrefixFamily("qwen2_vl", mrope=True),
    "qwen2.5-vl": PrefixFamily("qwen2_5_vl", mrope=True),
    "qwen3-vl": PrefixFamily("qwen3_vl", mrope=True),  # deepstack features: at prompt positions only
    "qwen2.5-omni": PrefixFamily("qwen2_5_omni_thinker", mrope=True),  # the thinker; video with sound
    "qwen2": PrefixFamily("qwen2", mrope=False, decoder=None),  # text only: Qwen2Model is core and decoder
    "qwen2-audio": PrefixFamily("qwen2_audio", mrope=False),  # a prompt's clips run once, in its own row
    "llava-onevision": PrefixFamily("llava_onevision", mrope=False),  # batch_num_images stays per prompt
    "gemma3": PrefixFamily("gemma3", mrope=False, sliding=True),  # token_type_ids on the prompt forward only
}
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

    def _prepend(self, prefix: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return torch.cat([prefix.index_select(0, self.prompt_of_row), new], dim=-2)
        batch, heads, _, head_dim = prefix.shape
        shared = prefix[:, None].expand(batch, self.group, *prefix.shape[1:])  # [B, G, kv, P, d], a view
        grouped = new.view(batch, self.group, heads, -1, head_dim)  # [B, G, kv, T, d]
        return torch.cat([shared, grouped], dim=-2).flatten(0, 1)  # [N, kv, P + T, d]

    def update(self, key_states, value_states, *args, **kwargs):
        return self._prepend(self.keys, key_states), self._prepend(self.values, value_states)


def _recording_cache(num_layers: int) -> Cache:
    return Cache(layers=[_RecordingLayer() for _ in range(num_layers)])


# ---------------------------------------------------------------------------------------------
# Model parts and positions
# ---------------------------------------------------------------------------------------------


def find_core(model: nn.Module) -> tuple[nn.Module, PrefixFamily]:
    """The core module of a known family and that family: the first module without an LM head
    whose config.model_type is a family's, found at `model` or under its `.model` chain
    (a ForConditionalGeneration's `.model`, a PEFT wrapper's `.base_model.model.model`)."""
    by_type = {family.model_type: family for family in SHARED_PREFIX_FAMILIES.values()}
    core = model
    for _ in range(5):
        family = by_type.get(getattr(getattr(core, "config", None), "model_type", None))
        if family is not None and not hasattr(core, "lm_head"):
            return core, family
        if not hasattr(core, "model"):
            break
        core = core.model
    raise ValueError(
        f"{type(model).__name__} has no model of type {', '.join(by_type)} without LM head under .model"
    )


def _rope_inputs(inputs: dict) -> dict:
    return {
        k: inputs[k]
        for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
        if inputs.get(k) is not None
    }


def prompt_positions(
    core: nn.Module, family: PrefixFamily, prompt_inputs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of a left-padded prompt batch and where text after it continues.

    Returns positions (what the naive forward gives the prompt tokens) and next_position (the
    position of a first completion token): [3, B, P] and [3, B] for mRoPE, [B, P] and [B] for
    1-D RoPE. A completion token t of prompt b sits at `next_position[..., b] + t` either way.
    """
    input_ids = prompt_inputs["input_ids"]  # [B, P]
    attention_mask = prompt_inputs["attention_mask"]
    if not bool(attention_mask[:, -1].all()):  # the prompt's last state must be its last column
        raise ValueError("the prompt batch must be left-padded (template.collate does this)")
    if not family.mrope:  # as generate and Template.position_ids: 0, 1, ... over the real tokens
        return positions_from_mask(attention_mask), attention_mask.long().sum(-1)  # [B, P], [B]
    # mRoPE: one text column is appended before calling `get_rope_index`, so next_position is
    # right whatever the prompt ends with.
    one = torch.ones_like(input_ids[:, :1])
    input_ids = torch.cat([input_ids, one], dim=1)
    attention_mask = torch.cat([attention_mask, one.to(attention_mask.dtype)], dim=1)
    if core.config.model_type == "qwen2_5_omni_thinker":  # its own signature (audio lengths, sound in video)
        feature_mask = prompt_inputs.get("feature_attention_mask")
        positions, _ = core.get_rope_index(
            input_ids,
            image_grid_thw=prompt_inputs.get("image_grid_thw"),
            video_grid_thw=prompt_inputs.get("video_grid_thw"),
            attention_mask=attention_mask,
            use_audio_in_video=bool(prompt_inputs.get("use_audio_in_video", False)),
            audio_seqlens=feature_mask.sum(-1) if feature_mask is not None else None,
            second_per_grids=prompt_inputs.get("video_second_per_grid"),
        )  # [3, B, P + 1]
        return positions[:, :, :-1], positions[:, :, -1]
    token_types = prompt_inputs.get("mm_token_type_ids")
    if token_types is None:
        token_types = torch.zeros_like(input_ids[:, :-1])
    positions, _ = core.get_rope_index(
        input_ids,
        mm_token_type_ids=torch.cat([token_types, torch.zeros_like(one)], dim=1),
        attention_mask=attention_mask,
        **_rope_inputs(prompt_inputs),
    )  # [3, B, P + 1]
    return positions[:, :, :-1], positions[:, :, -1]


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


def _normalise(name: str) -> str:
    return re.sub(r"[._\-]", "-", name.strip().lower())


def supports_shared_prefix(model: nn.Module, template_or_model_type) -> tuple[bool, str]:
    """(True, "") if the shared-prefix forward and rollout are exact for this model, else
    (False, reason): the caller then runs the naive path and prints the reason once.

    template_or_model_type: a Template (its registered name is used) or a `--model_type` string.
    The family is taken from that explicit name, then the model is checked to be that family
    with attention layers this module handles (full; sliding-window where the family says so).
    """
    name = getattr(template_or_model_type, "name", template_or_model_type)
    key = next((k for k in SHARED_PREFIX_FAMILIES if _normalise(k) == _normalise(str(name))), None)
    if key is None:
        return (
            False,
            f"model type {name!r} has no shared-prefix path (known: {', '.join(SHARED_PREFIX_FAMILIES)})",
        )
    family = SHARED_PREFIX_FAMILIES[key]
    try:
        core, _ = find_core(model)
    except ValueError as error:
        return False, str(error)
    config = core.config
    if config.model_type != family.model_type:
        return False, f"model_type {name!r} but the model's config says {config.model_type!r}"
    text_config = config.get_text_config()
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    handled = {"full_attention", "sliding_attention"} if family.sliding else {"full_attention"}
    sliding = getattr(text_config, "use_sliding_window", False)
    if not layer_types <= handled or (sliding and not family.sliding):
        shared = " and ".join(sorted(handled))
        return False, f"layer types {sorted(layer_types)}: {key} shares only {shared} layers"
    if getattr(text_config, "use_bidirectional_attention", False):
        return False, "bidirectional text attention (use_bidirectional_attention) cannot decode from a prefix"
    attention = text_config._attn_implementation
    if attention not in SUPPORTED_ATTENTION:
        return False, f"attention implementation {attention!r} is not one of {', '.join(SUPPORTED_ATTENTION)}"
    if _checkpointing_reentrant(family.text_decoder(core)):
        return (
            False,
            "reentrant gradient checkpointing would cut the gradient through the shared K/V; use use_reentrant=False",
        )
    return True, ""


# ---------------------------------------------------------------------------------------------
# The shared-prefix forward
# ---------------------------------------------------------------------------------------------


def prompt_rows(rows: slice, num_generations: int) -> tuple[list[int], list[int]]:
    """The prompts that completion rows `rows` belong to (G contiguous rows per prompt) and how
    many of those rows each has: a micro-batch's `num_generations` argument.

    >>> prompt_rows(slice(5, 13), 4)  # rows 5..12 of groups of 4
    ([1, 2, 3], [3, 4, 1])
    """
    first, last = rows.start // num_generations, (rows.stop - 1) // num_generations
    prompts = list(range(first, last + 1))
    counts = [
        min(rows.stop, (p + 1) * num_generations) - max(rows.start, p * num_generations) for p in prompts
    ]
    return prompts, counts


def shared_prefix_hidden(
    backbone: nn.Module,
    prompt_inputs: dict,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    num_generations: int | list[int],
) -> torch.Tensor:
    """Final hidden states that predict each completion token, with each prompt run once.

    Args:
        backbone: the family's core (`model.model`: a Qwen2VLModel, Gemma3Model, Qwen2Model ...);
            a ForConditionalGeneration / ForCausalLM or PEFT wrapper is unwrapped to it.
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
    core, family = find_core(backbone)
    decoder = family.text_decoder(core)
    num_prompts = prompt_inputs["input_ids"].shape[0]
    num_rows, length = completion_ids.shape
    device = completion_ids.device
    counts = [num_generations] * num_prompts if isinstance(num_generations, int) else list(num_generations)
    if len(counts) != num_prompts or sum(counts) != num_rows:
        raise ValueError(
            f"{num_rows} completion rows do not match {num_prompts} prompts x {num_generations} rows"
        )
    if _checkpointing_reentrant(decoder):
        raise ValueError(
            "shared_prefix_hidden needs non-reentrant gradient checkpointing (use_reentrant=False)"
        )
    group = counts[0] if len(set(counts)) == 1 else None
    prompt_of_row = torch.repeat_interleave(
        torch.arange(num_prompts, device=device), torch.tensor(counts, device=device)
    )  # [N]

    # [3, B, P] and [3, B] (mRoPE) or [B, P] and [B]
    positions, next_position = prompt_positions(core, family, prompt_inputs)
    recorded = _recording_cache(core.config.get_text_config().num_hidden_layers)
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
    prefix = Cache(
        layers=[_PrefixLayer(layer.keys, layer.values, group, prompt_of_row) for layer in recorded.layers]
    )
    # A completion is text: no media, and (Gemma3) no token_type_ids, which Gemma3Model does
    # not require; its masks then come from the cache's sizes, the sliding window included.
    with _cache_through_checkpointing(decoder):
        completion_hidden = core(
            input_ids=completion_ids[:, :inputs],
            attention_mask=attention_mask,
            position_ids=completion_positions,
            past_key_values=prefix,
            use_cache=False,
        ).last_hidden_state  # [N, T', H]
    return torch.cat([first, completion_hidden[:, : length - 1]], dim=1)  # [N, T, H]
