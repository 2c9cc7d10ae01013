"""One process (`--parallel none`): plain PyTorch, nothing gathered or reduced."""

from __future__ import annotations

import torch
from torch import nn

from mmgrpo.parallel.base import Prepared, Strategy
from mmgrpo.parallel.guards import step_unless_nonfinite


class SingleProcess(Strategy):
    name = "none"

    def prepare(self, model: nn.Module, ref_model: nn.Module | None, make_optimizer) -> Prepared:
        return Prepared(optimizer=make_optimizer([p for p in model.parameters() if p.requires_grad]))

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer, max_grad_norm: float) -> float:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
        step_unless_nonfinite(optimizer, norm)  # a NaN/inf norm: no step (mmgrpo/parallel/guards.py); the norm tells the loop
        return float(norm)

    def full_state_dict(self, model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        if trainable_only:
            return {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
        return {key: value.detach().cpu() for key, value in model.state_dict().items()}
