"""The GRPO policy loss and its variants (grpo, bnpo, dr_grpo, dapo, cispo; GSPO ratios).

Per completion token t of completion i (docs/algorithm.md has the full derivation):

    ratio_it = exp(logp_it - old_logp_it)                      importance_sampling_level="token"
    ratio_i  = exp(mean_t(logp_it - old_logp_it))              importance_sampling_level="sequence" (GSPO)
    loss_it  = -min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps_high) * A_i) + beta * kl_it
    kl_it    = exp(ref_it - logp_it) - (ref_it - logp_it) - 1  (k3 estimator of KL(pi || pi_ref))

then ``loss_type`` decides how the [N, T] token losses become one scalar. A loss type is a
surrogate (the per-token term) plus an aggregation, registered with ``register_loss``.

Gradient accumulation: the engine always SUMS the micro-batch losses of one optimizer step and
passes the step totals ``num_items_in_batch`` (completion tokens) and ``num_sequences_in_batch``
(completions) to every call. Then grpo, dr_grpo, dapo and cispo micro-batch losses add up exactly
to the loss of the whole step, and bnpo adds up to the mean of its per-micro-batch losses (bnpo is
defined per micro-batch). Under data parallelism, where gradients are averaged over ranks, pass
the global totals divided by the world size. Left as None, each is the micro-batch's own count.

    >>> import torch
    >>> logps = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    >>> loss, metrics = policy_loss(logps, None, None, torch.tensor([2.0]), torch.ones(1, 3), LossConfig(beta=0.0))
    >>> float(loss)  # on-policy: ratio 1, loss = -A
    -2.0
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from mmgrpo.errors import ConfigError
from mmgrpo.registry import Registry

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: a finite k3 even for a token the policy all but forbids

# surrogate(ratio, logps, advantages, epsilon_low, epsilon_high)
#   -> (per-token loss, mask of tokens clipped low, mask of tokens clipped high)
Surrogate = Callable[[Tensor, Tensor, Tensor, float, float], tuple[Tensor, Tensor, Tensor]]
# aggregate(per_token_loss [N, T], completion_mask [N, T] float, *, max_completion_length,
#           num_items_in_batch, num_sequences_in_batch) -> scalar
Aggregate = Callable[..., Tensor]


def clipped_surrogate(
    ratio: Tensor, logps: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float,
    delta: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic clipped objective, negated: -min(ratio * A, clip(ratio) * A).

    A token is clipped (its gradient is zero) only where clipping makes the objective smaller:
    ratio > 1 + eps_high with A > 0, or ratio < 1 - eps with A < 0.

    Dual clip (`delta`, TRL's name; > 1 + eps_high): the unclipped ratio is capped at delta, so
    for A < 0 a token's loss is at most delta * |A| and a ratio above delta has no gradient (one
    runaway token cannot blow up the update). For A > 0 nothing changes (clip already caps it).

    >>> ratio, adv = torch.tensor([4.0, 4.0, 0.5]), torch.tensor([-1.0, 1.0, -1.0])
    >>> clipped_surrogate(ratio, ratio.log(), adv, 0.2, 0.2)[0].tolist()
    [4.0, -1.2000000476837158, 0.800000011920929]
    >>> clipped_surrogate(ratio, ratio.log(), adv, 0.2, 0.2, delta=3.0)[0].tolist()
    [3.0, -1.2000000476837158, 0.800000011920929]
    """
    clipped_ratio = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    capped_ratio = ratio if delta is None else ratio.clamp(max=delta)
    per_token_loss = -torch.minimum(capped_ratio * advantages, clipped_ratio * advantages)
    clipped_low = (ratio < 1 - epsilon_low) & (advantages < 0)
    if delta is not None:  # dual-clipped tokens lose their gradient too: counted as clipped low (A < 0)
        clipped_low = clipped_low | ((ratio > delta) & (advantages < 0))
    clipped_high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return per_token_loss, clipped_low, clipped_high


