"""Grounding rewards: IoU between the first box in the answer and the reference box.

Boxes are `[x1, y1, x2, y2]`. The model writes its box in its own coordinate convention
(0-1000 normalised for Qwen2-VL/Qwen3-VL/InternVL, pixels of the resized input for Qwen2.5-VL);
the template knows which, so the engine passes a `to_image_box` column: one callable per
completion mapping a model box to original-image pixels (None means the box already is in
original pixels). `solution` is in original-image pixels. Rewards never know the model.
"""

from __future__ import annotations

import math
import re

from mmgrpo.data.boxes import BOX_PATTERN, gold_boxes, parse_box, parse_boxes  # noqa: F401  (re-exported)
from mmgrpo.errors import DataError
from mmgrpo.rewards.reward_funcs import register_reward
from mmgrpo.rewards.text import extract_answer

_IMAGE_INDEX = re.compile(r'"image_index"\s*:\s*(\d+)')


def parse_box_on_image(text: str) -> tuple[list[float] | None, int]:
    """The first box in `text` and the image it is on: the `"image_index"` (0-based) of the JSON
    object holding the box, else 0. In a multi-image prompt the box is then mapped with the size
    of that image, not always the first one's.

    >>> parse_box_on_image('[{"bbox_2d": [1, 2, 3, 4], "image_index": 1}]'), parse_box_on_image("[1, 2, 3, 4]")
    (([1.0, 2.0, 3.0, 4.0], 1), ([1.0, 2.0, 3.0, 4.0], 0))
    """
    match = BOX_PATTERN.search(text)
    if match is None:
        return None, 0
    box = [float(n) for n in match.groups() if n is not None]
    start, end = text.rfind("{", 0, match.start()), text.find("}", match.end())
    if start >= 0 and end >= 0 and "}" not in text[start : match.start()]:  # the box is inside this object
        index = _IMAGE_INDEX.search(text[start : end + 1])
        if index:
            return box, int(index.group(1))
    return box, 0


def box_iou(a, b) -> float:
    """Intersection over union of two `[x1, y1, x2, y2]` boxes; 0.0 if either is degenerate
    (x2 <= x1, y2 <= y1, or not finite).

    >>> box_iou([0, 0, 10, 10], [5, 0, 15, 10])  # overlap 50, union 150
    0.3333333333333333
    >>> box_iou([0, 0, 10, 10], [0, 0, 10, 10]), box_iou([0, 0, 10, 10], [10, 10, 0, 0])
    (1.0, 0.0)
    """
    ax1, ay1, ax2, ay2 = (float(v) for v in a)
    bx1, by1, bx2, by2 = (float(v) for v in b)
    if not all(math.isfinite(v) for v in (ax1, ay1, ax2, ay2, bx1, by1, bx2, by2)):
        return 0.0
    if ax2 <= ax1 or ay2 <= ay1 or bx2 <= bx1 or by2 <= by1:
        return 0.0
    inter_w = max(0.0, min(ax2, bx2) - max(ax1, bx1))
    inter_h = max(0.0, min(ay2, by2) - max(ay1, by1))
    inter = inter_w * inter_h
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return inter / union if union > 0 else 0.0


def box_giou(a, b) -> float:
    """Generalized IoU (Rezatofighi et al., 2019): IoU minus the share of the smallest box
    enclosing both that neither covers. In (-1, 1]; unlike IoU it still ranks boxes that do not
    overlap (a far box scores lower than a near one). -1.0 if either box is degenerate.

    >>> box_giou([0, 0, 10, 10], [0, 0, 10, 10])
    1.0
    >>> box_giou([0, 0, 10, 10], [20, 0, 30, 10]), box_giou([0, 0, 10, 10], [40, 0, 50, 10])  # apart: 10, then 30
    (-0.3333333333333333, -0.6)
    """
    ax1, ay1, ax2, ay2 = (float(v) for v in a)
    bx1, by1, bx2, by2 = (float(v) for v in b)
    if not all(math.isfinite(v) for v in (ax1, ay1, ax2, ay2, bx1, by1, bx2, by2)):
        return -1.0
    if ax2 <= ax1 or ay2 <= ay1 or bx2 <= bx1 or by2 <= by1:
        return -1.0
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    enclosing = (max(ax2, bx2) - min(ax1, bx1)) * (max(ay2, by2) - min(ay1, by1))
    return inter / union - (enclosing - union) / enclosing


