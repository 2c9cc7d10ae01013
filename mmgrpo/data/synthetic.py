"""Synthetic image datasets that a ~1M-parameter model can learn in minutes on a CPU.

Each is generated deterministically (numpy Generator, PIL drawing) on first use into
`$MMGRPO_CACHE/datasets/<name>-<hash>/` (default `~/.cache/mmgrpo/datasets/`), the hash covering
the generator version and its arguments, as `train.jsonl`, `validation.jsonl` and `test.jsonl` +
PNG files under `images/`. The validation split (half the test size unless given) is for choices
made while training, such as when SFT stops (`mmgrpo sft --stop_at`), so the test split stays
unseen until the final evaluation. Generation writes a temporary folder and renames it, so
processes racing to create the same dataset all end up reading one complete copy.

- `shapes-color`: one circle, square or triangle in one of 6 colours; "What is the colour of the
  shape?"; solution: 10 VQAv2-style annotator answers (mostly the colour, a few variations).
- `shapes-count`: 1-6 shapes; "How many shapes are in the image?"; solution: the digit, e.g. "3".
- `shapes-ground`: 2-3 shapes of distinct types; "Give the bounding box of the red circle as
  [x1, y1, x2, y2]."; solution: [x1, y1, x2, y2] in original-image pixels (x2, y2 exclusive).
- `shapes-zoom`, `shapes-zoom-sft`: one small shape in a named cell of a large image, whose colour
  needs the zoom tool (mmgrpo/data/synthetic_zoom.py, docs/tools.md).

The video and audio datasets (`shapes-motion`, `shapes-motion-frames`, `tones-pitch`,
`tones-count`) are made the same way by the generators of mmgrpo/data/synthetic_av.py.

    folder = synthetic_dataset_dir("shapes-color")       # generates once (about a second)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import zlib
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageDraw

from mmgrpo.data import synthetic_av, synthetic_zoom
from mmgrpo.data.drawing import COLOURS, SHAPES
from mmgrpo.data.drawing import draw_shape as _draw_shape
from mmgrpo.data.drawing import jitter as _jitter

GENERATOR_VERSION = 2  # bump when the output of any generator changes: the cache folder changes with it
# What real annotators write besides the colour name (VQAv2 holds 10 answers per question).
ANSWER_VARIANTS = {
    "red": ("dark red", "crimson", "maroon", "pink"),
    "green": ("dark green", "lime", "lime green", "light green"),
    "blue": ("dark blue", "navy", "royal blue", "light blue"),
    "yellow": ("gold", "golden", "light yellow", "orange"),
    "purple": ("violet", "magenta", "dark purple", "lavender"),
    "orange": ("dark orange", "amber", "red", "yellow"),
}


def cache_root() -> Path:
    """Where generated datasets live: $MMGRPO_CACHE/datasets, else ~/.cache/mmgrpo/datasets."""
    if os.environ.get("MMGRPO_CACHE"):
        return Path(os.environ["MMGRPO_CACHE"]).expanduser() / "datasets"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mmgrpo" / "datasets"


def synthetic_dataset_dir(
    name: str,
    *,
    train_size: int = 2000,
    test_size: int = 400,
    validation_size: int | None = None,
    image_size: int = 64,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """The folder of a synthetic dataset, generating it first if it is not in the cache.
    validation_size: rows of the validation split; None: half of test_size."""
    if name not in GENERATORS:
        from mmgrpo.errors import ConfigError

        raise ConfigError(f"unknown synthetic dataset generator {name!r}; known: {', '.join(GENERATORS)}")
    params = {
        "generator": name,
        "version": GENERATOR_VERSION,
        "train_size": train_size,
        "test_size": test_size,
        "validation_size": test_size // 2 if validation_size is None else validation_size,
        "image_size": image_size,
        "seed": seed,
    }
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    folder = root / f"{name}-{digest}"
    if (folder / "info.json").exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    temporary = root / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        generate(
            name, temporary, train_size=train_size, test_size=test_size,
            validation_size=params["validation_size"], image_size=image_size, seed=seed,
        )
        (temporary / "info.json").write_text(json.dumps(params, indent=1, sort_keys=True) + "\n")
        try:
            os.rename(temporary, folder)  # atomic; fails if another process got there first
        except OSError:
            if not (folder / "info.json").exists():
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return folder


def generate(
    name: str,
    out_dir: str | os.PathLike,
    *,
    train_size: int,
    test_size: int,
    validation_size: int = 0,
    image_size: int = 64,
    seed: int = 0,
) -> None:
    """Write `train.jsonl`, `test.jsonl`, `validation.jsonl` and each row's medium into `out_dir`.

    A generator returns (medium, row): a PIL image, written as `images/<split>/<index>.png`, a list
    of them (`<index>_<k>.png`), or a medium of mmgrpo/data/synthetic_av.py, which writes itself
    (`videos/...mp4`, `audios/...wav`).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = (("train", train_size), ("test", test_size), ("validation", validation_size))
    for split_number, (split, size) in enumerate(sizes):
        # One stream per (seed, generator, split): a split's rows do not depend on the other's size.
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), split_number])
        with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as rows:
            for index in range(size):
                medium, row = GENERATORS[name](rng, image_size)
                if isinstance(medium, PIL.Image.Image):
                    relative = f"images/{split}/{index:06d}.png"
                    (out_dir / relative).parent.mkdir(parents=True, exist_ok=True)
                    medium.save(out_dir / relative, format="PNG")
                    row["images"] = [relative]
                elif isinstance(medium, list):
                    row["images"] = [f"images/{split}/{index:06d}_{k}.png" for k in range(len(medium))]
                    (out_dir / "images" / split).mkdir(parents=True, exist_ok=True)
                    for image, relative in zip(medium, row["images"]):
                        image.save(out_dir / relative, format="PNG")
                else:
                    row[medium.column] = [medium.save(out_dir, f"{medium.column}/{split}/{index:06d}")]
                rows.write(json.dumps(row) + "\n")


