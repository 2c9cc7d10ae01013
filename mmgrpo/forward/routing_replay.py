"""Routing replay for mixture-of-experts policies (R3, "rollout routing replay").

An MoE layer's router sends each token to its top-k experts. The sampler and the trainer compute
that choice separately, and numerics that differ between them (a KV-cached decode step against a
full-sequence forward, another padding width, another kernel or precision) flip the choice where
two experts' probabilities nearly tie. A flipped token runs through other experts, so the trainer's
log-prob of a sampled token is no longer the sampler's, and the importance ratio of an on-policy
step is not 1. Routing replay records the experts each token was sent to while sampling and makes
the trainer's forwards (old, reference, policy) use exactly those; the router's probabilities are
still computed from the current weights, and the k weights are renormalised over the replayed
experts, so the gradient reaches the router through the gate weights of the experts it picked.

    with RoutingRecorder(model) as recorder:                  # the HF rollout's generate
        output = model.generate(**prompt_batch, ...)
    routed = recorder.per_row(prompt_batch["attention_mask"], completion_lengths)  # list of [L_r + n_r, layers, k]

    routing = Routing(routed, replay=True, aux=True)          # one per training forward
    routing.attach(model, prompt_mask, completion_mask)       # Policy's naive forward
    hidden = backbone(**inputs).last_hidden_state
    routing.forward_done()
    loss = ... + coef * routing.aux_loss                      # the load-balancing loss, if asked
    loss.backward()
    routing.detach()                                          # after the backward (checkpointed layers)
    routing.mismatched / routing.total                        # tokens x layers whose own top-k differs

A router here is transformers' top-k router of the Qwen3-MoE line (Qwen3-VL-MoE, Qwen3-MoE):
a module with `top_k`, `num_experts` and a [num_experts, hidden] `weight`, whose forward returns
(logits, top-k weights, top-k indices), softmax then top-k then the k weights renormalised.
"""

from __future__ import annotations

import torch
from torch import nn

NOT_RECORDED = -1  # a position without a recorded route: the router chooses itself


def router_problem(text_config: dict) -> str | None:
    """Why routing replay cannot drive the router a MoE model's text config describes (None: the
    Qwen3-MoE line's softmax top-k router above, which `moe_routers` finds and `Routing` re-weights).

    >>> router_problem({"num_experts": 4, "num_experts_per_tok": 2}) is None  # Qwen3-VL-MoE, Qwen3.5-MoE, Qwen3-Omni
    True
    >>> router_problem({"n_routed_experts": 4, "n_group": 1, "topk_group": 1}).split(":")[0]  # GLM-4.5V
    'a sigmoid router with grouped top-k selection'
    """
    if text_config.get("n_routed_experts"):
        return ("a sigmoid router with grouped top-k selection: sigmoid scores plus a score-correction bias pick the "
                "groups (n_group, topk_group), then the experts; replay re-weights a softmax top-k router's choices")
    if text_config.get("top_k_experts"):
        return ("a router module beside each layer's MLP (norm, scale, projection, softmax top-k, then a per-expert scale) "
                "that routing replay neither finds nor re-weights")
    return None


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of a model's sparse blocks, in layer order (empty for a dense model)."""
    routers = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(getattr(module, "top_k", None), int) and isinstance(getattr(module, "num_experts", None), int)
                and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == module.num_experts):
            routers.append(module)
    return routers