def cispo_surrogate(
    ratio: Tensor, logps: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1): -sg(min(ratio, 1 + eps_high)) * A * logp.

    The importance weight is truncated and detached, so every token keeps a gradient (PPO
    clipping drops the gradient of clipped tokens, often the rare "fork" tokens of reasoning).
    Only the upper bound is used, as in the paper's experiments. The loss VALUE is not a
    surrogate of the objective; its gradient is ``sg(w) * A * grad logp``.
    """
    weight = ratio.clamp(max=1 + epsilon_high).detach()
    per_token_loss = -weight * advantages * logps
    clipped_high = (ratio > 1 + epsilon_high).expand_as(per_token_loss)
    return per_token_loss, torch.zeros_like(clipped_high), clipped_high


@dataclass(frozen=True)
class LossType:
    surrogate: Surrogate
    aggregate: Aggregate


LOSSES = Registry("loss type", flag="--loss_type")


def register_loss(name: str, surrogate: Surrogate = clipped_surrogate) -> Callable[[Aggregate], Aggregate]:
    """Register an aggregation (and the per-token surrogate it pairs with) as ``--loss_type name``.

    The decorated function is ``aggregate(per_token_loss [N, T], completion_mask [N, T], *,
    max_completion_length, num_items_in_batch, num_sequences_in_batch) -> scalar``.
    A duplicate name is an error.
    """

    def decorator(aggregate: Aggregate) -> Aggregate:
        LOSSES.register(name, LossType(surrogate, aggregate))
        return aggregate

    return decorator


def loss_names() -> list[str]:
    return LOSSES.names()


def _masked_sum(per_token_loss: Tensor, completion_mask: Tensor) -> Tensor:
    return (per_token_loss * completion_mask).sum()


@register_loss("grpo")
def _grpo(per_token_loss, completion_mask, *, num_sequences_in_batch=None, **_) -> Tensor:
    # Mean over each completion's own tokens, then mean over completions (DeepSeekMath).
    # A token of a short completion weighs more than one of a long completion.
    per_sequence = (per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1)  # [N]
    return per_sequence.sum() / (num_sequences_in_batch or per_token_loss.shape[0])


@register_loss("bnpo")
def _bnpo(per_token_loss, completion_mask, *, num_sequences_in_batch=None, **_) -> Tensor:
    # Token mean over this micro-batch; with accumulation, weighted by the micro-batch's share
    # of completions so equal micro-batches average (as TRL divides by the accumulation steps).
    loss = _masked_sum(per_token_loss, completion_mask) / completion_mask.sum().clamp(min=1)
    if num_sequences_in_batch:
        loss = loss * per_token_loss.shape[0] / num_sequences_in_batch
    return loss


@register_loss("dr_grpo")
def _dr_grpo(
    per_token_loss, completion_mask, *, max_completion_length=None, num_sequences_in_batch=None, **_
):
    # A constant denominator: no length bias at all (Dr. GRPO, Liu et al. 2025).
    if not max_completion_length:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length")
    num_sequences = num_sequences_in_batch or per_token_loss.shape[0]
    return _masked_sum(per_token_loss, completion_mask) / (num_sequences * max_completion_length)


@register_loss("dapo")
def _dapo(per_token_loss, completion_mask, *, num_items_in_batch=None, **_) -> Tensor:
    # Token mean over the whole optimizer step (DAPO): every token weighs the same, whatever
    # the length of its completion or the micro-batch it landed in.
    if num_items_in_batch is None:
        num_tokens = completion_mask.sum().clamp(min=1)
    elif isinstance(num_items_in_batch, Tensor):
        num_tokens = num_items_in_batch.clamp(min=1)
    else:
        num_tokens = max(num_items_in_batch, 1)
    return _masked_sum(per_token_loss, completion_mask) / num_tokens


register_loss("cispo", surrogate=cispo_surrogate)(_dapo)  # MiniMax-M1 normalises over all tokens


def _masked_mean(values: Tensor, completion_mask: Tensor) -> Tensor:
    return ((values * completion_mask).sum() / completion_mask.sum().clamp(min=1)).detach()


@dataclass(frozen=True)
class LossConfig:
    """How a run's loss is computed (its --loss_type, --epsilon, ... flags); one per run.

    The defaults here are plain GRPO (DeepSeekMath); the training defaults (dapo, beta 0.04,
    epsilon_high 0.28) live in ``mmgrpo/config/schema.py``, see docs/algorithm.md.
    """

    loss_type: str = "grpo"  # a registered loss type, see ``loss_names()``
    # clip range [1 - epsilon, 1 + epsilon_high]; epsilon_high None means epsilon (symmetric).
    # For cispo only the upper bound 1 + epsilon_high is used.
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0  # weight of the k3 KL penalty to the reference model; 0 disables it
    max_completion_length: int | None = None  # the constant denominator of dr_grpo
    # "token" (GRPO) or "sequence" (GSPO: one ratio per completion, the geometric mean of its token ratios)
    importance_sampling_level: str = "token"
    # dual clip: the ratio is capped at delta for negative advantages (TRL's `delta`); None: off
    delta: float | None = None

    def __post_init__(self):
        """The options are checked once, when the config is made (not on every micro-batch)."""
        LOSSES.get(self.loss_type)  # an unknown name: the registries' ConfigError
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(
                f"--importance_sampling_level {self.importance_sampling_level!r} is not one of "
                f"{list(IMPORTANCE_SAMPLING_LEVELS)}"
            )
        if self.delta is not None:
            if LOSSES.get(self.loss_type).surrogate is not clipped_surrogate:
                raise ConfigError(f"--delta (dual clip) applies to the clipped PPO surrogate; --loss_type {self.loss_type} "
                                  "has none. Drop --delta.")
            epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
            if not self.delta > 1 + epsilon_high:
                raise ConfigError(f"--delta {self.delta}: the dual clip must be above 1 + --epsilon_high ({1 + epsilon_high}), e.g. 3.")


def policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    config: LossConfig = LossConfig(),
    *,
    num_items_in_batch: int | float | Tensor | None = None,
    num_sequences_in_batch: int | None = None,
    importance_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one (micro-)batch of N completions padded to T tokens, as `config` says.

    Args:
        logps: [N, T] log-probs of the completion tokens under the policy being trained (grad).
        old_logps: [N, T] log-probs under the policy that sampled them (no grad), or None when
            on-policy (num_iterations == 1): ``logps.detach()`` is used, the ratio is 1 and
            its gradient is ``grad logp``.
        ref_logps: [N, T] log-probs under the frozen reference model; may be None when
            ``beta == 0``. Given with ``beta == 0`` the KL is still measured, for logging.
        advantages: [N] one per completion (or [N, T] per token).
        completion_mask: [N, T] 1 for a completion token that counts, 0 for padding (and for
            tokens after EOS, or whole truncated completions if the engine masks them).
        config: the loss type, clip range, KL weight ... (`LossConfig`).
        num_items_in_batch, num_sequences_in_batch: completion tokens and completions in the
            whole optimizer step, for gradient accumulation (see the module docstring).
        importance_weights: [N, T] or [N, 1], no grad: each token's policy term is multiplied by it
            (completions sampled by other weights than the policy's, mmgrpo/grpo/importance.py);
            the KL term is not.

    Returns:
        loss: scalar with grad.
        metrics: detached 0-dim tensors (masked means over the completion tokens): ``kl``,
            ``ratio_mean``, ``clip_ratio/low``, ``clip_ratio/high``, ``clip_ratio/region``
            (fraction of tokens whose gradient clipping removed: low, high, either).
    """
    _check_inputs(logps, ref_logps, advantages, completion_mask, config.beta)
    epsilon_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    loss_spec = LOSSES.get(config.loss_type)

    mask = completion_mask.to(logps.dtype)  # [N, T]
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # [N, 1]
    advantages = advantages.to(logps.dtype)
    ratio = importance_ratio(logps, logps.detach() if old_logps is None else old_logps, completion_mask,
                             config.importance_sampling_level)  # [N, T] or [N, 1]

    if config.delta is not None:  # checked by LossConfig: the clipped surrogate, delta > 1 + epsilon_high
        surrogate = partial(clipped_surrogate, delta=config.delta)
    else:
        surrogate = loss_spec.surrogate
    per_token_loss, clipped_low, clipped_high = surrogate(ratio, logps, advantages, config.epsilon, epsilon_high)
    per_token_loss = per_token_loss.expand_as(logps)  # [N, T]
    if importance_weights is not None:
        per_token_loss = per_token_loss * importance_weights.detach().to(per_token_loss.dtype)

    kl = None
    if ref_logps is not None:
        kl = k3_kl(logps, ref_logps, completion_mask, with_grad=config.beta != 0.0 and torch.is_grad_enabled())  # [N, T]
        if config.beta != 0.0:
            per_token_loss = per_token_loss + config.beta * kl

    loss = loss_spec.aggregate(
        per_token_loss,
        mask,
        max_completion_length=config.max_completion_length,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
    )
    return loss, _loss_metrics(logps, mask, ratio, kl, clipped_low, clipped_high)


