"""One process (`--parallel none`): plain PyTorch, nothing gathered or reduced."""

from __future__ import annotations

import torch
from torch import nn

from mmgrpo.parallel.base import Prepared, Strategy


class SingleProcess(Strategy):
    name = "none"

    def prepare(self, model: nn.Module, ref_model: nn.Module | None, make_optimizer,
                teacher: nn.Module | None = None) -> Prepared:
        if self.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)
        return Prepared(optimizer=make_optimizer([p for p in model.parameters() if p.requires_grad]))

    def backward(self, loss: torch.Tensor) -> None:
        self.scaled(loss).backward()

    def optimizer_step(self, optimizer, max_grad_norm: float) -> float:
        return self.clip_and_step(optimizer, max_grad_norm)

    def full_state_dict(self, model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        if trainable_only:
            return {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
        return {key: value.detach().cpu() for key, value in model.state_dict().items()}
