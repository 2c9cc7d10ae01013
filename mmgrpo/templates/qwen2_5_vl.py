"""Qwen2.5-VL: Qwen2-VL's chat format and placeholders, with two differences.

- Boxes are absolute pixels of the resized model input ("abs_input"), e.g. `[x1, y1, x2, y2]`
  in a 448x336 input for a 1000x750 photo: rewards get them back in original pixels through
  `box_to_image`.
- Video positions advance with time: the forward needs `second_per_grid_ts` (seconds per
  temporal patch = temporal_patch_size / sampled fps) for each video.

The two registrations share one class body: the differences are two class attributes.
"""

from __future__ import annotations

from mmgrpo.templates.base import register_template
from mmgrpo.templates.qwen2_vl import Qwen2VLTemplate


@register_template("qwen2.5-vl")
class Qwen2_5_VLTemplate(Qwen2VLTemplate):
    """Template of Qwen2.5-VL; same options as Qwen2-VL's."""

    hf_model_types = ("qwen2_5_vl",)  # config.json model_type(s): --model_type is inferred from them

    box_convention = "abs_input"
    seconds_key = "second_per_grid_ts"