def _check_inputs(logps: Tensor, ref_logps: Tensor | None, advantages: Tensor, completion_mask: Tensor, beta: float) -> None:
    """ValueError where the tensors do not fit together (see `policy_loss`)."""
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference model's log-probs)")
    if logps.dim() != 2 or completion_mask.shape != logps.shape:
        raise ValueError(
            f"logps {tuple(logps.shape)} and completion_mask {tuple(completion_mask.shape)} must be [N, T]"
        )
    if advantages.shape[0] != logps.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)} do not match logps {tuple(logps.shape)}")


def importance_ratio(logps: Tensor, old_logps: Tensor, completion_mask: Tensor, level: str = "token") -> Tensor:
    """pi / pi_old of each completion token [N, T] (level "token"), or of each completion [N, 1]:
    the geometric mean of its token ratios (level "sequence", GSPO). Padding gets ratio 1.

    >>> logps, old = torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.25, 0.2]]))
    >>> importance_ratio(logps, old, torch.ones(1, 2)).tolist()
    [[2.0, 1.0]]
    >>> round(importance_ratio(logps, old, torch.ones(1, 2), "sequence").item(), 4)  # sqrt(2)
    1.4142
    """
    # where(), not a product: padding may hold any value (even -inf) and must not reach exp()
    log_ratio = torch.where(completion_mask.bool(), logps - old_logps, 0.0)  # [N, T]
    if level == "sequence":
        mask = completion_mask.to(logps.dtype)
        log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
    return torch.exp(log_ratio)


