"""GRPO math: group advantages, the policy loss and its variants, chunked log-probs.

Pure tensor functions with no model, engine or config inside; docs/algorithm.md has the maths.
"""

from mmgrpo.grpo.advantages import get_advantage, group_advantages, register_advantage, rloo_advantages
from mmgrpo.grpo.logprobs import completion_logprobs, naive_completion_logprobs
from mmgrpo.grpo.losses import LossConfig, loss_names, policy_loss, register_loss

__all__ = [
    "LossConfig",
    "completion_logprobs",
    "get_advantage",
    "group_advantages",
    "loss_names",
    "naive_completion_logprobs",
    "policy_loss",
    "register_advantage",
    "register_loss",
    "rloo_advantages",
]
