"""Multi-turn trajectories in a template's terms: what a tool turn adds to a conversation.

A rollout with tools is prompt -> model turn -> tool turn -> model turn ... Each tool turn is
rendered by the family (`Template.render_tool_turn`) and may carry images, which the family's
media hooks encode exactly as they encode a prompt's. Three things are built from that:

    turn = encode_tool_turn(template, results, images)       # the tool turn's ids and media
    next_prompt = extend_prompt(template, prompt, model_ids, turn)
        # prompt + the model's turn + the tool turn: the prompt of the next model turn (rollout)
    row = with_completion_media(template, prompt, media)
        # the training forward's prompt of one trajectory: the prompt's media, then its tool turns'

The media of a row are its items in the order their placeholder tokens appear (the prompt's
first, then each tool turn's), which is how the model's forward matches features to tokens and
how mRoPE positions are computed over images inside the completion.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from mmgrpo.errors import DataError
from mmgrpo.templates.base import PromptInputs, cat_padded


@dataclass
class ToolTurn:
    """One encoded tool turn: its token ids (placeholders expanded) and its media."""

    ids: torch.Tensor  # [n]
    mm: dict  # media tensors of its images (pixel_values, image_grid_thw ...), no per-token types
    text: str  # rendered, one placeholder per image
    images: list = field(default_factory=list)
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    input_sizes: list[tuple[int, int]] = field(default_factory=list)


def encode_tool_turn(template, results: list[list[dict]], images: list) -> ToolTurn:
    """The text between a model turn and the next (`render_tool_turn`), tokenized, with its images."""
    if images and "image" not in template.media:
        raise DataError(f"a tool returned an image, but template {template.name!r} takes no images")
    text = template.render_tool_turn(results)
    mm, expansions, input_sizes = template.encode_media(SimpleNamespace(images=list(images), videos=[], audios=[]))
    ids = template.tokenize_expanded(text, expansions)
    return ToolTurn(ids, mm, text, list(images), [tuple(image.size) for image in images], input_sizes)


def merge_media(template, first: dict, second: dict) -> dict:
    """Media tensors of one row whose items are `first`'s then `second`'s (per-row counts add up).

    >>> from types import SimpleNamespace
    >>> t = SimpleNamespace(row_keys=())
    >>> merged = merge_media(t, {"image_grid_thw": torch.tensor([[1, 4, 4]])}, {"image_grid_thw": torch.tensor([[1, 2, 2]])})
    >>> merged["image_grid_thw"].tolist()
    [[1, 4, 4], [1, 2, 2]]
    """
    out = dict(first)
    for key, value in second.items():
        if key not in out:
            out[key] = value
        elif key in template.row_keys:
            out[key] = out[key] + value
        else:
            out[key] = cat_padded([out[key], value])
    return out


def extend_prompt(template, prompt: PromptInputs, model_ids: torch.Tensor, turn: ToolTurn) -> PromptInputs:
    """The prompt of the next model turn: `prompt`, the model's turn (as sampled), the tool turn.

    `prompt_text` decodes the model's tokens (an engine that re-tokenizes text may split them
    differently; the ids are exact).
    """
    model_ids = model_ids.to(prompt.prompt_ids.device, torch.long)
    ids = torch.cat([prompt.prompt_ids, model_ids, turn.ids])  # [P + m + n]
    media = {k: v for k, v in prompt.mm.items() if k not in template.token_keys}
    mm = merge_media(template, media, turn.mm)
    for key in template.token_keys:
        parts = [template.token_type_inputs(part).get(key) for part in (model_ids, turn.ids)]
        prompt_types = prompt.mm.get(key, torch.zeros_like(prompt.prompt_ids))
        mm[key] = torch.cat([prompt_types, *parts])
    return dataclasses.replace(
        prompt,
        prompt_ids=ids,
        mm=mm,
        prompt_text=prompt.prompt_text + template.tokenizer.decode(model_ids.tolist()) + turn.text,
        images=[*prompt.images, *turn.images],
        image_sizes=[*prompt.image_sizes, *turn.image_sizes],
        input_sizes=[*prompt.input_sizes, *turn.input_sizes],
    )


def with_completion_media(template, prompt: PromptInputs, media: dict | None) -> PromptInputs:
    """A prompt that also carries the media of its completion's tool turns (after its own), for
    the training forward over prompt + trajectory; the prompt itself if there are none."""
    if not media:
        return prompt
    return dataclasses.replace(prompt, mm=merge_media(template, prompt.mm, media))
