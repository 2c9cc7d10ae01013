"""Shapes and colours drawn by the synthetic datasets (mmgrpo/data/synthetic.py, synthetic_av.py)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import PIL.ImageDraw

SHAPES = ("circle", "square", "triangle")
COLOURS = {  # name -> RGB; each drawn colour gets a small per-image jitter
    "red": (215, 35, 35),
    "green": (35, 155, 50),
    "blue": (35, 70, 215),
    "yellow": (235, 205, 30),
    "purple": (135, 45, 170),
    "orange": (245, 135, 25),
}


def jitter(rng: np.random.Generator, rgb: tuple[int, int, int]) -> tuple[int, ...]:
    """`rgb` with each channel moved by up to 15, so no two drawings share an exact colour."""
    return tuple(int(c) for c in np.clip(np.array(rgb) + rng.integers(-15, 16, size=3), 0, 255))


def draw_shape(draw: PIL.ImageDraw.ImageDraw, shape: str, box: tuple, rgb) -> tuple[int, int, int, int]:
    """Draw `shape` filling the square `box` (x1, y1 exclusive); returns the exact pixel box it covers."""
    x0, y0, x1, y1 = box
    mask = PIL.Image.new("L", draw.im.size, 0)
    mask_draw = PIL.ImageDraw.Draw(mask)
    for target, fill in ((draw, rgb), (mask_draw, 255)):
        if shape == "circle":
            target.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif shape == "square":
            target.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
        else:  # an upward triangle
            target.polygon(((x0 + (x1 - 1 - x0) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)), fill=fill)
    return tuple(int(v) for v in mask.getbbox())
