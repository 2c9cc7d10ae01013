"""Between a rollout and `grpo_step`: its rewards scored (once), then the batch completed where
the rollout options ask for it.

    rollout = score(run, prompts, rollout)      # every step: rollout.rewards / reward_per_func / texts set

    --dynamic_sample --max_resample_times 3     (DAPO / ms-swift) all-equal groups dropped and
                                                refilled: mmgrpo/rollout/dynamic_sample.py
    --first_stage_generations K                 two-stage generation: K completions per prompt
                                                first, the other G - K only for prompts whose K
                                                disagree or fail (below)

Both off (the default), the loop scores the rollout and trains on it. On, the loop rolls out the
batch's prompts as usual (K per prompt with two stages) and then makes one call:

    prompts, rollout, extra = complete_batch(run, prompts, rollout, batches, step)   # rollout scored
    metrics, records = grpo_step(run, prompts, rollout, step)

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

from mmgrpo.data.reward_columns import reward_columns
from mmgrpo.rollout.base import Rollout, step_seed
from mmgrpo.rollout.dynamic_sample import Round, fill_informative


def score(run, prompts: list, rollout: Rollout) -> Rollout:
    """Write the rewards of `rollout`'s completions into it: `texts` (decoded where the engine gave
    none; multi-turn: each episode's last model turn), `reward_per_func` [F, N] and `rewards` [N].
    The one place completions are scored; every later stage reads them from the rollout."""
    if rollout.scored:
        raise RuntimeError("this rollout is scored already: a reward would run twice")
    num_generations = len(rollout) // len(prompts)
    if rollout.texts is None:
        rollout.texts = run.template.decode(rollout.completion_ids, rollout.completion_mask)
    columns = reward_columns([s for s, _ in prompts], [e for _, e in prompts], run.template, num_generations,
                             rollout.completion_ids, rollout.completion_mask)
    rollout.reward_per_func, rollout.rewards = run.rewards(rollout.texts, {**columns, **rollout.columns})
    return rollout


def generate_now(run, encoded: list, sampling) -> Rollout:
    """The run's engine on `encoded` prompts, in this thread."""
    from mmgrpo.forward.policy import autocast

    with autocast(run.bf16, run.device):
        return run.rollout.generate(encoded, sampling)


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
    both = Rollout.concat([first.rollout, second.rollout], pad_token_id)  # rows: B*k of first, then B*rest of second
    B = len(first.prompts)
    order = [row for p in range(B) for row in [*range(p * k, (p + 1) * k), *range(B * k + p * rest, B * k + (p + 1) * rest)]]
    return Round(first.prompts, both.select(order))


def settled_prompts(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """[B] True where a prompt's k rewards are all equal to the batch's best reward (all solved).

    >>> settled_prompts(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), k=2).tolist()
    [True, False, False]
    """
    known = torch.nan_to_num(rewards.detach().float(), nan=0.0).view(-1, k)
    return torch.isclose(known, known.max().expand_as(known)).all(dim=1)


def second_stage(run, first: Round, step: int, round_index: int, stats: dict, generate) -> Round:
    """Complete the groups of `first` (K completions each): settled prompts leave, the others get G - K more."""
    cfg = run.cfg
    G, k = cfg.rollout.num_generations, cfg.rollout.first_stage_generations
    settled = settled_prompts(first.rollout.rewards, k)
    open_ = [p for p in range(len(first.prompts)) if not settled[p]] or [0]  # at least one prompt stays
    open_ = open_[: min_across_ranks(run.strategy)(len(open_))]  # every rank: the same micro-batches
    stats["two_stage/settled_prompts"] = stats.get("two_stage/settled_prompts", 0) + int(settled.sum())
    stats["two_stage/saved_completions"] = stats.get("two_stage/saved_completions", 0) + (len(first.prompts) - len(open_)) * (G - k)
    first = first.take_groups(open_, k)
    sampling = run.sampling(first.prompts, second_seed(cfg, step, run.strategy.rank, round_index))
    sampling.num_generations = G - k
    rollout = generate([e for _, e in first.prompts], sampling)
    second = Round(first.prompts, score(run, first.prompts, rollout))
    return interleave(first, second, k, G - k, run.template.completion_pad_id)


def second_seed(cfg, step: int, rank: int, round_index: int) -> int:
    return step_seed(cfg, step, rank) + 7_919 * (2 * round_index + 1)


def draw_round(run, batches, step: int, round_index: int, stats: dict, generate) -> Round:
    """A further round of prompts for dynamic sampling: rolled out (both stages if on) and scored."""
    cfg = run.cfg
    k = cfg.rollout.first_stage_generations or cfg.rollout.num_generations
    prompts = next(batches)
    sampling = run.sampling(prompts, second_seed(cfg, step, run.strategy.rank, round_index) + 1)
    sampling.num_generations = k
    rollout = generate([e for _, e in prompts], sampling)
    round_ = Round(prompts, score(run, prompts, rollout))
    return second_stage(run, round_, step, round_index, stats, generate) if cfg.rollout.first_stage_generations else round_


def complete_batch(run, prompts: list, rollout: Rollout, batches, step: int, generate=None):
    """The step's batch after two-stage generation and/or dynamic sampling.

    `rollout` is the scored first round of `prompts`. Returns (prompts, rollout, metrics): the
    batch to train on, scored. generate(encoded prompts, sampling) -> Rollout runs the extra
    rounds (the rollout pipeline's, which keeps them behind the rollouts it runs ahead); None:
    the run's engine, here and now.
    """
    cfg = run.cfg
    generate = generate or (lambda encoded, sampling: generate_now(run, encoded, sampling))
    G, k = cfg.rollout.num_generations, cfg.rollout.first_stage_generations
    stats: dict[str, float] = {}
    first = Round(prompts, rollout)
    if k:
        first = second_stage(run, first, step, 0, stats, generate)
    if cfg.rollout.dynamic_sample:
        rounds = iter(range(1, cfg.rollout.max_resample_times + 1))
        batch, fill = fill_informative(
            first, lambda: draw_round(run, batches, step, next(rounds), stats, generate),
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
    return batch.prompts, batch.rollout, {k_: float(v) for k_, v in stats.items()}