def _shapes_color(rng: np.random.Generator, size: int) -> tuple[PIL.Image.Image, dict]:
    image, draw = _canvas(rng, size)
    colour, shape = _pick(rng, COLOURS), _pick(rng, SHAPES)
    side = int(rng.integers(int(size * 0.35), int(size * 0.7) + 1))
    x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, size=2))
    _draw_shape(draw, shape, (x0, y0, x0 + side, y0 + side), _jitter(rng, COLOURS[colour]))
    num_variants = int(rng.choice(4, p=[0.35, 0.35, 0.2, 0.1]))  # of 10 answers; the colour always wins
    variants = ANSWER_VARIANTS[colour]
    answers = [colour] * (10 - num_variants) + [
        variants[int(i)] for i in rng.integers(0, len(variants), num_variants)
    ]
    answers = [answers[int(i)] for i in rng.permutation(10)]
    row = {
        "messages": [
            {"role": "user", "content": "<image>What is the colour of the shape?"},
            {"role": "assistant", "content": f"<answer>{colour}</answer>"},
        ],
        "solution": answers,
        "colour": colour,
        "shape": shape,
    }
    return image, row


def _shapes_count(rng: np.random.Generator, size: int) -> tuple[PIL.Image.Image, dict]:
    image, draw = _canvas(rng, size)
    count = int(rng.integers(1, 7))
    boxes = _place_boxes(rng, size, count, low=0.14, high=0.22)
    for box in boxes:
        _draw_shape(draw, _pick(rng, SHAPES), box, _jitter(rng, COLOURS[_pick(rng, COLOURS)]))
    row = {
        "messages": [
            {"role": "user", "content": "<image>How many shapes are in the image?"},
            {"role": "assistant", "content": f"<answer>{len(boxes)}</answer>"},
        ],
        "solution": str(len(boxes)),
    }
    return image, row


def _shapes_ground(rng: np.random.Generator, size: int) -> tuple[PIL.Image.Image, dict]:
    image, draw = _canvas(rng, size)
    count = int(rng.integers(2, len(SHAPES) + 1))
    # distinct types, so "the red circle" names one shape
    shapes = [SHAPES[int(i)] for i in rng.permutation(len(SHAPES))[:count]]
    boxes = _place_boxes(rng, size, count, low=0.2, high=0.38)
    drawn = []
    for shape, box in zip(shapes, boxes):
        colour = _pick(rng, COLOURS)
        drawn.append((shape, colour, _draw_shape(draw, shape, box, _jitter(rng, COLOURS[colour]))))
    shape, colour, bbox = drawn[int(rng.integers(len(drawn)))]
    # No assistant turn: the answer's coordinates depend on the model (0-1000 or resized pixels),
    # which only the template knows (template.box_from_image).
    row = {
        "messages": [
            {
                "role": "user",
                "content": f"<image>Give the bounding box of the {colour} {shape} as [x1, y1, x2, y2].",
            },
        ],
        "solution": list(bbox),
        "colour": colour,
        "shape": shape,
        "image_size": [size, size],
    }
    return image, row


GENERATORS = {"shapes-color": _shapes_color, "shapes-count": _shapes_count, "shapes-ground": _shapes_ground}
GENERATORS.update(synthetic_av.GENERATORS)  # shapes-motion (video), tones-pitch and tones-count (audio)
GENERATORS.update(synthetic_zoom.GENERATORS)  # shapes-zoom: a small shape that needs the zoom tool


def _canvas(rng: np.random.Generator, size: int) -> tuple[PIL.Image.Image, PIL.ImageDraw.ImageDraw]:
    grey = int(rng.integers(200, 256))  # a plain light background
    image = PIL.Image.new("RGB", (size, size), (grey, grey, grey))
    return image, PIL.ImageDraw.Draw(image)


def _pick(rng: np.random.Generator, options):
    options = list(options)
    return options[int(rng.integers(len(options)))]


def _place_boxes(rng: np.random.Generator, size: int, count: int, *, low: float, high: float) -> list[tuple]:
    """Up to `count` square boxes (x0, y0, x1, y1) that do not touch (rejection sampling)."""
    boxes = []
    for _ in range(count * 50):
        if len(boxes) == count:
            break
        side = int(rng.integers(max(4, int(size * low)), max(5, int(size * high)) + 1))
        x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        box = (x0, y0, x0 + side, y0 + side)
        gap = 2
        if all(
            box[2] + gap <= b[0] or b[2] + gap <= box[0] or box[3] + gap <= b[1] or b[3] + gap <= box[1]
            for b in boxes
        ):
            boxes.append(box)
    return boxes
