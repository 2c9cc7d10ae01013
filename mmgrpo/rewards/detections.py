"""Answers holding several boxes: each box with its label, the image it is on, and a score.

    [{"bbox_2d": [10, 20, 50, 60], "label": "cat"}, {"bbox_2d": [5, 5, 9, 9], "label": "dog", "image_index": 1}]

- `bbox_2d` (or `bbox`, `box`): [x1, y1, x2, y2] in the model's convention (the template maps it);
- `label` (or `category`): the class; absent: one class, "object";
- `image_index` (0-based, default 0): which image of a multi-image prompt the box is on;
- `score` (or `confidence`): the ranking for AP; absent: 1.0 (boxes then rank in the order written).

Bare `[x1, y1, x2, y2]` lists (and the other forms `parse_boxes` reads) are boxes on image 0.
The `iou` reward and the `map` metric (mmgrpo/eval/detection.py) read answers this way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mmgrpo.data.boxes import BOX_KEYS, parse_boxes
from mmgrpo.rewards.text import extract_answer

DEFAULT_LABEL = "object"


@dataclass
class Detection:
    box: list[float]  # [x1, y1, x2, y2]
    label: str = DEFAULT_LABEL
    image_index: int = 0
    score: float = 1.0


def _from_item(item) -> Detection | None:
    if isinstance(item, dict):
        box = next((item[key] for key in BOX_KEYS if key in item), None)
        if not (isinstance(box, (list, tuple)) and len(box) == 4):
            return None
        label = item.get("label", item.get("category", DEFAULT_LABEL))
        index = item.get("image_index", 0)
        score = item.get("score", item.get("confidence", 1.0))
        try:
            return Detection([float(v) for v in box], str(label), int(index), float(score))
        except (TypeError, ValueError):
            return None
    if isinstance(item, (list, tuple)) and len(item) == 4 and all(isinstance(v, (int, float)) for v in item):
        return Detection([float(v) for v in item])
    return None


def _json_items(text: str):
    """The JSON objects in `text` (a list of them or one; code fences allowed), or None. Bare box
    lists are left to the box regex, which finds every one of them."""
    text = re.sub(r"^```(?:json)?|```$", "", text.strip()).strip()
    for candidate in (text, text[text.find("[") : text.rfind("]") + 1], text[text.find("{") : text.rfind("}") + 1]):
        try:
            data = json.loads(candidate)
        except (json.JSONDecodeError, ValueError):
            continue
        if isinstance(data, dict):
            return [data]
        if isinstance(data, list) and any(isinstance(item, dict) for item in data):
            return data
    return None


def parse_detections(text: str) -> list[Detection]:
    """Every box of an answer with its label, image and score (see the module docstring).

    >>> [d.box + [d.label, d.image_index] for d in parse_detections('[{"bbox_2d": [1, 2, 3, 4], "label": "a", "image_index": 1}]')]
    [[1.0, 2.0, 3.0, 4.0, 'a', 1]]
    >>> [d.box for d in parse_detections("cats at [1, 2, 3, 4] and (5, 6, 7, 8)")]
    [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
    """
    items = _json_items(text)
    if items is not None:
        found = [d for d in map(_from_item, items) if d is not None]
        if found:
            return found
    return [Detection(box) for box in parse_boxes(text)]


def gold_detections(solution) -> list[Detection]:
    """The reference boxes of a sample: a box, a list of boxes or dicts, or text holding them."""
    if isinstance(solution, str):
        return parse_detections(extract_answer(solution))
    if isinstance(solution, dict):
        solution = [solution]
    item = _from_item(solution)
    if item is not None:
        return [item]
    return [d for d in map(_from_item, solution or []) if d is not None]