def k3_kl(logps: Tensor, ref_logps: Tensor, completion_mask: Tensor, with_grad: bool = True) -> Tensor:
    """The k3 estimate of KL(pi || pi_ref) per token [N, T], >= 0 (0 on padding); its log-ratio
    clamped to +-KL_LOG_RATIO_CLAMP so a token the policy all but forbids stays finite. Without
    `with_grad` (beta 0: the KL is only logged) it is computed outside the autograd graph.

    >>> round(k3_kl(torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]])), torch.ones(1, 1)).item(), 4)
    0.1931
    """
    with torch.set_grad_enabled(with_grad):
        ref_log_ratio = torch.where(completion_mask.bool(), ref_logps - logps, 0.0)
        ref_log_ratio = ref_log_ratio.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        return torch.exp(ref_log_ratio) - ref_log_ratio - 1


def _loss_metrics(logps: Tensor, mask: Tensor, ratio: Tensor, kl: Tensor | None, clipped_low: Tensor,
                  clipped_high: Tensor) -> dict[str, Tensor]:
    """The loss's metrics: masked means over the completion tokens, detached (see `policy_loss`)."""
    clipped_low = clipped_low.expand_as(logps).to(mask.dtype)
    clipped_high = clipped_high.expand_as(logps).to(mask.dtype)
    return {
        "kl": _masked_mean(kl, mask) if kl is not None else logps.new_zeros(()),
        "ratio_mean": _masked_mean(ratio.expand_as(logps), mask),
        "clip_ratio/low": _masked_mean(clipped_low, mask),
        "clip_ratio/high": _masked_mean(clipped_high, mask),
        "clip_ratio/region": _masked_mean(torch.maximum(clipped_low, clipped_high), mask),
    }
