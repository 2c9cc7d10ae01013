"""Between a rollout and `grpo_step`: its rewards scored (once), then the batch completed where
the rollout options ask for it.

    rollout = score(rewards, template, prompts, rollout)   # every step: rollout.rewards / reward_per_func / texts set

    --dynamic_sample --max_resample_times 3     (DAPO / ms-swift) all-equal groups dropped and
                                                refilled: mmgrpo/rollout/dynamic_sample.py
    --first_stage_generations K                 two-stage generation: K completions per prompt
                                                first, the other G - K only for prompts whose K
                                                disagree or fail (below)

Both off (the default), the loop scores the rollout and trains on it. On, the loop rolls out the
batch's prompts as usual (K per prompt with two stages) and then makes one call:

    prompts, rollout, extra = complete_batch(setup, prompts, rollout, batches, step)   # rollout scored
    metrics, records = grpo_step(run, prompts, step, rollout)

`setup` (`RolloutSetup`) is what the rounds and the rollout pipeline take of the run, each part
typed; mmgrpo/engine.py's `rollout_setup(run)` builds it.

Two-stage rule. A prompt whose K first completions all get the same reward, and that reward is the
best any completion of this batch got, is settled: its group would carry no signal (every answer
right), so the other G - K completions are not generated and the prompt leaves the batch. Every
other prompt (its K disagree, or all fail) gets G - K more, which complete its group of G. The
saving is (G - K) completions per settled prompt; with --dynamic_sample, the settled prompts are
replaced by new ones, drawn the same two-stage way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mmgrpo.config import RolloutConfig
from mmgrpo.data.reward_columns import reward_columns
from mmgrpo.parallel.base import Strategy
from mmgrpo.rollout.base import Rollout, RolloutSampler, SamplingParams, step_seed
from mmgrpo.rollout.dynamic_sample import Round, fill_informative
from mmgrpo.templates.base import Template

# texts, reward columns -> (each reward's scores [F, N], their weighted sum [N]): the run's RewardSet
Rewards = Callable[[list[str], dict], tuple[torch.Tensor, torch.Tensor]]
# B encoded prompts, their SamplingParams -> their completions (`RolloutSampler.generate`, or the pipeline's)
Generate = Callable[[list, SamplingParams], Rollout]


def score(rewards: Rewards, template: Template, prompts: list, rollout: Rollout) -> Rollout:
    """Write the rewards of `rollout`'s completions into it: `texts` (decoded where the engine gave
    none; multi-turn: each episode's last model turn), `reward_per_func` [F, N] and `rewards` [N].
    The one place completions are scored; every later stage reads them from the rollout."""
    if rollout.scored:
        raise RuntimeError("this rollout is scored already: a reward would run twice")
    num_generations = len(rollout) // len(prompts)
    if rollout.texts is None:
        rollout.texts = template.decode(rollout.completion_ids, rollout.completion_mask)
    columns = reward_columns([s for s, _ in prompts], [e for _, e in prompts], template, num_generations,
                             rollout.completion_ids, rollout.completion_mask)
    rollout.reward_per_func, rollout.rewards = rewards(rollout.texts, {**columns, **rollout.columns})
    return rollout


@dataclass(frozen=True)
class RolloutSetup:
    """What a step's rollouts take of the run: the rollout pipeline (mmgrpo/rollout/pipeline.py) and
    the rounds below read these parts and nothing else."""

    options: RolloutConfig  # G, two-stage K, dynamic sampling, --max_staleness
    seed: int  # --seed: a step's rollout is seeded by step_seed(seed, step, rank)
    sampler: RolloutSampler  # the run's engine, generating under the policy's autocast
    # (Sample, PromptInputs) pairs and a seed -> their SamplingParams, each prompt its dataset's budget (Run.sampling)
    sampling: Callable[[list, int | None], SamplingParams]
    rewards: Rewards
    template: Template  # decodes the completions the rewards score; its pad id pads concatenated rounds
    strategy: Strategy  # the ranks: each its own seed, all the same rounds and group counts
    num_prompts: int  # B prompts a step trains on

    def step_seed(self, step: int) -> int:
        return step_seed(self.seed, step, self.strategy.data_rank)

    def score(self, prompts: list, rollout: Rollout) -> Rollout:
        return score(self.rewards, self.template, prompts, rollout)


def min_across_ranks(strategy: Strategy) -> Callable[[int], int]:
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


def second_stage(setup: RolloutSetup, first: Round, step: int, round_index: int, stats: dict,
                 generate: Generate) -> Round:
    """Complete the groups of `first` (K completions each): settled prompts leave, the others get G - K more."""
    G, k = setup.options.num_generations, setup.options.first_stage_generations
    settled = settled_prompts(first.rollout.rewards, k)
    open_ = [p for p in range(len(first.prompts)) if not settled[p]] or [0]  # at least one prompt stays
    open_ = open_[: min_across_ranks(setup.strategy)(len(open_))]  # every rank: the same micro-batches
    stats["two_stage/settled_prompts"] = stats.get("two_stage/settled_prompts", 0) + int(settled.sum())
    stats["two_stage/saved_completions"] = stats.get("two_stage/saved_completions", 0) + (len(first.prompts) - len(open_)) * (G - k)
    first = first.take_groups(open_, k)
    sampling = setup.sampling(first.prompts, second_seed(setup.step_seed(step), round_index))
    sampling.num_generations = G - k
    rollout = generate([e for _, e in first.prompts], sampling)
    second = Round(first.prompts, setup.score(first.prompts, rollout))
    return interleave(first, second, k, G - k, setup.template.completion_pad_id)


def second_seed(step_seed: int, round_index: int) -> int:
    """The seed of a step's extra round `round_index`, from the step's own (`step_seed`)."""
    return step_seed + 7_919 * (2 * round_index + 1)


def draw_round(setup: RolloutSetup, batches: Iterator[list], step: int, round_index: int, stats: dict,
               generate: Generate) -> Round:
    """A further round of prompts for dynamic sampling: rolled out (both stages if on) and scored."""
    two_stage = setup.options.first_stage_generations
    prompts = next(batches)
    sampling = setup.sampling(prompts, second_seed(setup.step_seed(step), round_index) + 1)
    sampling.num_generations = two_stage or setup.options.num_generations
    rollout = generate([e for _, e in prompts], sampling)
    round_ = Round(prompts, setup.score(prompts, rollout))
    return second_stage(setup, round_, step, round_index, stats, generate) if two_stage else round_


def complete_batch(setup: RolloutSetup, prompts: list, rollout: Rollout, batches: Iterator[list], step: int,
                   generate: Generate | None = None) -> tuple[list, Rollout, dict[str, float]]:
    """The step's batch after two-stage generation and/or dynamic sampling.

    `rollout` is the scored first round of `prompts`; `batches` the prompt stream the extra prompts
    come from. Returns (prompts, rollout, metrics): the batch to train on, scored. generate(encoded
    prompts, sampling) -> Rollout runs the extra rounds (the rollout pipeline's, which keeps them
    behind the rollouts it runs ahead); None: the run's engine, here and now.
    """
    options = setup.options
    generate = generate or setup.sampler.generate
    G, k = options.num_generations, options.first_stage_generations
    stats: dict[str, float] = {}
    first = Round(prompts, rollout)
    if k:
        first = second_stage(setup, first, step, 0, stats, generate)
    if options.dynamic_sample:
        rounds = iter(range(1, options.max_resample_times + 1))
        batch, fill = fill_informative(
            first, lambda: draw_round(setup, batches, step, next(rounds), stats, generate),
            num_prompts=setup.num_prompts, num_generations=G,
            max_resample_times=options.max_resample_times, pad_token_id=setup.template.completion_pad_id,
            any_rank=setup.strategy.any_rank, min_across_ranks=min_across_ranks(setup.strategy),
        )
        stats.update(fill.metrics())
        stats.pop("frac_reward_zero_std")  # grpo_step logs it for the batch it trains on
    else:
        batch = first
    if k:
        stats["two_stage/prompts"] = len(batch.prompts)
    return batch.prompts, batch.rollout, {k_: float(v) for k_, v in stats.items()}
