"""A synthetic task where zooming is needed to answer: one small shape in a large, empty image.

The image (`image_size` pixels square, 448 in the registry) is split into a 4 x 4 grid; one
circle, square or triangle 6-9% of the image's side is drawn somewhere inside one cell, in one
of 6 colours, on an empty light background. The question names the cell ("row 2, column 3") and
asks the colour. Under the recipe's pixel budget (`--max_pixels 12544`: the whole image reaches
the model as 112 x 112, 16 visual tokens) the shape is a blur of 7-10 pixels inside one token
of sixteen; cropped to its cell by `image_zoom_in_tool` (112 x 112 too) it is 27-40 pixels wide,
the only thing in an image of its own.

- `shapes-zoom`: the question only (GRPO). `solution` is the colour; `zoom_box` the cell in
  0-1000 coordinates (the Qwen2-VL / Qwen3-VL convention), `cell` its [row, column].
- `shapes-zoom-sft`: the same images, each row one of three conversations that teach a warm
  start (weights `KIND_WEIGHTS`: 70% are (c)): (a) answer at once, (b) call the tool on the named cell, (c) after the call
  and the tool's answer (the crop as a second image), answer. (a) and (b) share their prompt,
  so the warm-started model calls the tool about half the time; GRPO decides whether that pays.
  The tool call in (b) and (c) writes the box in 0-1000: the warm start fits families with that
  convention (tiny:qwen2-vl); for Qwen2.5-VL write your own rows (docs/tools.md).

    >>> import numpy as np
    >>> image, row = _shapes_zoom(np.random.default_rng(0), 448)
    >>> image.size, row["solution"] in COLOURS, len(row["zoom_box"])
    ((448, 448), True, 4)
"""

from __future__ import annotations

import json

import numpy as np
import PIL.Image
import PIL.ImageDraw

from mmgrpo.data.drawing import COLOURS, SHAPES, draw_shape, jitter

GRID = 4  # cells per side; the question names one
TOOL = "image_zoom_in_tool"
# shapes-zoom-sft's kinds (answer at once, call, answer after the crop): "answer" and "call" share
# their prompt, so their ratio sets how often the warm start calls the tool (half); most rows
# teach reading the colour from the crop, the part the tiny model learns slowest
KIND_WEIGHTS = (0.15, 0.15, 0.7)


def _scene(rng: np.random.Generator, size: int) -> tuple[PIL.Image.Image, dict]:
    """The image and what was drawn: colour, shape, cell [row, column] (1-based), the cell's box."""
    grey = int(rng.integers(215, 246))
    image = PIL.Image.new("RGB", (size, size), (grey, grey, grey))
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    row, column = (int(v) for v in rng.integers(0, GRID, size=2))
    cell = size // GRID
    side = max(4, int(size * rng.uniform(0.06, 0.09)))
    x0 = column * cell + int(rng.integers(2, cell - side - 1))
    y0 = row * cell + int(rng.integers(2, cell - side - 1))
    draw_shape(PIL.ImageDraw.Draw(image), shape, (x0, y0, x0 + side, y0 + side), jitter(rng, COLOURS[colour]))
    box = [column * cell, row * cell, (column + 1) * cell, (row + 1) * cell]
    return image, {"colour": colour, "shape": shape, "cell": [row + 1, column + 1], "box": box}


def question(cell: list[int]) -> str:
    return (f"<image>A small shape lies in row {cell[0]}, column {cell[1]} of a {GRID} x {GRID} grid over the "
            "image. What is its colour?")


def tool_call(zoom_box: list[int]) -> str:
    return "<tool_call>" + json.dumps({"name": TOOL, "arguments": {"bbox_2d": zoom_box}}) + "</tool_call>"


def _normalised(box: list[int], size: int) -> list[int]:
    return [round(v * 1000 / size) for v in box]


def _shapes_zoom(rng: np.random.Generator, size: int) -> tuple[PIL.Image.Image, dict]:
    image, drawn = _scene(rng, size)
    row = {
        "messages": [{"role": "user", "content": question(drawn["cell"])}],
        "solution": drawn["colour"],
        "zoom_box": _normalised(drawn["box"], size),
        "cell": drawn["cell"],
        "shape": drawn["shape"],
    }
    return image, row


def _shapes_zoom_sft(rng: np.random.Generator, size: int) -> tuple[list[PIL.Image.Image], dict]:
    image, drawn = _scene(rng, size)
    zoom_box, answer = _normalised(drawn["box"], size), f"<answer>{drawn['colour']}</answer>"
    messages = [{"role": "user", "content": question(drawn["cell"])}]
    kind = int(rng.choice(3, p=KIND_WEIGHTS))
    images = [image]
    if kind == 0:  # answer at once
        messages.append({"role": "assistant", "content": answer})
    elif kind == 1:  # call the tool
        messages.append({"role": "assistant", "content": tool_call(zoom_box)})
    else:  # the tool answered with the crop: answer from it
        images.append(image.crop(drawn["box"]))  # the processor resizes it as the tool's answer would be
        messages += [
            {"role": "assistant", "content": tool_call(zoom_box)},
            {"role": "tool", "content": "<image>"},
            {"role": "assistant", "content": answer},
        ]
    row = {"messages": messages, "solution": drawn["colour"], "zoom_box": zoom_box, "cell": drawn["cell"],
           "kind": ("answer", "call", "after_call")[kind]}  # fmt: skip
    return images, row


GENERATORS = {"shapes-zoom": _shapes_zoom, "shapes-zoom-sft": _shapes_zoom_sft}
