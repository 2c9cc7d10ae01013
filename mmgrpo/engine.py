"""The GRPO training loop, read top to bottom.

    mmgrpo train --model tiny:qwen2-vl --dataset shapes-color \\
        --reward_funcs vqa_accuracy format --num_generations 4 --max_steps 3 --output_dir runs/try

One step, each phase under a named timer logged as time/<phase> (PHASES below; each phase timed
once, on the one `Timers` the loop makes for the step and hands to the rollout pipeline and `grpo_step`):
    data         the next B prompts from the DataLoader workers       (the rollout pipeline, `next_batch`)
    weight_sync  the newest weights loaded into an engine with its own copy (vLLM, asynchronous rollouts)
    rollout      B prompts -> B x G completions (the G of a prompt stay contiguous); async: the wait for them
    reward       every reward function on every completion, weighted sum, written into the Rollout
    resample     --dynamic_sample / --first_stage_generations: more rounds
    plan         the log-prob forwards' micro-batches, their prompts collated once  (`grpo_step` from here)
    old, ref     log-probs under the rollout policy (num_iterations > 1) and the reference (beta > 0)
    teacher      log-probs under --teacher_model (on-policy distillation)
    adv          advantages by --advantage_estimator, modality weights
    probe        every --fusion_probe_steps: modality reliance on a few completions (mmgrpo/eval/reliance.py)
    update       num_iterations x (micro-batches -> loss -> backward) -> clip -> AdamW step
    eval, save                                                                    (the loop)
time/other is the rest of the step's wall time, so the time/* values add up to time/step. Every
step logs the same columns: a phase that did not run is 0, except the OCCASIONAL ones, logged only
on the steps that run them.

The step's batch is one object from the rollout to the update, the `Rollout`
(mmgrpo/rollout/base.py): the completions and their rewards, then the loss mask, old and
reference log-probs, importance weights and advantages the step adds; each micro-batch's rows
come from it in one call, `batch.rows(micro_batch)`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from mmgrpo.config import TrainConfig
from mmgrpo.data.sample import dataset_of
from mmgrpo.errors import ConfigError
from mmgrpo.eval.reliance import probe_step
from mmgrpo.forward.policy import ForwardBatch, autocast
from mmgrpo.forward.routing_replay import Routing, routing_metrics
from mmgrpo.grpo.advantages import get_advantage
from mmgrpo.grpo.batching import (
    MicroBatch,
    fixed_micro_batches,
    pack_micro_batches,
    pad_fraction,
    scatter_rows,
)
from mmgrpo.grpo.dynamic_weights import DynamicWeights
from mmgrpo.grpo.importance import (
    logp_gap_by_group,
    mismatch_by_modality,
    off_policy_sequence_mask,
    sampling_importance_weights,
)
from mmgrpo.grpo.losses import policy_loss
from mmgrpo.rollout.base import Rollout, RolloutSampler, step_seed
from mmgrpo.rollout.pipeline import RolloutPipeline
from mmgrpo.rollout.rounds import RolloutSetup, score
from mmgrpo.rollout.weight_sync import rollout_weights
from mmgrpo.runstate.checkpoint import wait_for_saves
from mmgrpo.runstate.preemption import StopSignals
from mmgrpo.runstate.runlog import NullLogger, RunLogger, console, progress_bar, step_log_lines
from mmgrpo.runstate.state import TrainState, deterministic_kernels, seed_everything
from mmgrpo.training.build import Run, build_run
from mmgrpo.training.no_signal import NoSignalWatch
from mmgrpo.training.optim import group_rates
from mmgrpo.training.output_dir import preflight
from mmgrpo.training.resume import resume_run, save_run
from mmgrpo.training.startup_checks import check_train_flags
from mmgrpo.training.step_records import batch_metrics, completion_records, reward_metrics, staleness_shares

PHASES = ("data", "weight_sync", "rollout", "reward", "resample", "plan", "old", "ref", "teacher", "adv", "probe",
          "update", "eval", "save")  # the table above, in its order
OCCASIONAL = ("resample", "old", "ref", "teacher", "probe")  # logged only on the steps that run them


class Timers:
    """The phase timers of one step (PHASES), one object for the whole step: the loop makes it and
    hands it to the rollout pipeline and to `grpo_step`. `with timers("rollout"): ...` adds the
    block's wall seconds to {"time/rollout": seconds}."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        if name not in PHASES:
            raise ValueError(f"no phase {name!r} in engine.PHASES (the phases the module docstring lists)")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time/{name}"] = self.seconds.get(f"time/{name}", 0.0) + time.perf_counter() - start

    def every_step(self) -> dict[str, float]:
        """The seconds so far, and 0 for each phase logged every step that did not run (the same columns every step)."""
        return {**self.seconds, **{f"time/{p}": 0.0 for p in PHASES if p not in OCCASIONAL and f"time/{p}" not in self.seconds}}


