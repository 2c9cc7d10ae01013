"""Boxes as datasets and answers write them: `[x1, y1, x2, y2]` in text, in a list, or under a
`bbox_2d` / `bbox` / `box` key. The rewards (mmgrpo/rewards/iou.py), the box-aware augmentation
and the evaluation read them here.
"""

from __future__ import annotations

import re

_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+))"
_SEP = r"\s*,\s*"
# `[x1, y1, x2, y2]` or `(x1, y1, x2, y2)` (JSON such as {"bbox_2d": [...]} contains the former),
# or Qwen2-VL's native point pair `(x1,y1),(x2,y2)`.
BOX_PATTERN = re.compile(
    r"[\[(]\s*" + _SEP.join([_NUM] * 4) + r"\s*[\])]"
    r"|\(\s*" + _NUM + _SEP + _NUM + r"\s*\)\s*,?\s*\(\s*" + _NUM + _SEP + _NUM + r"\s*\)"
)
BOX_KEYS = ("bbox_2d", "bbox", "box")


def parse_boxes(text: str) -> list[list[float]]:
    """Every box in `text`, in order of appearance.

    >>> parse_boxes('[{"bbox_2d": [10, 20, 30.5, 40], "label": "cat"}, {"bbox_2d": [1, 2, 3, 4]}]')
    [[10.0, 20.0, 30.5, 40.0], [1.0, 2.0, 3.0, 4.0]]
    >>> parse_boxes("<|box_start|>(100,200),(300,400)<|box_end|>")
    [[100.0, 200.0, 300.0, 400.0]]
    """
    boxes = []
    for match in BOX_PATTERN.finditer(text):
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
        for key in BOX_KEYS:
            if key in solution:
                return gold_boxes(solution[key])
        raise ValueError(f"a box solution dict needs one of the keys {BOX_KEYS}, got {sorted(solution)}")
    if isinstance(solution, (list, tuple)):
        if len(solution) == 4 and all(isinstance(v, (int, float)) for v in solution):
            return [[float(v) for v in solution]]
        return [box for item in solution for box in gold_boxes(item)]
    raise ValueError(f"a box solution must be [x1, y1, x2, y2], a list of boxes or text; got {solution!r}")
