"""Group-relative advantages: how much better each completion did than its siblings.

The G completions of one prompt sit in contiguous rows ``g*G .. g*G+G-1`` of every batch
(the engine keeps this invariant; advantages depend on it). For group ``g`` with rewards
``r_1..r_G``:

    A_i = (r_i - mean(r)) / (std + 1e-4)        scale_rewards="group" (default)
    A_i = (r_i - mean(r)) / (std_batch + 1e-4)  scale_rewards="batch"
    A_i =  r_i - mean(r)                        scale_rewards="none"  (Dr. GRPO)

``std`` is the Bessel-corrected (unbiased, divide by G-1) standard deviation, the same as
TRL and ms-swift, so reward curves and advantages can be compared with theirs run for run.

    >>> import torch
    >>> adv, stats = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), num_generations=4)
    >>> [round(a, 3) for a in adv.tolist()]
    [1.5, -0.5, -0.5, -0.5]
    >>> round(float(stats["reward_std"]), 4), float(stats["frac_reward_zero_std"])
    (0.5, 0.0)

RLOO (``--advantage_estimator rloo``) compares each completion with the mean of its G - 1
siblings instead: ``A_i = r_i - (sum(r) - r_i) / (G - 1) = G / (G - 1) * (r_i - mean(r))``, then
the same scaling.

    >>> adv, _ = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), num_generations=4, scale_rewards="none")
    >>> [round(a, 3) for a in adv.tolist()]
    [1.0, -0.333, -0.333, -0.333]

Estimators are registered by name (``register_advantage``) and the training step calls the one
``--advantage_estimator`` names: ``get_advantage(name)(rewards, G, scale_rewards, batch_std=...)``.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from mmgrpo.errors import ConfigError
from mmgrpo.registry import Registry

SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the std, not a clamp: a zero-std group gets advantages of exactly 0

AdvantageFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
ADVANTAGES = Registry("advantage estimator", flag="--advantage_estimator")


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(rewards [N], num_generations, scale_rewards) -> (advantages [N], stats)``.

    A duplicate name is an error, so a plugin cannot silently replace a built-in estimator.
    """
    return ADVANTAGES.register(name)


def get_advantage(name: str) -> AdvantageFn:
    """The advantage estimator registered as ``name`` (``--advantage_estimator``)."""
    return ADVANTAGES.get(name)


@register_advantage("grpo")
def group_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: str = "group", batch_std: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO advantages: reward minus its group's mean, optionally divided by a std.

    Args:
        rewards: [N] fused (weighted-sum) reward per completion, N = num_prompts * G. The
            engine resolves a reward function's ``None`` before this call: a NaN raises
            ValueError (it would spread to every advantage of its group, or of the batch).
        num_generations: G, completions per prompt; at least 2 (one completion has no sibling
            to be compared with).
        scale_rewards: "group" divides by each group's std, "batch" by the std of all N
            rewards (the group mean is still subtracted), "none" does not divide (Dr. GRPO:
            dividing by a small std up-weights near-unanimous groups, a difficulty bias).
        batch_std: for "batch", the std to divide by instead of that of `rewards`: under data
            parallelism, the std of every rank's rewards (`strategy.std_across_ranks`).

    Returns:
        advantages: [N] float32, on the device of ``rewards``, with no grad.
        stats: detached 0-dim tensors, for logging (call ``float()`` once per step):
            ``reward_mean``; ``reward_std``: mean over groups of the group std;
            ``frac_reward_zero_std``: fraction of groups whose G rewards are all equal
            (their advantages are 0 and they teach nothing: the "loss is 0" confusion).

    Under data parallelism pass the rewards of this rank (groups never straddle ranks), and for
    "batch" the global std as `batch_std`, so the result equals one process on the whole batch.
    """
    grouped, group_std = _grouped(rewards, num_generations, scale_rewards)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # [num_prompts, G]
    return _scaled(advantages, rewards, group_std, scale_rewards, batch_std)


@register_advantage("rloo")
def rloo_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: str = "group", batch_std: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """RLOO advantages: reward minus the mean of the group's other G - 1 rewards, then scaled as
    `group_advantages` scales (arguments and returns as there)."""
    grouped, group_std = _grouped(rewards, num_generations, scale_rewards)
    G = num_generations
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (G - 1)  # [num_prompts, G]
    return _scaled(grouped - others_mean, rewards, group_std, scale_rewards, batch_std)


def _grouped(rewards: Tensor, num_generations: int, scale_rewards: str) -> tuple[Tensor, Tensor]:
    """Checked rewards as [num_prompts, G] float32 and each group's unbiased std [num_prompts, 1]."""
    if scale_rewards not in SCALE_REWARDS:
        raise ConfigError(f"--scale_rewards {scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
    if num_generations < 2:
        raise ConfigError(f"--num_generations must be at least 2 for group advantages, got {num_generations}")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be [num_prompts * num_generations]; got shape {tuple(rewards.shape)} "
            f"with num_generations={num_generations}"
        )
    if torch.isnan(rewards).any():
        # an unscorable completion must be resolved by the engine (a number, or dropped with its
        # group): a NaN here would silently poison its group's mean and std
        raise ValueError("rewards contain NaN; the engine must resolve reward functions' None first")
    grouped = rewards.detach().float().view(-1, num_generations)  # [num_prompts, G]
    return grouped, grouped.std(dim=1, keepdim=True)  # unbiased (G - 1)


def _scaled(
    advantages: Tensor, rewards: Tensor, group_std: Tensor, scale_rewards: str, batch_std: Tensor | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Divide [num_prompts, G] advantages as scale_rewards says; flatten; the logging stats."""
    if scale_rewards == "group":
        advantages = advantages / (group_std + STD_EPS)
    elif scale_rewards == "batch":
        advantages = advantages / ((rewards.float().std() if batch_std is None else batch_std) + STD_EPS)
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
    stats = {
        "reward_mean": rewards.float().mean(),
        "reward_std": group_std.mean(),
        "frac_reward_zero_std": zero_std.float().mean(),
    }
    return advantages.reshape(-1), stats
