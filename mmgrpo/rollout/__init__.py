"""Rollout engines: B prompts -> B x G completions (mmgrpo/rollout/base.py has the interface).

    engine = build_rollout_engine(policy)             # the one place an engine is chosen
    rollout = engine.generate(prompts, SamplingParams(num_generations=8, max_new_tokens=256))
    engine.update_weights(named_tensors, version)     # after every optimizer step

    hf.py             transformers' generate, on any model
    shared_prefix.py  each prompt prefilled once for its G samples; lean decode steps (lean_decode.py)
    token_sampler.py  the logit filters and the sampler of the in-process engines
    weight_sync.py    the policy's weights as an engine with its own copy receives them
    pipeline.py       when rollouts run: in step, or up to K steps ahead of training (--max_staleness)
    worker.py         the background thread that generates them, weights loaded between rollouts
    rounds.py         the step's batch scored once, then completed: dynamic sampling, two-stage generation
    vllm_*.py         vLLM in the training process (vllm_colocate.py) or as servers (vllm_server.py,
                      vllm_client.py), chosen by --use_vllm --vllm_mode (vllm_engine.py)
    weight_group.py   weights broadcast from trainer rank 0 to every server over a group of their own
    multiturn.py      episodes with tool calls over any of them (--max_turns > 1)

A new engine subclasses `RolloutEngine`, implements `generate` (and `update_weights` where it
holds its own weights) and gets a branch in `build_rollout_engine` (docs/architecture.md). One that
can pause a rollout and continue it on newer weights (--partial_rollouts) sets `can_pause` and
implements `continue_` (the shared-prefix engine does).
"""

from __future__ import annotations

import copy

from mmgrpo.errors import ConfigError
from mmgrpo.rollout.base import Rollout, RolloutEngine, SamplingParams, completion_mask_from_ids
from mmgrpo.rollout.hf import HFRollout
from mmgrpo.rollout.multiturn import MultiTurnRollout
from mmgrpo.rollout.shared_prefix_engine import SharedPrefixRollout, lean_applies
from mmgrpo.tools.environment import ToolEnvironment

__all__ = [
    "HFRollout",
    "MultiTurnRollout",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "SharedPrefixRollout",
    "build_rollout_engine",
    "completion_mask_from_ids",
]


def build_rollout_engine(
    policy, strategy=None, prepared=None, *, gather_for_generation: bool = True, asynchronous: bool = False,
    peft_model=None, vllm=None, max_turns: int = 1, tools: list[str] = (), tool_timeout: float = 10.0,
) -> RolloutEngine:
    """The rollout engine for `policy` (its model and template), decided once.

    strategy, prepared: how a sharded run executes its rollouts (None: one process, plain calls).
    The shared-prefix engine where the policy shares its prefix; on a sharded model only where the
    weights are gathered once for the whole rollout and the decode steps are lean (they call no
    module after the prefill, so a rank whose rows finish may stop: no collective in the loop).
    Elsewhere HF generate, in lockstep across sharded ranks (`synced_gpus`).
    asynchronous: the engine samples from its own copy of the model (LoRA: with the adapters
    merged), which `update_weights` refreshes, so rollouts can run while the policy trains.
    vllm: where --use_vllm, a function (template, strategy) -> the vLLM engine, colocated or as a server
    (its own weights, always): `build_vllm_engine` with the run's options bound.
    max_turns > 1: the chosen engine samples each turn of episodes with `tools` (MultiTurnRollout).
    """
    engine = choose_engine(
        policy, strategy, prepared, gather_for_generation=gather_for_generation, asynchronous=asynchronous,
        peft_model=peft_model, vllm=vllm,
    )
    if max_turns > 1:  # episodes with tools, each turn sampled by the engine chosen above
        engine = MultiTurnRollout(engine, policy.template, ToolEnvironment.from_specs(list(tools), tool_timeout), max_turns)
    return engine


def prefills_once(policy, strategy, gather_for_generation: bool, model=None) -> bool:
    """True if the in-process rollout prefills each prompt once for its G samples (the shared-prefix
    engine): the policy's forwards could share the prefix (under --sequence_parallel_size they run
    split and naive, the rollout does not), on a sharded model only with its weights gathered and
    lean decode steps (ranks may then stop apart)."""
    sharded = strategy is not None and strategy.sharded
    model = model if model is not None else policy.model
    return policy.rollout_shares_prefix and (not sharded or (gather_for_generation and lean_applies(model, policy.template)))


def choose_engine(policy, strategy, prepared, *, gather_for_generation, asynchronous, peft_model, vllm) -> RolloutEngine:
    """The engine that samples one turn (see build_rollout_engine)."""
    model, template = policy.model, policy.template
    if vllm is not None:
        return vllm(template, strategy)
    hooks = {}
    if prepared is not None:
        hooks = dict(call=prepared.rollout_call, scope=prepared.rollout_scope)
    if strategy is not None and strategy.world_size > 1:
        hooks["prepare"] = lambda batch: strategy.align_media(batch, template)  # equal tower calls on all ranks
    sharded = strategy is not None and strategy.sharded
    if asynchronous:
        if sharded:
            raise ConfigError(
                "--async_generate / --max_staleness with --parallel fsdp2 / zero3 needs a rollout engine with its own weights "
                "(--use_vllm); the in-process engines share the sharded model."
            )
        source = copy.deepcopy(peft_model).merge_and_unload() if peft_model is not None else copy.deepcopy(model)
        model = source.eval().requires_grad_(False)
        hooks = {"separate_weights": True}
    if prefills_once(policy, strategy, gather_for_generation, model):
        return SharedPrefixRollout(model, template, **hooks)
    return HFRollout(model, template, synced=sharded and strategy.world_size > 1, **hooks)
