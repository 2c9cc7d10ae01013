"""Dynamic sampling (DAPO; ms-swift `--dynamic_sample`): train only on groups that disagree.

A group whose G completions all get the same reward has advantages of exactly 0: it costs a
log-prob forward and a backward and teaches nothing (the "loss is 0" confusion when every group
is like that). With dynamic sampling the step drops those groups and rolls out more prompts
until it has its B informative groups, at most `max_resample_times` extra rounds; then it goes on
with what it has (the first time that happens it says so, then only logs it).

The step calls it with its first round and a function that rolls out and scores the next prompts:

    first = Round(prompts, score(rewards, template, prompts, rollout))   # B prompts, their rollout with its rewards
    batch, stats = fill_informative(first, draw_next_round,
                                    num_prompts=B, num_generations=G, max_resample_times=3)
    # batch: a Round of at most B groups, all informative (or the last ones drawn, see below);
    # stats: {"dynamic/rounds", "dynamic/resampled_prompts", "dynamic/kept_groups", "frac_reward_zero_std", ...}

Under several processes pass `any_rank` and `min_across_ranks` (collectives): every rank then
runs the same number of rounds (a rollout may gather sharded weights, so all must take part) and
keeps the same number of groups (so all run the same number of micro-batches).

    >>> import torch
    >>> informative_groups(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5]), num_generations=2)
    tensor([ True, False, False])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mmgrpo.rollout.base import Rollout


@dataclass
class Round:
    """One rollout round as the step holds it: B prompts and their B x G completions, scored
    (`Rollout.rewards`). Row i of the rollout belongs to prompt i // G (the G of a prompt contiguous)."""

    prompts: list  # B (Sample, PromptInputs) pairs
    rollout: Rollout  # [B * G, T] completions with their rewards

    def take_groups(self, groups: list[int], num_generations: int) -> Round:
        """The prompts `groups` (indices into `prompts`), in that order, with their G completions each."""
        rows = [g * num_generations + k for g in groups for k in range(num_generations)]
        return Round([self.prompts[g] for g in groups], self.rollout.select(rows))

    @staticmethod
    def concat(rounds: list[Round], pad_token_id: int) -> Round:
        """Rounds one after the other; completions right-padded to the longest round's length."""
        return Round([p for r in rounds for p in r.prompts], Rollout.concat([r.rollout for r in rounds], pad_token_id))


def informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[B] True for each group whose G rewards are not all equal (NaN counts as 0, as in the step)."""
    grouped = torch.nan_to_num(rewards.detach().float(), nan=0.0).view(-1, num_generations)  # [B, G]
    return ~torch.isclose(grouped.std(dim=1), torch.zeros(grouped.shape[0]))


@dataclass
class _Notice:
    """Says once per process that a step went on with fewer informative groups than asked."""

    said: bool = False

    def __call__(self, kept: int, wanted: int, rounds: int) -> None:
        if not self.said:
            self.said = True
            warnings.warn(
                f"dynamic sampling: after {rounds - 1} extra rollout rounds (--max_resample_times) only {kept} of "
                f"{wanted} prompt groups had rewards that differ; the step goes on with them (and with all-equal "
                "groups to fill the batch). The data may be too easy or too hard for the model: "
                "dynamic/kept_groups in metrics.jsonl shows how often this happens.",
                stacklevel=3,
            )


NOTICE = _Notice()


@dataclass
class FillStats:
    rounds: int = 1  # rollout rounds this step (1: no resampling)
    resampled_prompts: int = 0  # prompts rolled out beyond the first B
    kept_groups: int = 0  # informative groups in the batch
    groups: int = 0  # groups in the batch
    frac_reward_zero_std: float = 0.0  # of the batch the step trains on
    frac_reward_zero_std_drawn: list[float] = field(default_factory=list)  # of each round, before filtering

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic/rounds": float(self.rounds),
            "dynamic/resampled_prompts": float(self.resampled_prompts),
            "dynamic/kept_groups": float(self.kept_groups),
            "dynamic/frac_reward_zero_std_first_round": self.frac_reward_zero_std_drawn[0],
            "frac_reward_zero_std": self.frac_reward_zero_std,
        }


def fill_informative(
    first: Round,
    draw: Callable[[], Round],
    *,
    num_prompts: int,
    num_generations: int,
    max_resample_times: int,
    pad_token_id: int = 0,
    any_rank: Callable[[bool], bool] = bool,
    min_across_ranks: Callable[[int], int] = int,
) -> tuple[Round, FillStats]:
    """Keep the informative groups of `first`; while fewer than `num_prompts`, roll out `draw()`
    (at most `max_resample_times` times) and keep its informative groups too.

    The batch holds `num_prompts` groups when enough were found: the informative ones, in the order
    they were drawn (round by round, each round's in its own order). If the bound is reached first, it is topped up with all-equal groups from the
    earliest rounds (zero advantage: they add nothing to the gradient, but every rank keeps the
    same batch shape), and the step is said to be short once (`NOTICE`). With several ranks the
    batch is cut to the smallest count of any rank.
    """
    if max_resample_times < 0:
        raise ValueError("max_resample_times must be >= 0")
    rounds, kept = [first], []  # kept: (round index, group index)
    stats = FillStats()

    def add(index: int, round_: Round) -> None:
        informative = informative_groups(round_.rollout.rewards, num_generations)
        stats.frac_reward_zero_std_drawn.append(float((~informative).float().mean()))
        kept.extend((index, int(g)) for g in torch.nonzero(informative).flatten())

    add(0, first)
    while any_rank(len(kept) < num_prompts) and len(rounds) <= max_resample_times:
        round_ = draw()
        rounds.append(round_)
        stats.resampled_prompts += len(round_.prompts)
        add(len(rounds) - 1, round_)
    stats.rounds = len(rounds)
    chosen = kept[:num_prompts]
    if len(chosen) < num_prompts:  # top up with all-equal groups, earliest first
        NOTICE(len(chosen), num_prompts, len(rounds))
        taken = set(chosen)
        spare = [(i, g) for i, r in enumerate(rounds) for g in range(len(r.prompts)) if (i, g) not in taken]
        chosen += spare[: num_prompts - len(chosen)]
    stats.kept_groups = min(len(kept), num_prompts)
    chosen = chosen[: min_across_ranks(len(chosen))]
    parts = [r.take_groups(sorted(g for i, g in chosen if i == index), num_generations) for index, r in enumerate(rounds)]
    batch = Round.concat([p for p in parts if p.prompts], pad_token_id)
    stats.groups = len(batch.prompts)
    stats.frac_reward_zero_std = float((~informative_groups(batch.rollout.rewards, num_generations)).float().mean())
    return batch, stats
