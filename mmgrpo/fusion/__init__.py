"""The fusion-aware policy: modules that let modality features enter the text stream at chosen
depths (`--fusion_module`, `--fusion_layers`), and the probe of how much the policy relies on each
modality (`--fusion_probe_steps`). docs/fusion.md.

    modules.py  the gated cross-attention and co-attention modules, `register_fusion`
    attach.py   inserting them after decoder layers, the hooks that feed them, their checkpoint files
    probe.py    modality reliance and attention shares, measured on a step's completions
"""

from mmgrpo.fusion.attach import (
    FusionSpec,
    attach_fusion,
    bypassed,
    continuing_rows,
    fusion_of,
    prompt_length,
)
from mmgrpo.fusion.modules import (
    CoAttention,
    FusionModule,
    GatedCrossAttention,
    fusion_names,
    get_fusion,
    register_fusion,
)

__all__ = [
    "CoAttention",
    "FusionModule",
    "FusionSpec",
    "GatedCrossAttention",
    "attach_fusion",
    "bypassed",
    "continuing_rows",
    "fusion_names",
    "fusion_of",
    "get_fusion",
    "prompt_length",
    "register_fusion",
]