def rollout_sampler(run: Run) -> RolloutSampler:
    """The run's rollout engine, generating under the policy's autocast."""
    return RolloutSampler(run.rollout, run.compute_dtype, run.device, share=run.strategy.share_rollout)


def rollout_setup(run: Run) -> RolloutSetup:
    """What the run's rollouts take of it (the rollout pipeline and the extra rounds), each part typed."""
    return RolloutSetup(options=run.cfg.rollout, seed=run.cfg.seed, sampler=rollout_sampler(run), sampling=run.sampling,
                        rewards=run.rewards, template=run.template, strategy=run.strategy, num_prompts=run.prompts_per_step)


def rollout_pipeline(run: Run, batches) -> RolloutPipeline:
    """The run's rollouts over the prompt stream `batches`: in step, or up to --max_staleness steps ahead."""
    weights = partial(rollout_weights, run.model, run.peft_model, run.strategy)  # what an engine with its own copy loads
    return RolloutPipeline(rollout_setup(run), batches, weights, run.total_steps)


def grpo_step(run: Run, prompts: list, step: int, rollout: Rollout | None = None, *,
              weights_rule: DynamicWeights | None = None, timers: Timers | None = None,
              probe: Callable[..., dict] = probe_step) -> tuple[dict, list[dict]]:
    """One GRPO step on B prompts: their completions `rollout` (generated now if None; scored now
    if not scored yet, mmgrpo/rollout/rounds.py); `weights_rule` for --dynamic_modality_weights.
    timers: the step's (the loop's, which timed its data and rollout already); None: this call's own.
    probe: the --fusion_probe_steps probe, mmgrpo/eval/reliance.py's `probe_step` (a benchmark times it).
    Returns (metrics, completion records for the log)."""
    cfg, G = run.cfg, run.cfg.rollout.num_generations
    timers = Timers() if timers is None else timers
    samples = [sample for sample, _ in prompts]
    encoded = [enc for _, enc in prompts]
    if rollout is None:
        with timers("rollout"):
            rollout = rollout_sampler(run).generate(encoded, run.sampling(prompts))
    if not rollout.scored:
        with timers("reward"):
            score(run.rewards, run.template, prompts, rollout)

    with timers("plan"):
        batch = training_batch(rollout, cfg.rollout.mask_truncated_completions)  # row i: a completion of prompt i // G
        plan = plan_forwards(run, encoded, batch)

    # Completions from another copy of the weights (vLLM, async): their log-probs under the policy,
    # and the importance weights that correct for the sampler (mmgrpo/grpo/importance.py).
    staleness = (step - 1) - batch.versions()  # [N] optimizer steps the policy is past the weights that sampled each row
    correct = (run.rollout.separate_weights and batch.logps is not None
               and (cfg.algo.vllm_importance_sampling_correction or cfg.algo.opsm_delta is not None))
    sampling_metrics, routings = {}, []  # routings: each forward's replayed or compared routes (MoE)
    # on-policy distillation (its teacher in the trainer or on a server): the student's own log-probs are the baseline
    distill = run.policy.teacher_model is not None or run.policy.teacher_server is not None
    if cfg.algo.num_iterations > 1 or correct or distill:
        with timers("old"):
            batch.old_logps = completion_logprobs_of(run, batch, plan, routings=routings)
            if correct:
                batch.importance_weights, sampling_metrics = sampler_correction(cfg, rollout, batch.old_logps, staleness)
    if cfg.algo.beta > 0:
        with timers("ref"):
            batch.ref_logps = completion_logprobs_of(run, batch, plan, reference=True, routings=routings)
    if distill:
        with timers("teacher"):
            batch.teacher_logps = teacher_logprobs(run, encoded, batch, plan)
            sampling_metrics["distill/reverse_kl"] = reverse_kl(batch)

    with timers("adv"):
        batch.advantages, adv_stats, weight_metrics = advantages_of(run, samples, batch, weights_rule)
        if correct:  # off-policy sequence masking reads the advantages; the gap per modality reads the final weights
            sampling_metrics.update(mask_off_policy(cfg, rollout, batch, [s.modality for s in samples for _ in range(G)]))

    rates = {"learning_rate": run.scheduler.get_last_lr()[0],  # the rate this step's updates use
             **group_rates(run.optimizer, run.scheduler)}  # learning_rate/vit ... (--vit_lr, --aligner_lr, --fusion_lr)
    probe_metrics = {}
    if cfg.eval.fusion_probe_steps and step % cfg.eval.fusion_probe_steps == 0:  # before the update: the sampling policy
        with timers("probe"):
            probe_metrics = probe(run.policy, encoded, batch, G, rows=cfg.eval.fusion_probe_rows, strategy=run.strategy,
                                  temperature=cfg.rollout.temperature, dtype=run.compute_dtype)
    with timers("update"):
        loss_metrics = update_policy(run, batch, plan, routings)

    metrics = {
        "step": step,
        **batch_metrics(batch, adv_stats),
        **rates,
        **probe_metrics,  # fusion/reliance/<modality>, fusion/attention/<modality>/<band>
        "pad_fraction": plan.pad_fraction,  # padding tokens / all tokens of the log-prob forwards
        "micro_batches": len(plan),
        # optimizer steps between the weights that sampled and the policy that trains on them (the oldest row's)
        "rollout/staleness": (step - 1) - batch.weight_version,
        **staleness_shares(staleness, cfg.rollout.staleness_bound),
        **sampling_metrics,
        **weight_metrics,
        **loss_metrics,
        **routing_metrics(routings),  # routing/mismatch_fraction, routing/aux_loss (MoE)
        **run.rewards.stats(),  # e.g. judge/unparsed
        **batch.metrics,  # multi-turn: tools/calls_per_completion, tools/turns ...
        **batch.totals,  # multi-turn: tools/errors, tools/seconds
        **reward_metrics(run.rewards.names, batch, samples, G),
        **timers.seconds,
    }
    metrics = run.strategy.all_reduce_metrics(metrics)  # means over ranks (max of *_max and memory, sum of *_per_s)
    return metrics, completion_records(samples, batch, run.rewards.names, G, step, cfg.log_completions)


