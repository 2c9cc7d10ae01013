"""One process (`--parallel none`): plain PyTorch, nothing gathered or reduced."""

from __future__ import annotations

import torch

from mmgrpo.parallel.base import Strategy


class SingleProcess(Strategy):
    name = "none"

    def wrap(self, policy, make_optimizer):
        return make_optimizer(policy.trainable_parameters())

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer, max_grad_norm: float) -> float:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_state_dict(self, policy, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        if trainable_only:
            return {name: p.detach().cpu() for name, p in policy.model.named_parameters() if p.requires_grad}
        return {key: value.detach().cpu() for key, value in policy.model.state_dict().items()}
