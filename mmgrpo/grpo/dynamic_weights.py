"""Dynamic modality weights (--dynamic_modality_weights): no modality's advantages dominate the update.

The fixed --modality_weights multiply each completion's advantage by its modality's weight. With
--dynamic_modality_weights the weights follow the training signal instead. The rule, per step:

    s_m  = mean |advantage| over this step's completions of modality m      (its signal per sample)
    e_m <- 0.9 e_m + 0.1 s_m             (an exponential moving average; e_m = s_m the first time m is seen)
    w_m  = clip(mean over the modalities seen so far of e, divided by e_m,  1/4, 4)

A modality whose groups give larger advantages (e.g. an easy task under --scale_rewards none or
batch, or one with fewer all-equal groups) is turned down, one with weaker signal turned up,
towards the same mean |advantage| per completion; the clip keeps a modality with almost no signal
from being scaled without bound. `--dynamic_weights_by dataset` applies the same rule to the
datasets of a mixture (e.g. three image datasets, which share one modality). The weights are
logged every step as weights/<modality or dataset>; they multiply on top of --modality_weights.

    >>> import torch
    >>> rule = DynamicWeights()
    >>> weights, logged = rule(["a", "a", "b", "b"], torch.tensor([2.0, -2.0, 0.5, -0.5]))
    >>> weights.tolist(), logged
    ([0.625, 0.625, 2.5, 2.5], {'weights/a': 0.625, 'weights/b': 2.5})
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MOMENTUM = 0.9
LOWEST, HIGHEST = 0.25, 4.0


@dataclass
class DynamicWeights:
    averages: dict[str, float] = field(default_factory=dict)  # e_m

    def __call__(self, keys: list[str], advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """keys[i]: the modality (or dataset) of completion i. Returns ([N] weights, {"weights/<key>": w})."""
        magnitude = advantages.detach().abs().float().cpu()
        for key in sorted(set(keys)):
            signal = float(magnitude[[k == key for k in keys]].mean())
            old = self.averages.get(key)
            self.averages[key] = signal if old is None else MOMENTUM * old + (1 - MOMENTUM) * signal
        mean = sum(self.averages.values()) / len(self.averages)
        weight = {key: min(HIGHEST, max(LOWEST, mean / e if e > 0 else HIGHEST)) for key, e in self.averages.items()}
        return torch.tensor([weight[k] for k in keys], device=advantages.device), {f"weights/{k}": w for k, w in weight.items()}
