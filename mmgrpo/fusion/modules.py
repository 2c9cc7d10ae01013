"""Fusion modules: a path by which a sample's modality features enter the text stream after a
decoder layer, and the registry of them (`--fusion_module NAME`).

    >>> import torch
    >>> module = get_fusion("gated_xattn")(hidden_size=16, num_heads=2, layer=0)
    >>> features, feature_mask = torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.bool)  # [B, M, H], [B, M]
    >>> memory = module.prepare(features, feature_mask, text=torch.randn(2, 7, 16), text_mask=torch.ones(2, 7, dtype=torch.bool))
    >>> hidden = torch.randn(2, 3, 16)  # [B, L, H]
    >>> bool((module(hidden, memory, feature_mask) == hidden).all())  # the tanh gate starts at 0
    True

A module has two methods (`FusionModule`):

    prepare(features [B, M, H], feature_mask [B, M], text [B, L, H], text_mask [B, L]) -> memory
        once per prompt, when its prompt runs (the features are the tower's output after the
        projector, i.e. the decoder's input at the prompt's media tokens; `text` the layer's
        output at the prompt's other tokens): e.g. the keys and values of the features.
        A group of G completions reads one prompt's memory: it is computed once per group.
    forward(hidden [B', L', H], memory, memory_mask [B', M]) -> hidden [B', L', H]
        after the layer, for every token that runs, the prompt's own included. Rows of one
        prompt may come folded into one row (B' = B, L' = G x L), so a module must treat each
        position on its own given the memory (cross-attention, position-wise layers); mixing
        positions would also break causal decoding.

`memory` is a dict of tensors whose dim 0 is the prompt. A row whose prompt has no media has an
all-False mask: its update must be zero (the built-in modules attend to a zero "null" slot too).
Each module adds its update through a tanh gate initialised at 0, so a model with fresh modules
computes exactly what the base model does (tests/test_fusion.py checks log-probs equal in fp32).

    register_fusion("my_fusion", MyFusion)          # a class or any factory(hidden_size, num_heads, layer)

docs/fusion.md builds one in a few lines and trains it from the command line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmgrpo.errors import ConfigError
from mmgrpo.registry import Registry

FUSIONS = Registry("fusion module", flag="--fusion_module")
PLUGIN_HINT = "Or register your own with register_fusion in a file given to --fusion_plugin (docs/fusion.md)."


def register_fusion(name: str, factory: Callable[..., nn.Module] | None = None):
    """Register `factory(hidden_size=, num_heads=, layer=) -> FusionModule` as `--fusion_module name`.
    Used as a call or as a class decorator; another factory under a taken name is an error (the same
    one again, as a plugin file imported twice does, is not)."""

    def register(factory: Callable[..., nn.Module]):
        if name in FUSIONS and FUSIONS.get(name) is factory:
            return factory
        return FUSIONS.register(name, factory)

    return register if factory is None else register(factory)


def fusion_names() -> list[str]:
    return FUSIONS.names()


def get_fusion(name: str) -> Callable[..., nn.Module]:
    """The factory registered as `name`; the registries' ConfigError naming the registered ones otherwise."""
    return FUSIONS.get(name, hint=PLUGIN_HINT)


class FusionModule(nn.Module):
    """Base class: `prepare` once per prompt, `forward` after the layer (see the module docstring)."""

    def prepare(self, features, feature_mask, text, text_mask) -> dict[str, torch.Tensor]:
        return {"features": features}

    def forward(self, hidden, memory: dict[str, torch.Tensor], memory_mask) -> torch.Tensor:
        raise NotImplementedError


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, L, H] -> [B, heads, L, H / heads]."""
    batch, length, width = x.shape
    return x.view(batch, length, num_heads, width // num_heads).transpose(1, 2)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """Cross-attention of query [B, heads, L, d] over key/value [B, heads, M, d] where key_mask [B, M]
    is True, plus a zero "null" key and value every query may attend to: a row with no key left
    gets 0, never NaN. Returns [B, L, heads * d]."""
    batch, heads, _, dim = query.shape
    null = key.new_zeros(batch, heads, 1, dim)
    key, value = torch.cat([null, key], dim=2), torch.cat([null, value], dim=2)  # [B, heads, 1 + M, d]
    mask = torch.cat([key_mask.new_ones(batch, 1), key_mask], dim=1).bool()[:, None, None, :]  # [B, 1, 1, 1 + M]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)  # [B, heads, L, d]
    return out.transpose(1, 2).flatten(2)


class GatedCrossAttention(FusionModule):
    """Flamingo's gated cross-attention: text tokens attend to the prompt's modality features,
    the result added through tanh(gate), gate initialised at 0."""

    def __init__(self, hidden_size: int, num_heads: int, layer: int = 0):
        super().__init__()
        if hidden_size % num_heads:
            raise ConfigError(f"fusion module: hidden size {hidden_size} is not divisible by {num_heads} heads.")
        self.num_heads = num_heads
        self.norm, self.memory_norm = nn.LayerNorm(hidden_size), nn.LayerNorm(hidden_size)
        self.query = nn.Linear(hidden_size, hidden_size, bias=False)
        self.key_value = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.gate = nn.Parameter(torch.zeros(1))

    def prepare(self, features, feature_mask, text, text_mask) -> dict[str, torch.Tensor]:
        key, value = self.key_value(self.memory_norm(features)).chunk(2, dim=-1)  # [B, M, H] each
        return {"key": split_heads(key, self.num_heads), "value": split_heads(value, self.num_heads)}

    def forward(self, hidden, memory, memory_mask) -> torch.Tensor:
        query = split_heads(self.query(self.norm(hidden)), self.num_heads)  # [B, heads, L, d]
        attended = attend(query, memory["key"], memory["value"], memory_mask)  # [B, L, H]
        return hidden + torch.tanh(self.gate) * self.out(attended)


class CoAttention(GatedCrossAttention):
    """Co-attention (ViLBERT's two directions): the modality features first attend to the prompt's
    text at this depth (a gated cross-attention of their own, `feature_read`), then the text attends
    to those updated features as in `GatedCrossAttention`. Both gates start at 0. The features read
    the prompt only, never a completion, so they are computed once per prompt and decoding stays causal."""

    def __init__(self, hidden_size: int, num_heads: int, layer: int = 0):
        super().__init__(hidden_size, num_heads, layer)
        self.feature_read = GatedCrossAttention(hidden_size, num_heads, layer)  # features <- the prompt's text

    def prepare(self, features, feature_mask, text, text_mask) -> dict[str, torch.Tensor]:
        text_memory = self.feature_read.prepare(text, text_mask, None, None)
        updated = self.feature_read(features, text_memory, text_mask)  # [B, M, H]
        return super().prepare(updated, feature_mask, text, text_mask)


register_fusion("gated_xattn", GatedCrossAttention)
register_fusion("coattn", CoAttention)
