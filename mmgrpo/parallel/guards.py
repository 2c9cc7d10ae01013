"""Steps that must not be applied: a NaN/inf gradient norm skips the optimizer step.

    norm = clip_grad_norm_(params, max_grad_norm)
    step_unless_nonfinite(optimizer, norm)       # in a strategy's optimizer_step: False = skipped
    ...
    if not math.isfinite(grad_norm):              # engine.update_policy: a skip, counted like a NaN loss

A finite loss does not make a finite gradient: one huge advantage (a reward of 1e38) or an
overflow in backward gives an infinite norm; clipping then multiplies every gradient by
max_norm / inf = 0, and inf * 0 = NaN, so an applied step makes every parameter NaN. Skipping
the step keeps the weights; the loop counts the skip with the NaN-loss ones and stops after
--max_nonfinite_steps. (DeepSpeed ZeRO-3 skips such a step itself and reports an infinite norm.)
"""

from __future__ import annotations

import math


def step_unless_nonfinite(optimizer, grad_norm) -> bool:
    """`optimizer.step()` if the gradient norm is finite; the gradients are zeroed either way.

    Returns whether the step was taken. Under FSDP2 the norm is the global one (every rank
    decides alike).

    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([p], lr=1.0)
    >>> p.grad = torch.tensor([float("inf"), 1.0])
    >>> step_unless_nonfinite(opt, torch.linalg.vector_norm(p.grad)), p.tolist(), p.grad
    (False, [1.0, 1.0], None)
    """
    finite = math.isfinite(float(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return finite
