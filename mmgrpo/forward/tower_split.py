"""The vision towers under sequence parallelism (mmgrpo/forward/sequence_parallel.py): each rank of the
group encodes its share of a row's images, tiles and video frames, and one all-gather gives every rank
the whole row's features.

By frames (templates with `frame_local_tower`: Qwen2-VL to Qwen3.5, the Omni thinkers, GLM-4.1V): the
tower's attention never crosses a frame (windows and full-attention blocks both stop at one, and
positions are per frame), so its inputs are cut at image and frame boundaries into N contiguous runs
of about equal patches; each rank encodes its run, and one all-gather of the merged features (and
Qwen3-VL's deepstack features) gives every rank the whole row's. With fewer images and frames than
ranks, every rank encodes all of them.

By tiles (`tile_local_tower`: InternVL's 448-px tiles, Gemma 3's and 4's images): the tower encodes
each row of pixel_values alone, so each rank encodes a contiguous share of the rows and the outputs
are gathered in order.

Either way the backward sums the group's gradients of each rank's features, so each rank's tower
gradient covers its own share.
"""

from __future__ import annotations

from itertools import accumulate, groupby

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def split_tower(model: nn.Module, template, split) -> nn.Module | None:
    """The template's vision tower with its forward replaced by the split one (an instance attribute:
    `del tower.forward` restores it), or None where the family's tower is not split. split: the
    group's state (`size`, `rank`, `group`)."""
    if not (template.frame_local_tower or template.tile_local_tower):
        return None
    tower = model.get_submodule(template.components["vision"])
    tower.forward = (_shard_frames if template.frame_local_tower else _shard_tiles)(tower, split)
    return tower


class _GatherRows(torch.autograd.Function):
    """Each rank's rows [n_r, D] -> all the group's rows in rank order [sum n_r, D] on every rank. Every
    rank's loss may read every rank's rows, so the backward sums the gradient over the group and keeps
    this rank's rows of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
        ctx.group, ctx.sizes, ctx.rank = group, sizes, dist.get_rank(group)
        padded = F.pad(x, (0, 0, 0, max(sizes) - x.shape[0])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


def tower_runs(grid_thw: torch.Tensor, merge: int, size: int) -> list[tuple[int, int, list[list[int]], int]] | None:
    """The tower's inputs cut into `size` contiguous runs at frame boundaries, about equal in patches:
    per run (first patch row, end row, its grid_thw rows, its merged tokens); None with fewer frames
    (an image is one) than runs.

    >>> [(a, b, grid, n) for a, b, grid, n in tower_runs(torch.tensor([[3, 2, 2], [1, 4, 4]]), 2, 2)]
    [(0, 12, [[3, 2, 2]], 3), (12, 28, [[1, 4, 4]], 4)]
    >>> tower_runs(torch.tensor([[1, 4, 4]]), 2, 2) is None  # one image, two ranks: each encodes it
    True
    """
    shapes = grid_thw.tolist()
    frames = [item for item, (t, _, _) in enumerate(shapes) for _ in range(t)]  # each frame's image or video
    if len(frames) < size:
        return None
    patches = [shapes[item][1] * shapes[item][2] for item in frames]
    starts = [0, *accumulate(patches)]  # starts[i]: frame i's first patch row
    cuts = [0]
    for r in range(1, size):  # run r starts at the first frame whose middle is past r/N of the patches
        middle = sum(start + n / 2 <= starts[-1] * r / size for start, n in zip(starts, patches))
        cuts.append(min(max(middle, cuts[-1] + 1), len(frames) - (size - r)))  # a frame or more in every run
    cuts.append(len(frames))
    runs = []
    for a, b in zip(cuts, cuts[1:]):
        grid = [[len(list(run)), shapes[item][1], shapes[item][2]] for item, run in groupby(frames[a:b])]
        runs.append((starts[a], starts[b], grid, (starts[b] - starts[a]) // merge**2))
    return runs


def _shard_frames(tower: nn.Module, split):
    """`tower.forward` encoding this rank's run of the inputs (`tower_runs`) and gathering the group's
    merged features: an instance attribute, removed by the caller."""
    original = tower.forward
    merge = getattr(tower, "spatial_merge_size", None) or tower.config.spatial_merge_size

    def forward(hidden_states, grid_thw, **kwargs):
        runs = tower_runs(grid_thw, merge, split.size)
        if runs is None:
            return original(hidden_states, grid_thw=grid_thw, **kwargs)
        start, end, rows, _ = runs[split.rank]
        out = original(hidden_states[start:end], grid_thw=torch.tensor(rows, dtype=grid_thw.dtype, device=grid_thw.device),
                       **kwargs)  # fmt: skip
        features = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        gathered = _GatherRows.apply(torch.cat(features, dim=-1), [run[3] for run in runs], split.group)
        parts = list(gathered.split([f.shape[-1] for f in features], dim=-1))
        out.pooler_output = parts[0]
        if len(parts) > 1:
            out.deepstack_features = parts[1:]
        out.last_hidden_state = None  # this rank's patches only: nothing downstream reads it
        return out

    return forward


def _shard_tiles(tower: nn.Module, split):
    """`tower.forward` for a tower that encodes each tile (or image) of pixel_values [tiles, ...] alone
    (`tile_local_tower`): this rank's contiguous share of the tiles, with the same rows of any other
    per-tile input (Gemma 4's pixel_position_ids), then the group's outputs gathered in tile order:
    the last hidden states (per tile, or their rows flattened: Gemma 4 strips each image's padding),
    the per-layer hidden states and pooled outputs where the call returns them. With fewer tiles than
    ranks, every rank encodes all. An instance attribute, removed by the caller."""
    original = tower.forward

    def forward(pixel_values, *args, **kwargs):
        tiles = pixel_values.shape[0]
        if tiles < split.size or args:
            return original(pixel_values, *args, **kwargs)
        share = [tiles // split.size + (r < tiles % split.size) for r in range(split.size)]  # about equal
        mine = slice(sum(share[: split.rank]), sum(share[: split.rank + 1]))
        kwargs = {key: value[mine] if torch.is_tensor(value) and value.dim() and value.shape[0] == tiles else value
                  for key, value in kwargs.items()}  # fmt: skip
        out = original(pixel_values[mine], **kwargs)
        count = torch.tensor([out.last_hidden_state.shape[0]], device=pixel_values.device)
        counts = [torch.empty_like(count) for _ in range(split.size)]
        dist.all_gather(counts, count, group=split.group)  # rows a rank's tiles gave (tiles, or valid tokens)
        sizes = [int(c) for c in counts]

        def gathered(states: torch.Tensor) -> torch.Tensor:  # [rows_r, ...] -> [sum rows_r, ...]
            return _GatherRows.apply(states.flatten(1), sizes, split.group).view(-1, *states.shape[1:])

        out.last_hidden_state = gathered(out.last_hidden_state)
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(states if states is None else gathered(states) for states in out.hidden_states)
        if getattr(out, "pooler_output", None) is not None:
            out.pooler_output = gathered(out.pooler_output)
        return out

    return forward
