"""The columns a reward function receives beside the completions (the step builds them once)."""

from __future__ import annotations


def reward_columns(samples, encoded, template, G: int, completion_ids=None, completion_mask=None) -> dict[str, list]:
    """Each sample's columns repeated for its G completions, plus what rewards may need:
    `completion_ids` (each completion's own token ids, padding dropped), the sample id, modality,
    and the box mapper."""
    columns: dict[str, list] = {}
    keys = sorted({k for s in samples for k in s.columns})
    for key in keys:
        columns[key] = [s.columns.get(key) for s in samples for _ in range(G)]
    columns["sample_id"] = [s.id for s in samples for _ in range(G)]
    columns["modality"] = [s.modality for s in samples for _ in range(G)]
    # Rewards get boxes in original-image pixels: the template owns the model's convention.
    columns["to_image_box"] = [template.box_mapper(enc) for enc in encoded for _ in range(G)]
    # reward models and the judge: the conversation so far and the decoded images (shared, not copied)
    columns["prompts"] = [s.messages for s in samples for _ in range(G)]
    columns["images"] = [enc.images for enc in encoded for _ in range(G)]
    if completion_ids is not None:  # soft_overlong, cosine: lengths in tokens, as TRL passes them
        columns["completion_ids"] = [ids[mask.bool()].tolist() for ids, mask in zip(completion_ids, completion_mask)]
    return columns