def training_batch(rollout: Rollout, mask_truncated: bool) -> Rollout:
    """The batch the step trains on: `rollout`'s fields (shared, not copied) with `loss_mask` the
    tokens the loss counts, the model's own, truncated completions' taken out under
    --mask_truncated_completions. The step writes its own tensors into it (old and reference
    log-probs, importance weights, advantages), and the update reads them row for row."""
    loss_mask = rollout.model_mask.clone()  # [N, T]
    if mask_truncated:
        loss_mask[rollout.truncated] = 0
    return dataclasses.replace(rollout, loss_mask=loss_mask)


@dataclass
class ForwardPlan:
    """The log-prob forwards of a step: its micro-batches of completion rows (mmgrpo/grpo/batching.py),
    each with its prompts collated once, for the old, ref and update forwards alike."""

    micro_batches: list[MicroBatch]
    forwards: list[ForwardBatch]  # the prompts of micro_batches[i], collated, media aligned across ranks
    pad_fraction: float  # padding tokens / all tokens of the forwards

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> Iterator[tuple[MicroBatch, ForwardBatch]]:
        return iter(zip(self.micro_batches, self.forwards))


def plan_micro_batches(cfg: TrainConfig, shared_prefix: bool, encoded: list, completion_mask: torch.Tensor):
    """The log-prob forwards' micro-batches (mmgrpo/grpo/batching.py) and their padding fraction."""
    prompt_lengths = [enc.prompt_ids.shape[-1] for enc in encoded]
    completion_lengths = completion_mask.sum(1).tolist()
    G, budget = cfg.rollout.num_generations, cfg.algo.max_tokens_per_microbatch
    if budget:
        micro = pack_micro_batches(prompt_lengths, completion_lengths, G, budget, shared_prefix=shared_prefix)
    else:
        micro = fixed_micro_batches(completion_lengths, G, cfg.optim.per_device_train_batch_size)
    return micro, pad_fraction(micro, prompt_lengths, completion_lengths, shared_prefix=shared_prefix)