class RoutingRecorder:
    """Records, during `generate`, the top-k experts every router picks for every token it sees:
    the prefill (all prompt positions of every row) and each decode step (one token per row)."""

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]  # per layer: [tokens, k] per call
        self._handles = []

    def __enter__(self) -> RoutingRecorder:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._record(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _record(self, layer: int):
        def hook(module, args, output):
            self.calls[layer].append(output[2].detach().to(torch.int16))  # [tokens, k]; experts < 32768
        return hook

    def per_row(self, prompt_mask: torch.Tensor, completion_lengths: torch.Tensor) -> list[torch.Tensor]:
        """Each row's routes [L_r + n_r, layers, k] (on the CPU): its L_r prompt tokens (left-padded
        in `prompt_mask` [R, P]) then its first n_r completion tokens, n_r = its length (from
        `completion_lengths` [R]) at most the tokens decoding fed back (the last sampled token
        is never fed to the model; its route does not matter to any log-prob)."""
        rows, width = prompt_mask.shape
        per_layer = []
        for calls in self.calls:  # prefill [R * P, k], then decode steps [R, k]
            steps = [call.reshape(rows, -1, call.shape[-1]) for call in calls]
            per_layer.append(torch.cat(steps, dim=1))  # [R, P + steps - 1, k]
        routes = torch.stack(per_layer, dim=2).cpu()  # [R, S, layers, k]
        fed = routes.shape[1] - width  # completion tokens fed back to the model
        mask = prompt_mask.bool().cpu()
        out = []
        for r in range(rows):
            n = min(int(completion_lengths[r]), fed)
            out.append(torch.cat([routes[r, :width][mask[r]], routes[r, width : width + n]]))
        return out


def forward_routes(routed: list[torch.Tensor], prompt_mask: torch.Tensor, num_completion: int) -> torch.Tensor:
    """[R, P + T, layers, k] the recorded routes at the positions of a naive training forward
    (each row's prompt left-padded to P, then its T completion positions), NOT_RECORDED elsewhere.

    >>> routes = [torch.tensor([[[1]], [[2]], [[3]]]), torch.tensor([[[4]], [[5]], [[6]], [[7]]])]  # 1 layer, k = 1
    >>> forward_routes(routes, torch.tensor([[0, 1, 1], [1, 1, 1]]), 2)[..., 0, 0].tolist()  # prompts of 2 and 3
    [[-1, 1, 2, 3, -1], [4, 5, 6, 7, -1]]
    """
    rows, width = prompt_mask.shape
    sample = routed[0]
    out = torch.full((rows, width + num_completion, *sample.shape[1:]), NOT_RECORDED, dtype=torch.long)
    lengths = prompt_mask.sum(1).tolist()
    for r, (route, length) in enumerate(zip(routed, lengths)):
        length = int(length)
        if route.shape[0] < length:
            raise ValueError(f"routing replay: row {r} has routes for {route.shape[0]} tokens, fewer than its "
                             f"{length} prompt tokens: the rollout recorded another prompt")
        out[r, width - length : width] = route[:length]  # the prompt, left-padded
        completion = route[length : length + num_completion]
        out[r, width : width + completion.shape[0]] = completion
    return out


class Routing:
    """The routes of one training forward: replayed (`replay`) or only compared, and the
    load-balancing loss (`aux_loss`, with `aux`). One per forward call of the Policy.

    `attach` hooks the routers; they stay until `detach`, after the backward: gradient
    checkpointing runs each layer's forward again during the backward, and that recompute must
    route as the forward did. `forward_done` ends the counting (a recompute is not counted again).
    """

    def __init__(self, routed: list[torch.Tensor] | None, *, replay: bool, aux: bool = False):
        self.routed, self.replay, self.aux = routed, replay, aux
        self.mismatched = 0  # (token, layer) pairs with a recorded route whose own top-k set differs from it
        self.total = 0  # (token, layer) pairs with a recorded route
        self.aux_loss: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        self._handles: list = []
        self._counting = True

    def attach(self, model: nn.Module, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> None:
        """Hook every router for a naive forward over [R, P + T] tokens (prompts left-padded to P)."""
        self.detach()
        forced = None
        if self.routed is not None:
            forced = forward_routes(self.routed, prompt_mask, completion_mask.shape[1]).to(completion_mask.device)
            forced = forced.flatten(0, 1)  # [R * (P + T), layers, k], the router's token order
        valid = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1).flatten().bool()  # [R * (P + T)]
        self._handles = [router.register_forward_hook(self._hook(layer, forced, valid))
                         for layer, router in enumerate(moe_routers(model))]

    def forward_done(self) -> None:
        """The forward is over: the load-balancing loss is the mean over layers; nothing counts after."""
        self._counting = False
        if self._losses:
            self.aux_loss = torch.stack(self._losses).mean()

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int, forced: torch.Tensor | None, valid: torch.Tensor):
        def hook(module, args, output):
            logits, weights, indices = output  # [tokens, E], [tokens, k], [tokens, k]
            if forced is not None and forced.shape[0] != logits.shape[0]:
                raise ValueError(f"routing replay: the router saw {logits.shape[0]} tokens, the recorded routes cover "
                                 f"{forced.shape[0]}: replay runs on the naive forward only")
            if forced is not None:
                recorded = forced[:, layer]  # [tokens, k]
                known = (recorded[:, 0] != NOT_RECORDED) & valid  # [tokens]; padding routes itself
                if self._counting:
                    own = indices.sort(-1).values != recorded.sort(-1).values
                    self.mismatched += int((own.any(-1) & known).sum())
                    self.total += int(known.sum())
                if self.replay:
                    indices = torch.where(known[:, None], recorded, indices)
                    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [tokens, E], from the current weights
                    weights = probs.gather(1, indices)
                    if getattr(module, "norm_topk_prob", True):  # Qwen3-VL-MoE's router always renormalises
                        weights = weights / weights.sum(-1, keepdim=True)
                    weights = weights.to(logits.dtype)
            if self.aux and self._counting and torch.is_grad_enabled():
                self._losses.append(load_balancing_loss(logits, indices, valid, module.num_experts))
            return logits, weights, indices
        return hook


def load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss of one layer over its `valid` tokens, as
    transformers computes it for these models (so the config's `router_aux_loss_coef` means the
    same here): num_experts x the sum over experts of (share of tokens sent to it) x (its mean
    router probability); k when balanced (k experts per token), up to num_experts x k when one
    expert takes everything. The routes it counts are those the forward used, replayed or its own.

    >>> logits = torch.zeros(4, 2)  # uniform probabilities, k = 1
    >>> float(load_balancing_loss(logits, torch.tensor([[0], [1], [0], [1]]), torch.ones(4, dtype=torch.bool), 2))
    1.0
    """
    probs = torch.softmax(logits.float(), dim=-1)[valid]  # [tokens, E]
    chosen = torch.zeros_like(probs).scatter_(1, indices[valid].long(), 1.0)  # [tokens, E]
    tokens_per_expert = chosen.sum(0) / max(1, probs.shape[0])  # [E] share of the tokens sent to each
    return num_experts * (tokens_per_expert * probs.mean(0)).sum()


def routing_metrics(routings: list[Routing]) -> dict[str, float]:
    """A step's routing metrics over its forwards (none for a dense model, or where nothing was
    recorded): routing/mismatch_fraction, the share of (token, layer) pairs whose router's own top-k
    differs from the sampler's (replayed or not), and routing/aux_loss, the mean load-balancing loss.

    >>> first, second = Routing(None, replay=True), Routing(None, replay=True)
    >>> first.mismatched, first.total, second.mismatched, second.total = 1, 10, 3, 30
    >>> routing_metrics([first, second])
    {'routing/mismatch_fraction': 0.1}
    """
    metrics = {}
    total = sum(r.total for r in routings)
    if total:
        metrics["routing/mismatch_fraction"] = sum(r.mismatched for r in routings) / total
    losses = [float(r.aux_loss.detach()) for r in routings if r.aux_loss is not None]
    if losses:
        metrics["routing/aux_loss"] = sum(losses) / len(losses)
    return metrics
