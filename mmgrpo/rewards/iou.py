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

from mmgrpo.errors import DataError
from mmgrpo.rewards.registry import register_reward
from mmgrpo.rewards.text import extract_answer

_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+))"
_SEP = r"\s*,\s*"
# `[x1, y1, x2, y2]` or `(x1, y1, x2, y2)` (JSON such as {"bbox_2d": [...]} contains the former),
# or Qwen2-VL's native point pair `(x1,y1),(x2,y2)`.
_BOX = re.compile(
    r"[\[(]\s*" + _SEP.join([_NUM] * 4) + r"\s*[\])]"
    r"|\(\s*" + _NUM + _SEP + _NUM + r"\s*\)\s*,?\s*\(\s*" + _NUM + _SEP + _NUM + r"\s*\)"
)
_BOX_KEYS = ("bbox_2d", "bbox", "box")


def parse_boxes(text: str) -> list[list[float]]:
    """Every box in `text`, in order of appearance.

    >>> parse_boxes('[{"bbox_2d": [10, 20, 30.5, 40], "label": "cat"}, {"bbox_2d": [1, 2, 3, 4]}]')
    [[10.0, 20.0, 30.5, 40.0], [1.0, 2.0, 3.0, 4.0]]
    >>> parse_boxes("<|box_start|>(100,200),(300,400)<|box_end|>")
    [[100.0, 200.0, 300.0, 400.0]]
    """
    boxes = []
    for match in _BOX.finditer(text):
        numbers = [g for g in match.groups() if g is not None]
        boxes.append([float(n) for n in numbers])
    return boxes


def parse_box(text: str) -> list[float] | None:
    """The first box in `text`, or None.

    >>> parse_box("The dog is at [12, 30.5, 200, 180] and the cat at [1, 2, 3, 4].")
    [12.0, 30.5, 200.0, 180.0]
    >>> parse_box("(0.1, 0.2, 0.3, 0.4)"), parse_box("[1, 2, 3]"), parse_box("")
    ([0.1, 0.2, 0.3, 0.4], None, None)
    """
    boxes = parse_boxes(text)
    return boxes[0] if boxes else None


_IMAGE_INDEX = re.compile(r'"image_index"\s*:\s*(\d+)')


def parse_box_on_image(text: str) -> tuple[list[float] | None, int]:
    """The first box in `text` and the image it is on: the `"image_index"` (0-based) of the JSON
    object holding the box, else 0. In a multi-image prompt the box is then mapped with the size
    of that image, not always the first one's.

    >>> parse_box_on_image('[{"bbox_2d": [1, 2, 3, 4], "image_index": 1}]'), parse_box_on_image("[1, 2, 3, 4]")
    (([1.0, 2.0, 3.0, 4.0], 1), ([1.0, 2.0, 3.0, 4.0], 0))
    """
    match = _BOX.search(text)
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


def gold_boxes(solution) -> list[list[float]]:
    """The reference boxes of one sample: a box, a list of boxes, `{"bbox_2d": box}` dicts, or
    text holding boxes (e.g. "<answer>[1, 2, 3, 4]</answer>").

    >>> gold_boxes([1, 2, 3, 4]), gold_boxes([[1, 2, 3, 4], {"bbox": [5, 6, 7, 8]}])
    ([[1.0, 2.0, 3.0, 4.0]], [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    """
    if hasattr(solution, "tolist"):  # a numpy array from a Parquet column
        solution = solution.tolist()
    if isinstance(solution, str):
        return parse_boxes(solution)
    if isinstance(solution, dict):
        for key in _BOX_KEYS:
            if key in solution:
                return gold_boxes(solution[key])
        raise ValueError(f"a box solution dict needs one of the keys {_BOX_KEYS}, got {sorted(solution)}")
    if isinstance(solution, (list, tuple)):
        if len(solution) == 4 and all(isinstance(v, (int, float)) for v in solution):
            return [[float(v) for v in solution]]
        return [box for item in solution for box in gold_boxes(item)]
    raise ValueError(f"a box solution must be [x1, y1, x2, y2], a list of boxes or text; got {solution!r}")


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
