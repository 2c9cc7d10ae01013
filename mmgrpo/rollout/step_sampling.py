"""What the training loop calls between a rollout and `grpo_step` when the rollout options ask for it.

    --dynamic_sample --max_resample_times 3     (DAPO / ms-swift) all-equal groups dropped and
                                                refilled: mmgrpo/grpo/dynamic_sampling.py
    --first_stage_generations K                 two-stage generation: K completions per prompt
                                                first, the other G - K only for prompts whose K
                                                disagree or fail (below)

Both off (the default), the loop does not call this module and a step is unchanged. On, the loop
rolls out the batch's prompts as usual (K per prompt with two stages) and then makes one call:

    prompts, rollout, scored, extra = complete_batch(run, prompts, rollout, batches, step)
    metrics, records = grpo_step(run, prompts, step, rollout, scored=scored)   # rewards not recomputed

Two-stage rule. A prompt whose K first completions all get the same reward, and that reward is the
best any completion of this batch got, is settled: its group would carry no signal (every answer
right), so the other G - K completions are not generated and the prompt leaves the batch. Every
other prompt (its K disagree, or all fail) gets G - K more, which complete its group of G. The
saving is (G - K) completions per settled prompt; with --dynamic_sample, the settled prompts are
replaced by new ones, drawn the same two-stage way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmgrpo.grpo.dynamic_sampling import Round, concat_rounds, fill_informative, take_groups
from mmgrpo.rewards.columns import reward_columns
from mmgrpo.rollout.base import Rollout


def score(run, prompts: list, rollout: Rollout, num_generations: int) -> Round:
    """Decode and score the completions of `prompts` (num_generations each, contiguous)."""
    completions = run.template.decode(rollout.completion_ids, rollout.completion_mask)
    columns = reward_columns([s for s, _ in prompts], [e for _, e in prompts], run.template, num_generations,
                             rollout.completion_ids, rollout.completion_mask)
    per_func, rewards = run.rewards(completions, columns)
    return Round(prompts=list(prompts), rollout=rollout, completions=completions, per_func=per_func, rewards=rewards)


def min_across_ranks(strategy):
    """A function n -> the smallest n of any rank (an all-reduce), or n itself on one process."""
    if strategy.world_size == 1:
        return int

    def smallest(n: int) -> int:
        value = torch.tensor([n], device=strategy.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())

    return smallest


def interleave(first: Round, second: Round, k: int, rest: int, pad_token_id: int) -> Round:
    """Groups of k (from `first`) + rest (from `second`) completions per prompt, contiguous per prompt."""
    both = concat_rounds([first, second], pad_token_id)  # rows: B*k of first, then B*rest of second
    B = len(first.prompts)
    rows = [p * k + j for p in range(B) for j in range(k)]
    order = torch.tensor([i for p in range(B) for i in (rows[p * k:(p + 1) * k] + [B * k + p * rest + j for j in range(rest)])])
    r = both.rollout
    return Round(
        prompts=first.prompts,
        rollout=Rollout(completion_ids=r.completion_ids[order], completion_mask=r.completion_mask[order],
                        truncated=r.truncated[order], logps=None if r.logps is None else r.logps[order],
                        weight_version=r.weight_version),
        completions=[both.completions[i] for i in order.tolist()],
        per_func=both.per_func[:, order],
        rewards=both.rewards[order],
    )


def settled_prompts(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """[B] True where a prompt's k rewards are all equal to the batch's best reward (all solved).

    >>> settled_prompts(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), k=2).tolist()
    [True, False, False]
    """
    known = torch.nan_to_num(rewards.detach().float(), nan=0.0).view(-1, k)
    return torch.isclose(known, known.max().expand_as(known)).all(dim=1)


def second_stage(run, first: Round, step: int, round_index: int, stats: dict) -> Round:
    """Complete the groups of `first` (K completions each): settled prompts leave, the others get G - K more."""
    from mmgrpo.forward.policy import autocast

    cfg = run.cfg
    G, k = cfg.rollout.num_generations, cfg.rollout.first_stage_generations
    settled = settled_prompts(first.rewards, k)
    open_ = [p for p in range(len(first.prompts)) if not settled[p]] or [0]  # at least one prompt stays
    open_ = open_[: min_across_ranks(run.strategy)(len(open_))]  # every rank: the same micro-batches
    stats["two_stage/settled_prompts"] = stats.get("two_stage/settled_prompts", 0) + int(settled.sum())
    stats["two_stage/saved_completions"] = stats.get("two_stage/saved_completions", 0) + (len(first.prompts) - len(open_)) * (G - k)
    first = take_groups(first, open_, k)
    sampling = run.sampling(first.prompts, second_seed(cfg, step, run.strategy.rank, round_index))
    sampling.num_generations = G - k
    with autocast(run.bf16, run.device):
        rollout = run.rollout.generate([e for _, e in first.prompts], sampling)
    second = score(run, first.prompts, rollout, G - k)
    return interleave(first, second, k, G - k, run.template.completion_pad_id)


def second_seed(cfg, step: int, rank: int, round_index: int) -> int:
    from mmgrpo.rollout.sampling import step_seed

    return step_seed(cfg, step, rank) + 7_919 * (2 * round_index + 1)


def draw_round(run, batches, step: int, round_index: int, stats: dict) -> Round:
    """A further round of prompts for dynamic sampling: rolled out (both stages if on) and scored."""
    from mmgrpo.forward.policy import autocast

    cfg = run.cfg
    k = cfg.rollout.first_stage_generations or cfg.rollout.num_generations
    prompts = next(batches)
    sampling = run.sampling(prompts, second_seed(cfg, step, run.strategy.rank, round_index) + 1)
    sampling.num_generations = k
    with autocast(run.bf16, run.device):
        rollout = run.rollout.generate([e for _, e in prompts], sampling)
    round_ = score(run, prompts, rollout, k)
    return second_stage(run, round_, step, round_index, stats) if cfg.rollout.first_stage_generations else round_


def complete_batch(run, prompts: list, rollout: Rollout, batches, step: int):
    """The step's batch after two-stage generation and/or dynamic sampling.

    Returns (prompts, rollout, (per_func, rewards), metrics) for `grpo_step(..., scored=...)`.
    """
    cfg = run.cfg
    G, k = cfg.rollout.num_generations, cfg.rollout.first_stage_generations
    stats: dict[str, float] = {}
    first = score(run, prompts, rollout, k or G)
    if k:
        first = second_stage(run, first, step, 0, stats)
    if cfg.rollout.dynamic_sample:
        rounds = iter(range(1, cfg.rollout.max_resample_times + 1))
        batch, fill = fill_informative(
            first, lambda: draw_round(run, batches, step, next(rounds), stats),
            num_prompts=run.prompts_per_step, num_generations=G,
            max_resample_times=cfg.rollout.max_resample_times, pad_token_id=run.template.completion_pad_id,
            any_rank=run.strategy.any_rank, min_across_ranks=min_across_ranks(run.strategy),
        )
        stats.update(fill.metrics())
        stats.pop("frac_reward_zero_std")  # grpo_step logs it for the batch it trains on
    else:
        batch = first
    if k:
        stats["two_stage/prompts"] = len(batch.prompts)
    return batch.prompts, batch.rollout, (batch.per_func, batch.rewards), {k_: float(v) for k_, v in stats.items()}