def _ious(completions: list[str], solution: list, to_image_box, overlap=box_iou, no_box: float = 0.0) -> list[float]:
    """`overlap(answer box, reference)` per completion (the best over several references);
    `no_box` where the answer holds no box."""
    mappers = to_image_box if to_image_box is not None else [None] * len(completions)
    scores = []
    for completion, gold, to_image in zip(completions, solution, mappers, strict=True):
        golds = gold_boxes(gold)
        if not golds:
            raise ValueError(f"the solution {gold!r} holds no [x1, y1, x2, y2] box")
        box, image_index = parse_box_on_image(extract_answer(completion))
        if box is None:
            scores.append(no_box)
            continue
        if to_image is not None:
            try:
                box = [float(v) for v in (to_image(box, image_index) if image_index else to_image(box))]
            except DataError:  # the model named an image the prompt does not have: a miss, not bad data
                scores.append(no_box)
                continue
        scores.append(max(overlap(box, g) for g in golds))
    return scores


@register_reward("iou")
def iou_reward(
    completions: list[str], solution: list, to_image_box: list | None = None, **columns
) -> list[float]:
    """`iou`: continuous IoU of the first box in the answer part with the reference box
    (the best over several references); no box or a degenerate one scores 0.0.

    Qwen2-VL writes boxes in 0-1000 coordinates; here the image is 640 x 480:

    >>> to_pixels = lambda b: [b[0] * 640 / 1000, b[1] * 480 / 1000, b[2] * 640 / 1000, b[3] * 480 / 1000]
    >>> iou_reward(["<answer>[0, 0, 500, 500]</answer>", "<answer>none</answer>"],
    ...            solution=[[0, 0, 320, 120]] * 2, to_image_box=[to_pixels] * 2)
    [0.5, 0.0]
    """
    return _ious(completions, solution, to_image_box)


@register_reward("iou@0.5")
def iou_at_50_reward(completions: list[str], solution: list, to_image_box: list | None = None, **columns):
    """`iou@0.5`: 1.0 if the IoU of the first answer box with the reference is at least 0.5.

    >>> # IoUs 50/100 = 0.5, 20/50 = 0.4, none
    >>> iou_at_50_reward(["[0, 0, 10, 10]", "[0, 0, 10, 2]", "no box"], solution=[[0, 0, 10, 5]] * 3)
    [1.0, 0.0, 0.0]
    """
    return [float(v >= 0.5) for v in _ious(completions, solution, to_image_box)]


@register_reward("giou")
def giou_reward(completions: list[str], solution: list, to_image_box: list | None = None, **columns) -> list[float]:
    """`giou`: generalized IoU of the first answer box with the reference, mapped to [0, 1] as
    (GIoU + 1) / 2; no box or a degenerate one scores 0.0.

    A shaped reward for grounding: where `iou` gives 0.0 to every box that misses the object, and
    so no signal to a group whose G boxes all miss, `giou` still prefers the nearer box; over
    boxes that overlap it orders them almost as IoU does.

    >>> # the reference [0, 0, 10, 10]: exact, overlapping by half, 10 px away, 30 px away, no box
    >>> [round(v, 3) for v in giou_reward(["[0, 0, 10, 10]", "[5, 0, 15, 10]", "[20, 0, 30, 10]",
    ...                                     "[40, 0, 50, 10]", "no box"], solution=[[0, 0, 10, 10]] * 5)]
    [1.0, 0.667, 0.333, 0.2, 0.0]
    """
    return [(g + 1.0) / 2.0 for g in _ious(completions, solution, to_image_box, overlap=box_giou, no_box=-1.0)]


# what these grade: a mixture's rows whose references hold no box are not scored by them (reward_set.task_routes)
iou_reward.grades = iou_at_50_reward.grades = giou_reward.grades = "boxes"
