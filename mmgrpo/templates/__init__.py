"""Chat templates, placeholder expansion and box conventions: one file per model family.

from mmgrpo.templates import get_template
template = get_template("qwen2-vl", processor, max_pixels=28 * 28 * 256)
"""

from mmgrpo.templates import qwen2_5_vl, qwen2_vl  # noqa: F401  (register the families)
from mmgrpo.templates.base import (
    PromptInputs,
    Template,
    get_template,
    known_templates,
    register_template,
)

__all__ = ["PromptInputs", "Template", "get_template", "known_templates", "register_template"]
