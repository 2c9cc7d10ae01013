"""The built-in image tool: crop a region of an image and enlarge it ("thinking with images").

    <tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [500, 0, 750, 250]}}</tool_call>

`bbox_2d` is a box [x1, y1, x2, y2] in the model's own box convention (Qwen2-VL, Qwen3-VL:
0-1000 of the image; Qwen2.5-VL: pixels of the resized input; the template converts), about
image `img_idx` (0, the default, is the sample's first image; the images earlier calls returned
follow the sample's, so a crop can be cropped again). `label` (what the model looks for) is
accepted and ignored, as in the DeepEyes / Qwen3-VL cookbook tool of the same name.

The crop is enlarged to the model's pixel budget (the template's `max_pixels`): a region that
would have been a few visual tokens inside the whole image arrives with as many tokens as a whole
image. A region smaller than `MIN_SIDE` pixels is widened around its centre first (a 3-pixel box
says "here", not "only these pixels"), and so is one far thinner than it is wide.
"""

from __future__ import annotations

import math

import PIL.Image

from mmgrpo.tools.tool_funcs import ToolContext, register_tool

MIN_SIDE = 28  # pixels of the original image a crop covers at least, along each side
MAX_ASPECT = 50  # the long side at most this many times the short one (processors refuse extreme ratios)


@register_tool("image_zoom_in_tool")
def image_zoom_in_tool(arguments: dict, context: ToolContext) -> PIL.Image.Image:
    """Crop `bbox_2d` (the model's box convention) of image `img_idx` (default 0), enlarged."""
    box = arguments.get("bbox_2d", arguments.get("bbox"))
    if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
        raise ValueError("bbox_2d must be 4 numbers [x1, y1, x2, y2]")
    index = arguments.get("img_idx", 0)
    if not isinstance(index, int) or not 0 <= index < len(context.images):
        raise ValueError(f"img_idx must be an integer from 0 to {len(context.images) - 1}")
    pixels = context.box_to_image(box, index)
    return zoom(context.images[index], pixels, max_pixels=context.max_pixels)


def zoom(image: PIL.Image.Image, box: list[float], *, max_pixels: int | None = None) -> PIL.Image.Image:
    """`box` (original pixels, clipped to the image) cropped and enlarged to about `max_pixels`.

    >>> image = PIL.Image.new("RGB", (400, 200))
    >>> zoom(image, [100, 50, 150, 100], max_pixels=112 * 112).size   # 50 x 50 -> 112 x 112
    (112, 112)
    >>> zoom(image, [0, 0, 10, 10]).size                              # widened to MIN_SIDE
    (28, 28)
    >>> zoom(image, [500, 0, 600, 50])
    Traceback (most recent call last):
    ...
    ValueError: the box [500, 0, 600, 50] (pixels) lies outside the image (400 x 200)
    """
    width, height = image.size
    x1, y1, x2, y2 = (float(v) for v in box)
    if x1 > x2:
        x1, x2 = x2, x1
    if y1 > y2:
        y1, y2 = y2, y1
    x1, x2 = max(0.0, x1), min(float(width), x2)
    y1, y2 = max(0.0, y1), min(float(height), y2)
    if x2 <= x1 and (x1 >= width or x2 <= 0) or y2 <= y1 and (y1 >= height or y2 <= 0):
        shown = [round(v) for v in box]
        raise ValueError(f"the box {shown} (pixels) lies outside the image ({width} x {height})")
    # widen thin or tiny regions around their centre (the image's own size is the limit)
    long_side = max(x2 - x1, y2 - y1)
    need = max(MIN_SIDE, long_side / MAX_ASPECT)
    x1, x2 = _widen(x1, x2, min(need, width), width)
    y1, y2 = _widen(y1, y2, min(need, height), height)
    crop = image.crop((round(x1), round(y1), round(x2), round(y2)))
    if max_pixels:
        scale = math.sqrt(max_pixels / (crop.width * crop.height))
        if scale > 1:  # enlarge only: a larger crop is shrunk by the model's own processor
            size = (max(1, math.floor(crop.width * scale + 1e-6)), max(1, math.floor(crop.height * scale + 1e-6)))
            crop = crop.resize(size, PIL.Image.Resampling.BICUBIC)
    return crop


def _widen(low: float, high: float, need: float, limit: float) -> tuple[float, float]:
    """[low, high] widened to at least `need` around its centre, shifted to stay in [0, limit]."""
    if high - low >= need:
        return low, high
    centre = (low + high) / 2
    low, high = centre - need / 2, centre + need / 2
    shift = max(0.0, -low) - max(0.0, high - limit)
    return low + shift, high + shift
