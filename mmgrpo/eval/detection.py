"""Detection mAP for answers holding several boxes: COCO-style AP@[.5:.95] and AP50 (pycocotools).

An answer lists boxes as JSON (Qwen-VL style) or as bare `[x1, y1, x2, y2]` lists, parsed by
mmgrpo/rewards/detections.py (label, `image_index`, score):

    [{"bbox_2d": [10, 20, 50, 60], "label": "cat"}, {"bbox_2d": [5, 5, 9, 9], "label": "dog", "image_index": 1}]

A box on image k of a multi-image prompt is mapped to that image's original pixels with THAT
image's size (the template's `to_image_box(box, image_index)`), and matched only against that
image's reference boxes; boxes without labels are one class; without scores they rank as written.

The reference (`solution`) uses the same forms, in original-image pixels. Each completion of each
sample, image by image, is one COCO "image"; `map` and `map50` are pycocotools' `COCOeval` stats
over the whole set (maxDets 100, area "all"); `sample_map` and `sample_map50` are the same computed
on each sample alone (what `mmgrpo compare` pairs).

    >>> gold = [{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]
    >>> values = map_metric([['[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]'], ["no box"]], solution=[gold, gold])
    >>> round(values.corpus["map50"], 3), values.scores["sample_map"]   # COCO's 101-point recall grid: 51/101
    (0.505, [1.0, 0.0])
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import asdict

from mmgrpo.eval.metrics import MetricValues, register_metric
from mmgrpo.rewards.detections import Detection, gold_detections, parse_detections
from mmgrpo.rewards.text import extract_answer


def mapped_detections(completion: str, to_image_box=None) -> list[dict]:
    """The answer's detections with each box mapped to the original pixels of the image it is on.

    A box on an image the prompt does not have stays as written (a false positive)."""
    out = []
    for detection in parse_detections(extract_answer(completion)):
        if to_image_box is not None:
            try:
                detection.box = [float(v) for v in to_image_box(detection.box, detection.image_index)]
            except Exception:  # an image the prompt lacks: no image to map onto, kept as a miss
                pass
        out.append(asdict(detection))
    return out


def coco_map(predictions: list[list[Detection]], references: list[list[Detection]]) -> tuple[float | None, float | None]:
    """(AP@[.5:.95], AP50) of pycocotools' COCOeval; entry i of both lists is one image group.
    None when there is no reference box at all; 0.0 when there are references but no prediction."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    labels = sorted({d.label for group in (*predictions, *references) for d in group})
    category = {label: i + 1 for i, label in enumerate(labels)}
    image_ids: dict[tuple[int, int], int] = {}

    def image_id(group: int, index: int) -> int:
        return image_ids.setdefault((group, index), len(image_ids) + 1)

    annotations = []
    for group, golds in enumerate(references):
        for d in golds:
            x1, y1, x2, y2 = d.box
            w, h = max(0.0, x2 - x1), max(0.0, y2 - y1)
            annotations.append({"id": len(annotations) + 1, "image_id": image_id(group, d.image_index),
                                "category_id": category[d.label], "bbox": [x1, y1, w, h], "area": w * h, "iscrowd": 0})
    if not annotations:
        return None, None
    results = []
    for group, detections in enumerate(predictions):
        for d in detections:
            x1, y1, x2, y2 = d.box
            results.append({"image_id": image_id(group, d.image_index), "category_id": category[d.label],
                            "bbox": [x1, y1, max(0.0, x2 - x1), max(0.0, y2 - y1)], "score": d.score})
    if not results:
        return 0.0, 0.0
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and tables
        gt = COCO()
        gt.dataset = {"images": [{"id": i} for i in image_ids.values()], "annotations": annotations,
                      "categories": [{"id": i, "name": label} for label, i in category.items()]}
        gt.createIndex()
        evaluation = COCOeval(gt, gt.loadRes(results), iouType="bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    # stats are -1 where no category has a reference box at that setting; rounded: a mean of ten
    # thresholds is 0.9999999999999998 where every one is 1
    return round(max(0.0, float(evaluation.stats[0])), 12), round(max(0.0, float(evaluation.stats[1])), 12)


def _predictions(completions, columns) -> list[list[list[Detection]]]:
    """Per sample, per completion: its detections (mapped already when the eval kept them)."""
    kept = columns.get("detections")
    mappers = columns.get("to_image_box")
    out = []
    for i, sample_completions in enumerate(completions):
        if kept is not None and kept[i] is not None:
            out.append([[Detection(**d) for d in per_completion] for per_completion in kept[i]])
        else:
            mapper = mappers[i] if mappers is not None else None
            out.append([[Detection(**d) for d in mapped_detections(c, mapper)] for c in sample_completions])
    return out


def keep_detections(completions: list[str], columns: dict) -> dict:
    """What samples.jsonl keeps for the corpus score: each completion's boxes mapped to original
    pixels (the mapping callables themselves cannot be stored)."""
    return {"detections": [mapped_detections(c, columns.get("to_image_box")) for c in completions]}


@register_metric("map", needs=("solution",), corpus=True, keeps=keep_detections)
def map_metric(completions, solution, **columns):
    """COCO-style detection mAP: `map` (AP@[.5:.95]) and `map50` (AP at IoU 0.5), see the module docstring."""
    predictions = _predictions(completions, columns)
    references = [gold_detections(s) for s in solution]
    per_sample_map, per_sample_50 = [], []
    for sample_predictions, golds in zip(predictions, references):
        ap, ap50 = coco_map(sample_predictions, [golds] * len(sample_predictions))
        per_sample_map.append(ap)
        per_sample_50.append(ap50)
    groups = [p for sample in predictions for p in sample]
    gold_groups = [golds for sample, golds in zip(predictions, references) for _ in sample]
    ap, ap50 = coco_map(groups, gold_groups)
    return MetricValues({"sample_map": per_sample_map, "sample_map50": per_sample_50}, corpus={"map": ap, "map50": ap50})
