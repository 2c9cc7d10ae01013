"""A blank medium for ranks whose batch lacks a kind of media another rank's batch has.

Sharded weights are gathered by collectives inside each tower call: every rank must call the
vision (audio) tower as often as the others, or the collectives mismatch and hang
(`Strategy.align_media` decides, this module builds the blank input).
"""

from __future__ import annotations

import torch

from mmgrpo.errors import ConfigError


def dummy_medium(template, modality: str) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The processed tensors and token ids of one tiny blank image / video / audio clip."""
    import numpy as np
    import PIL.Image

    if modality == "image":
        item = PIL.Image.new("RGB", (56, 56))
    elif modality == "video":
        from mmgrpo.processors.video import Video

        metadata = {"fps": 2.0, "total_num_frames": 2, "frames_indices": [0, 1], "duration": 1.0}
        item = Video(frames=np.zeros((2, 56, 56, 3), dtype=np.uint8), metadata=metadata)
    else:
        item = np.zeros(template.sampling_rate or 16000, dtype=np.float32)
    tensors, expansions = template.media[modality].process([item])
    ids = expansions[0]
    if isinstance(ids, str):  # families that expand placeholders in text (Gemma3)
        ids = template.tokenizer(ids, add_special_tokens=False)["input_ids"]
    return tensors, list(ids)


def add_dummy_medium(batch: dict, template, modality: str) -> dict:
    """`batch` with one blank medium of `modality` that no token can see.

    Its placeholder tokens go into new left-padding columns of row 0 with attention_mask 0: the
    model runs its vision (audio) tower on it, and masked keys get zero attention weight, so no
    log-prob changes. Only for a batch holding no medium of that kind.
    """
    hook = template.media[modality]
    if hook.row_keys:
        raise ConfigError(f"template {template.name}: a blank {modality} for equal tower calls across ranks is not supported.")
    tensors, ids = dummy_medium(template, modality)
    device = batch["input_ids"].device
    ids = torch.tensor(ids, dtype=torch.long, device=device)  # [k]
    rows, width = batch["input_ids"].shape[0], len(ids)
    out = dict(batch)
    pad = torch.full((rows, width), template.pad_token_id, dtype=torch.long, device=device)  # [B, k]
    pad[0] = ids
    out["input_ids"] = torch.cat([pad, batch["input_ids"]], dim=1)  # [B, k + L]
    out["attention_mask"] = torch.cat([torch.zeros_like(pad), batch["attention_mask"]], dim=1)
    for key, types in template.token_type_inputs(ids).items():  # e.g. mm_token_type_ids
        extra = torch.zeros((rows, width), dtype=torch.long, device=device)
        extra[0] = types
        old = batch.get(key, torch.zeros_like(batch["input_ids"]))
        out[key] = torch.cat([extra, old.to(torch.long)], dim=1)
    for key in (*hook.item_keys, *hook.patch_keys):
        if key in tensors:
            out[key] = tensors[key].to(device)
    return out