def plan_forwards(run: Run, encoded: list, batch: Rollout) -> ForwardPlan:
    """The step's micro-batches and each one's prompts collated once (with the images inside its
    completions, multi-turn), their media aligned so all ranks make the same vision-tower calls."""
    policy = run.policy
    micro, padding = plan_micro_batches(run.cfg, policy.shared_prefix, encoded, batch.completion_mask)
    media = batch.completion_media
    forwards = [policy.forward_batch([encoded[p] for p in mb.prompts], mb.counts,
                                     None if media is None else [media[r] for r in mb.rows]) for mb in micro]
    return ForwardPlan(micro, [run.strategy.align_media(f, run.template) for f in forwards], padding)


def sampler_correction(cfg: TrainConfig, rollout: Rollout, old_logps: torch.Tensor,
                       staleness: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Importance weights [N, T] for completions another copy of the weights sampled, from the
    policy's log-probs `old_logps` and the sampler's; measured over every token the model sampled
    (truncated completions too). With their metrics: sampling/*, and asynchronous, the log-prob gap
    by the steps a row lags (staleness/logp_diff_mean_<k>)."""
    sampler_logps = rollout.logps.to(old_logps.device)  # [N, T]
    weights, stats = sampling_importance_weights(old_logps, sampler_logps, rollout.model_mask, cfg.algo.vllm_importance_sampling_mode,
                                                 cap=cfg.algo.vllm_importance_sampling_cap, floor=cfg.algo.vllm_importance_sampling_floor)
    if not cfg.algo.vllm_importance_sampling_correction:  # measured only (--opsm_delta alone)
        weights = torch.ones_like(weights)
    metrics = {f"sampling/{key}": float(value) for key, value in stats.items()}
    if cfg.rollout.staleness_bound:  # asynchronous: how the gap grows with the steps a row lags
        gaps = logp_gap_by_group(old_logps, sampler_logps, rollout.model_mask, staleness)
        metrics.update({f"staleness/logp_diff_mean_{k}": gap for k, gap in gaps.items()})
    return weights.expand_as(old_logps), metrics  # a sequence mode's [N, 1]: the same weight on every token


def mask_off_policy(cfg: TrainConfig, rollout: Rollout, batch: Rollout, modalities: list[str]) -> dict:
    """After the advantages: --opsm_delta's off-policy sequence mask folded into the batch's importance
    weights, then the rollout-training mismatch of each modality's rows under the final weights
    (mismatch/<modality>/*; mmgrpo/grpo/importance.py). modalities: each row's."""
    sampler_logps = rollout.logps.to(batch.old_logps.device)  # [N, T]
    metrics = {}
    if cfg.algo.opsm_delta is not None:
        keep = off_policy_sequence_mask(batch.old_logps, sampler_logps, rollout.model_mask, batch.advantages, cfg.algo.opsm_delta)
        batch.importance_weights = batch.importance_weights * keep  # [N, T] * [N, 1]
        metrics["sampling/opsm_masked_frac"] = float(1 - keep.mean())
    return {**metrics, **mismatch_by_modality(batch.old_logps, sampler_logps, rollout.model_mask, batch.importance_weights, modalities)}


def advantages_of(run: Run, samples: list, batch: Rollout, weights_rule: DynamicWeights | None) -> tuple[torch.Tensor, dict, dict]:
    """[N] advantages of the batch's rewards (NaN counts as 0) by --advantage_estimator, times
    --modality_weights and the --dynamic_modality_weights rule; with the estimator's statistics
    (reward_std, frac_reward_zero_std) and the rule's metrics. Row i is a completion of samples[i // G]."""
    cfg, G = run.cfg, run.cfg.rollout.num_generations
    rewards_known = torch.nan_to_num(batch.rewards, nan=0.0)
    batch_std = run.strategy.std_across_ranks(rewards_known) if cfg.algo.scale_rewards == "batch" else None
    estimator = get_advantage(cfg.algo.advantage_estimator)
    advantages, adv_stats = estimator(rewards_known, G, cfg.algo.scale_rewards, batch_std=batch_std)
    advantages = advantages.to(batch.completion_ids.device)
    if run.modality_weights:
        advantages = advantages * torch.tensor(
            [run.modality_weights.get(samples[i // G].modality, 1.0) for i in range(len(samples) * G)], device=advantages.device
        )
    weight_metrics = {}
    if weights_rule is not None:  # mmgrpo/grpo/dynamic_weights.py
        by_dataset = cfg.algo.dynamic_weights_by == "dataset"
        keys = [dataset_of(s.id) if by_dataset else s.modality for s in samples for _ in range(G)]
        dynamic, weight_metrics = weights_rule(keys, advantages)
        advantages = advantages * dynamic
    return advantages, adv_stats, weight_metrics


def routing_of(run: Run, rows: Rollout, forward: ForwardBatch, aux: bool = False) -> Routing | None:
    """An MoE forward's routes: the rows' recorded ones, replayed under --routing_replay rollout (else
    compared), and the load-balancing loss with `aux`; None where there is nothing to do (a dense model,
    the shared-prefix path, no routes recorded and no loss asked)."""
    if forward.shared or (rows.routed_experts is None and not aux):
        return None
    return Routing(rows.routed_experts, replay=run.cfg.algo.routing_replay == "rollout", aux=aux)


def completion_logprobs_of(run: Run, batch: Rollout, plan: ForwardPlan, reference: bool = False,
                           routings: list | None = None, teacher: bool = False) -> torch.Tensor:
    """Log-probs [N, T] of every completion, without gradients: under the policy as it sampled
    them (the ratio's denominator when num_iterations > 1), under the reference (the KL term) or
    under --teacher_model (on-policy distillation).
    routings: where each forward's routes (MoE) are appended, for the step's routing metrics."""
    policy, temperature = run.policy, run.cfg.rollout.temperature
    per_batch = []
    with torch.no_grad(), autocast(run.compute_dtype, run.device):
        for mb, forward in plan:
            rows = batch.rows(mb)
            routing = None if teacher else routing_of(run, rows, forward)
            logps, _ = policy.completion_logprobs(forward, rows.completion_ids, rows.completion_mask, temperature=temperature,
                                                  reference=reference, teacher=teacher, routing=routing)
            per_batch.append(logps)
            if routing is not None and routings is not None:
                routings.append(routing)
    return scatter_rows(per_batch, plan.micro_batches, batch.completion_ids.shape)


def teacher_logprobs(run: Run, encoded: list, batch: Rollout, plan: ForwardPlan) -> torch.Tensor:
    """--teacher_model's log-probs [N, T] of the batch's completions: its forward in the trainer, or
    scored by its rollout server (--teacher_server_port) from the prompts `encoded` (row i's: i // G)."""
    server = run.policy.teacher_server
    if server is None:
        return completion_logprobs_of(run, batch, plan, teacher=True)
    logps = server.score(encoded, batch.completion_ids, batch.completion_mask, run.cfg.rollout.num_generations)
    return logps.to(batch.old_logps.device)


def reverse_kl(batch: Rollout) -> float:
    """The student-to-teacher reverse KL over the tokens the loss counts, estimated on the student's own
    samples: the mean of log p_student - log p_teacher (what on-policy distillation drives down)."""
    mask = batch.loss_mask.bool()
    gap = (batch.old_logps - batch.teacher_logps)[mask]
    return float(gap.mean()) if gap.numel() else 0.0


def update_policy(run: Run, batch: Rollout, plan: ForwardPlan, routings: list | None = None) -> dict:
    """num_iterations passes of gradient-accumulated updates over the batch's micro-batches.
    routings: where each forward's routes (MoE) are appended, for the step's routing metrics.

    A non-finite loss or gradient norm skips the step on every rank (`skipped` 1 in the metrics;
    the loop counts them); the learning-rate schedule advances either way, so it stays in step with the steps.
    Under --fp16 an update whose gradients overflowed is skipped by the loss scaler, which halves its
    scale (`fp16/overflow`, `fp16/loss_scale`): the normal start of float16 training, not counted as a skip.
    """
    cfg, strategy = run.cfg, run.strategy
    # Packed under a token budget, the micro-batches of a rollout batch vary in number: all of them
    # accumulate into one update (without a budget, accumulation steps x batch size is the rollout batch too).
    accumulation = len(plan) if cfg.algo.max_tokens_per_microbatch else cfg.optim.gradient_accumulation_steps
    pairs = list(plan)
    updates = [pairs[start:start + accumulation] for start in range(0, len(pairs), accumulation)]
    total_tokens = batch.loss_mask.sum().clamp(min=1) * cfg.algo.num_iterations
    token_weighted: dict[str, float] = {}  # metrics averaged over tokens of the whole step
    update_losses, grad_norm, skipped, overflows = [], float("nan"), False, 0
    for _ in range(cfg.algo.num_iterations):
        for update in updates:
            parts = [(batch.rows(mb), forward) for mb, forward in update]
            # Each micro-batch's loss is normalised by the tokens / sequences of the whole update,
            # so the micro-batch losses (and gradients) add up to those of one big batch.
            update_tokens = sum(rows.loss_mask.sum() for rows, _ in parts).clamp(min=1)
            # Ranks average their gradients: normalise by the global count / world size.
            update_tokens = strategy.mean_across_ranks(update_tokens)
            update_sequences = sum(len(rows) for rows, _ in parts)
            update_loss = 0.0
            for rows, forward in parts:
                routing = routing_of(run, rows, forward, aux=cfg.algo.router_aux_loss_coef > 0)
                loss, metrics = micro_batch_loss(run, rows, forward, update_tokens, update_sequences, routing)
                if strategy.any_rank(not torch.isfinite(loss)):  # all ranks skip together
                    warnings.warn(f"non-finite loss ({loss.item()}): update skipped", stacklevel=1)
                    strategy.zero_grad(run.optimizer)
                    skipped = True
                    if routing is not None:
                        routing.detach()
                    break
                strategy.backward(loss)
                if routing is not None:  # after the backward: checkpointed layers recompute with the same routes
                    routing.detach()
                    if routings is not None:
                        routings.append(routing)
                update_loss += loss.item()
                share = float(rows.loss_mask.bool().sum() / total_tokens)
                for key, value in metrics.items():
                    token_weighted[key] = token_weighted.get(key, 0.0) + float(value) * share
            if skipped:
                break
            grad_norm = strategy.optimizer_step(run.optimizer, cfg.optim.max_grad_norm)  # clip, step, zero grads
            update_losses.append(update_loss)
            if strategy.overflowed:  # --fp16: the loss scaler skipped this update and lowered its scale; no fault
                overflows += 1
            elif not math.isfinite(grad_norm):  # the strategy did not step (mmgrpo/parallel/guards.py): a skip like a NaN loss
                warnings.warn(f"non-finite gradient norm ({grad_norm}): update skipped", stacklevel=1)
                skipped = True
                break
        if skipped:
            break
    run.scheduler.step()
    loss = sum(update_losses) / len(update_losses) if update_losses else float("nan")  # a NaN loss: never appended
    fp16 = {"fp16/overflow": overflows, "fp16/loss_scale": strategy.loss_scale} if strategy.precision == "fp16" else {}
    return {**token_weighted, "loss": loss, "grad_norm": float(grad_norm), "skipped": int(skipped), **fp16}


def micro_batch_loss(run: Run, rows: Rollout, forward: ForwardBatch, update_tokens: torch.Tensor,
                     update_sequences: int, routing: Routing | None = None) -> tuple[torch.Tensor, dict]:
    """One micro-batch's loss (`rows`: its completions, their advantages, old and reference
    log-probs ...), normalised by the tokens and completions of the whole update, and its metrics
    (the loss's, and the mean entropy over the tokens the loss counts). routing: an MoE forward's
    routes to replay, and its load-balancing loss, added with --router_aux_loss_coef (the caller
    detaches its hooks after the backward)."""
    cfg = run.cfg
    advantages = rows.advantages  # [n]
    if rows.teacher_logps is not None:  # on-policy distillation: each token's reward is log p_teacher - log p_student
        advantages = advantages[:, None] + cfg.algo.teacher_kl_coef * (rows.teacher_logps - rows.old_logps)  # [n, T]
    with autocast(run.compute_dtype, run.device):
        logps, entropy = run.policy.completion_logprobs(
            forward, rows.completion_ids, rows.completion_mask, temperature=cfg.rollout.temperature, compute_entropy=True,
            routing=routing,
        )
        loss, metrics = policy_loss(
            logps, rows.old_logps, rows.ref_logps, advantages, rows.loss_mask, run.loss_config,
            num_items_in_batch=update_tokens, num_sequences_in_batch=update_sequences,
            importance_weights=rows.importance_weights,
        )
        if cfg.algo.entropy_coeff:  # the bonus: mean entropy over the update's tokens, like the dapo loss
            loss = loss - cfg.algo.entropy_coeff * (entropy * rows.loss_mask).sum() / update_tokens
        if routing is not None and routing.aux_loss is not None:  # each micro-batch its share of the update's rows
            loss = loss + cfg.algo.router_aux_loss_coef * routing.aux_loss * len(rows) / update_sequences
    tokens = rows.loss_mask.bool()
    metrics["entropy"] = entropy.detach()[tokens].mean() if tokens.any() else 0.0
    return loss, metrics


def train(cfg: TrainConfig) -> Path:
    """Run GRPO as configured; returns the output folder."""
    check_train_flags(cfg)  # every flag, once, before anything else
    plan = preflight(cfg)  # --output_dir and --resume_from_checkpoint, before any model loads
    deterministic_kernels(cfg.full_determinism)
    run = build_run(cfg, resume_from=plan.resume_from)  # rewards and data checked before any model loads
    run.strategy.barrier()  # every rank has checked --output_dir before any rank writes there
    seed_everything(cfg.seed)
    out = Path(cfg.output_dir)
    batches = run.prompt_batches()
    pipeline = rollout_pipeline(run, batches)  # rollouts in step, or up to --max_staleness steps ahead
    state = TrainState(model=cfg.model.model)
    if plan.resume_from is not None:  # the state, optimizer, schedule, data position, rollouts in flight, RNGs
        state = resume_run(run, plan.resume_from, batches, pipeline)
    weights_rule = DynamicWeights(state.modality_weights) if cfg.algo.dynamic_modality_weights else None
    if run.strategy.is_main:
        plan.apply()  # resume: the step logs cut at the checkpoint; overwrite: the earlier run's files gone
    resumed_after = state.step if plan.resume_from is not None else None  # TensorBoard hides the killed run's later steps
    logger = (RunLogger(out, cfg.to_dict(), cfg.report_to, resume_step=resumed_after, resumed=state.resumed)  # rank 0 writes the reduced metrics
              if run.strategy.is_main else NullLogger())
    no_signal_watch = NoSignalWatch(patience=5)
    stop = StopSignals(cfg.save_on_signal)  # SIGTERM / SIGUSR1: this step finishes and is saved (training/preemption.py)
    try:
        with progress_bar(run.total_steps, "GRPO", show=run.strategy.is_main, completed=state.step) as bar:
            for step in range(state.step + 1, run.total_steps + 1):
                started, started_cpu = time.perf_counter(), time.process_time()
                state.step = step
                # reproducible per step and data rank (a sequence group's ranks draw alike)
                torch.manual_seed(step_seed(cfg.seed, step, run.strategy.data_rank))
                timers = Timers()  # every phase of the step, timed once
                batch = pipeline.next_batch(step, timers)  # time/data, weight_sync, rollout, reward, resample
                metrics, records = grpo_step(run, batch.prompts, step, batch.rollout, weights_rule=weights_rule, timers=timers)
                metrics.update(run.strategy.all_reduce_metrics(batch.metrics))
                pipeline.policy_updated(step)
                state.nonfinite_steps += metrics["skipped"]
                metrics["nonfinite_steps"] = state.nonfinite_steps
                final = step == run.total_steps
                with timers("eval"):
                    metrics.update(run.evaluate(run.evaluator, step, state, final=final))  # eval/<metric>
                with timers("save"):
                    stopping = not final and stop.agreed(run.strategy, step)  # a signal on any rank: all save now
                    due = final or (cfg.save_steps and step % cfg.save_steps == 0)  # the final save is awaited
                    if stopping or (due and cfg.save_strategy != "no"):
                        save_run(run, out / f"checkpoint-{step}", state, batches, pipeline,
                                 background=cfg.save_in_background and not (final or stopping),
                                 step_log=step_log_lines(metrics, records) if run.strategy.is_main else None)
                metrics["cpu/step_s"] = time.process_time() - started_cpu  # this process's CPU seconds (all threads)
                finish_step_metrics(run, metrics, timers, time.perf_counter() - started)
                logger.log_step(metrics, records, print_it=step % cfg.logging_steps == 0)
                bar.advance(metrics)
                no_signal = no_signal_watch.observe(metrics)  # every group's rewards equal for several steps: said once
                if no_signal and run.strategy.is_main:
                    console.print(f"[yellow]{no_signal}")
                if state.nonfinite_steps >= cfg.max_nonfinite_steps:
                    raise ConfigError(
                        f"{state.nonfinite_steps} steps had a NaN/inf loss or gradient norm: stopping. Lower --learning_rate, "
                        "use fp32, or raise --max_nonfinite_steps."
                    )
                if stopping:
                    break
    finally:
        stop.restore()
        wait_for_saves()  # a background save is complete (or its error raised) before the run ends
        pipeline.close()
        run.rollout.close()  # a vLLM engine goes before the process group it uses
        plan.release()  # the run's lock on --output_dir (mmgrpo/runstate/run_lock.py)
    logger.close()
    run.strategy.close()
    stop.raise_if_stopped(out)  # stopped on a signal: the CLI says how to resume and exits 75
    return out


def finish_step_metrics(run: Run, metrics: dict, timers: Timers, wall_seconds: float) -> None:
    """Add every phase's seconds (those `grpo_step` logged already, and eval and save), time/step
    (the step's wall time), time/other (what no phase timer covered), samples/s (evaluation
    excluded) and memory, as means over ranks like the step's."""
    extra = timers.every_step()
    named = sum(value for key, value in {**metrics, **extra}.items() if key.startswith("time/"))
    extra["time/step"] = wall_seconds
    extra["time/other"] = max(0.0, wall_seconds - named)
    num_rows = run.prompts_per_step * run.cfg.rollout.num_generations
    extra["samples_per_s"] = num_rows / max(wall_seconds - extra.get("time/eval", 0.0), 1e-9)
    extra["memory/peak_gb"] = run.strategy.peak_memory_gb()
    metrics.update(run.strategy.all_reduce_metrics(extra))
