"""The run's reward functions and weights, called as one.

    rewards = build_rewards(cfg.algo, dataset, max_completion_length)  # --reward_funcs or the datasets' own
    per_func, total = rewards(completions, columns)   # [F, N] (NaN = skipped), [N] the weighted sum

A mixture whose datasets name different default rewards is routed: each sample is scored only by
its own dataset's rewards (a colour question is never scored by IoU). An explicit --reward_funcs
entry `DATASET:REWARD` is routed the same way: scored on that dataset's rows only (scoped_entries).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch

from mmgrpo.config import AlgoConfig, RolloutConfig
from mmgrpo.data.sample import dataset_of
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.rewards.judge import JudgeReward
from mmgrpo.rewards.options import bind_options, parse_reward_kwargs
from mmgrpo.rewards.reward_funcs import compute_rewards, get_reward, reward_name, reward_names
from mmgrpo.rewards.reward_model import RewardModelReward
from mmgrpo.rewards.solutions import check_solutions, needs_solution


@dataclass
class RewardSet:
    """The run's reward functions and weights, called as one: (per_func [F, N], total [N]).

    routes: for a mixture whose datasets name different default rewards, which rewards apply
    to which dataset's samples; the others are skipped (NaN) for that sample, so a colour
    question is never scored by IoU.
    """

    names: list[str]
    funcs: list
    weights: list[float]
    on_error: str = "raise"
    routes: dict[str, list[str]] | None = None  # dataset name -> reward specs
    specs: list[str] | None = None  # as named in --reward_funcs / the registry
    timeout: float | None = None  # --reward_timeout: seconds per reward call
    missing_solution: str = "error"  # --missing_solution (mmgrpo/rewards/solutions.py)
    missing_count: int = 0  # completions of the last call without a solution, where a reward needed one

    def __call__(self, completions: list[str], columns: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(completions)
        specs = self.specs or self.names
        datasets = [dataset_of(sample_id) for sample_id in columns["sample_id"]] if self.routes else None
        # applies[f][i]: reward f scores completion i (a mixture's routes), and has what it needs to
        applies = [[datasets is None or spec in self.routes.get(datasets[i], specs) for i in range(n)] for spec in specs]
        needs = [needs_solution(func) for func in self.funcs]
        solutions = columns.get("solution", [None] * n)
        missing = [solutions[i] is None and any(need and rows[i] for need, rows in zip(needs, applies)) for i in range(n)]
        self.missing_count = sum(missing)
        if self.missing_count and self.missing_solution != "skip":  # the start-up check names a dataset's rows
            first = missing.index(True)
            raise DataError(f"sample {columns.get('sample_id', ['?'] * n)[first]} has no solution, which "
                            f"{', '.join(name for name, need in zip(self.names, needs) if need)} need to grade it; "
                            "add it, or pass --missing_solution skip")
        if not self.routes and not self.missing_count:
            return compute_rewards(self.funcs, self.weights, completions, columns, on_error=self.on_error, timeout=self.timeout)
        per_func = torch.full((len(self.funcs), n), float("nan"))  # [F, N]: NaN where a reward does not score
        for f, func in enumerate(self.funcs):
            rows = [i for i in range(n) if applies[f][i] and not (needs[f] and missing[i])]
            if rows:
                sub_columns = {key: [values[i] for i in rows] for key, values in columns.items()}
                values, _ = compute_rewards([func], [1.0], [completions[i] for i in rows], sub_columns, on_error=self.on_error,
                                            timeout=self.timeout)
                per_func[f, rows] = values[0]
        total = torch.nansum(per_func * torch.tensor(self.weights)[:, None], dim=0)
        return per_func, total

    def stats(self) -> dict[str, float]:
        """Counters of the last call: from rewards that keep them (the judge's judge/unparsed), and with
        --missing_solution skip the completions no solution-needing reward could grade."""
        counters = {key: value for func in self.funcs if hasattr(func, "stats") for key, value in func.stats().items()}
        if self.missing_solution == "skip":
            counters["reward/missing_solution"] = self.missing_count
        return counters


def build_rewards(algo_cfg: AlgoConfig, dataset, max_completion_length: int, judge_vllm: dict | None = None) -> RewardSet:
    """--reward_funcs (each for every sample, or a `DATASET:REWARD` entry for that dataset's samples
    only), or else each dataset's own defaults (routed per sample).
    max_completion_length: the run's (--max_completion_length), bound to the rewards that take it;
    judge_vllm: the judge's vLLM engine options (`judge_vllm_options`), which --judge_use_vllm needs."""
    routes = None
    entries = list(algo_cfg.reward_funcs)  # as written: they name the rewards in routes and errors
    if algo_cfg.reward_funcs:
        sources = [] if dataset is None else getattr(dataset, "sources", [dataset])  # None: checking the flags alone
        scoped = scoped_entries(entries, [source.name for source in sources])
        names = [reward for _, reward in scoped]
        if any(scope for scope, _ in scoped):
            routes = explicit_routes(entries, scoped, algo_cfg, dataset)
    else:
        sources = getattr(dataset, "sources", [dataset])
        routes = {source.name: list(source.reward_funcs) for source in sources}
        names = list(dict.fromkeys(name for source in sources for name in source.reward_funcs))
        if len({tuple(r) for r in routes.values()}) <= 1:
            routes = None  # every sample gets the same rewards
        entries = list(names)
    if not names:
        raise ConfigError(
            f"no reward functions: dataset {getattr(dataset, 'name', '')} names none; pass --reward_funcs "
            "(e.g. --reward_funcs vqa_accuracy format)."
        )
    num_models = len(algo_cfg.reward_model) + (1 if algo_cfg.judge_model else 0)
    weights = algo_cfg.reward_weights or [1.0] * (len(names) + num_models)
    if len(weights) != len(names) + num_models:  # before any reward model loads
        raise ConfigError(
            f"--reward_weights has {len(weights)} values for {len(names) + num_models} rewards ({len(names)} functions: "
            f"{', '.join(entries)}; {len(algo_cfg.reward_model)} --reward_model"
            f"{', 1 --judge_model' if algo_cfg.judge_model else ''}); "
            "give one weight per reward, in that order."
        )
    funcs = bound_rewards(algo_cfg, names, max_completion_length)
    if algo_cfg.reward_funcs and routes is None and len(sources) > 1:
        routes = task_routes(entries, funcs, sources)  # one unscoped list over a mixture: each reward where it can score
    specs = entries
    # reward models and the judge (build_model_rewards below): after the functions, for every sample
    for model_reward in build_model_rewards(algo_cfg, judge_vllm):
        funcs.append(model_reward)
        specs.append(model_reward.reward_name)
        for route in (routes or {}).values():
            route.append(model_reward.reward_name)
    rewards = RewardSet([reward_name(f) for f in funcs], funcs, list(weights), algo_cfg.reward_errors, routes, specs,
                        algo_cfg.reward_timeout, algo_cfg.missing_solution)
    check_solutions(dataset, rewards, algo_cfg.missing_solution)  # rows without a reference answer: named now
    return rewards


def scoped_entries(entries: list[str], datasets: list[str]) -> list[tuple[str | None, str]]:
    """Each --reward_funcs entry as (dataset or None, reward spec). The part before the first colon
    scopes the entry to a dataset iff it names one of the run's datasets (`shapes-ground:iou`,
    `shapes-ground:my_rewards.py:brevity`); a registered reward name, an entry without a colon and a
    plugin `path/file.py:fn` (the part before the colon ends in .py) apply to every sample. Any other
    `X:...` is a ConfigError naming X and the run's datasets, never a plugin load that fails later."""
    registered = set(reward_names())
    scoped = []
    for entry in entries:
        scope, _, rest = entry.partition(":")
        if entry in registered or not rest:
            scoped.append((None, entry))
        elif scope in datasets:
            scoped.append((scope, rest))
        elif scope.endswith(".py"):
            scoped.append((None, entry))
        else:
            raise ConfigError(
                f"--reward_funcs {entry}: {scope!r} is not a dataset of this run ({', '.join(datasets)}); scope a "
                "reward as DATASET:REWARD with one of them, or name a plugin as path/file.py:function"
            )
    return scoped


def references_hold_boxes(source, rows: int = 8) -> bool:
    """Whether a dataset's reference answers are boxes (its first `rows` rows with a solution, all of them)."""
    from mmgrpo.data.boxes import gold_boxes

    column = getattr(source, "rows", None)
    if column is None or "solution" not in getattr(column, "column_names", ()):
        return False
    solutions = [s for s in column.select(range(min(rows, len(column))))["solution"] if s is not None]
    try:
        return bool(solutions) and all(gold_boxes(solution) for solution in solutions)
    except (TypeError, ValueError):
        return False


def task_routes(entries: list[str], funcs: list, sources: list) -> dict[str, list[str]] | None:
    """For a mixture named with one --reward_funcs list (no DATASET:REWARD scopes): which rewards score
    each dataset's rows. A reward that grades boxes (`grades = "boxes"`: iou, giou ...) is not run on a
    dataset whose references are not boxes, one that grades answers (vqa_accuracy, exact_match ...) not on
    one whose references are boxes; the others (format, plugins) score every row. Said in one line each;
    None when every dataset keeps every reward."""
    kinds = {source.name: "boxes" if references_hold_boxes(source) else "answers" for source in sources}
    routes = {}
    for source in sources:
        routes[source.name] = [entry for entry, func in zip(entries, funcs)
                               if getattr(func.func if isinstance(func, functools.partial) else func, "grades",
                                          kinds[source.name]) == kinds[source.name]]
        skipped = [entry for entry in entries if entry not in routes[source.name]]
        if skipped and os.environ.get("RANK", "0") == "0":
            print(f"mmgrpo: {' '.join(skipped)} not run on {source.name}'s rows (its references are "
                  f"{'boxes' if kinds[source.name] == 'boxes' else 'not boxes'}); scope a reward to a dataset as "
                  f"{source.name}:REWARD to choose yourself", file=sys.stderr)
        if not routes[source.name]:
            raise ConfigError(f"--reward_funcs {' '.join(entries)}: none of them can score {source.name}'s rows "
                              f"(its references are {kinds[source.name]}); add one that does, e.g. "
                              f"{source.name}:{(source.reward_funcs or ['REWARD'])[-1]}")
    return None if all(len(route) == len(entries) for route in routes.values()) else routes


def explicit_routes(entries: list[str], scoped: list[tuple[str | None, str]], algo_cfg: AlgoConfig,
                    dataset) -> dict[str, list[str]]:
    """Which --reward_funcs entries score each dataset's samples when some are scoped: the unscoped
    ones and the dataset's own. A dataset left with no reward at all (no unscoped entry, none scoped
    to it, no reward model or judge) is a ConfigError: its samples would all score 0."""
    unscoped = [entry for entry, (scope, _) in zip(entries, scoped) if scope is None]
    routes = {}
    for source in getattr(dataset, "sources", [dataset]):
        own = [entry for entry, (scope, _) in zip(entries, scoped) if scope == source.name]
        routes[source.name] = [entry for entry in entries if entry in unscoped or entry in own]
        if not routes[source.name] and not (algo_cfg.reward_model or algo_cfg.judge_model):
            defaults = " ".join(f"{source.name}:{name}" for name in source.reward_funcs) or f"{source.name}:REWARD"
            raise ConfigError(
                f"--reward_funcs scopes no reward to dataset {source.name} and names none for every dataset, so "
                f"its samples would score nothing; add e.g. {defaults} (its own rewards)"
            )
    return routes


def bound_rewards(algo_cfg: AlgoConfig, names: list[str], max_completion_length: int) -> list:
    """Each reward with its --reward_kwargs options bound (and the run's max_completion_length where it takes it)."""
    options = parse_reward_kwargs(algo_cfg.reward_kwargs)
    stray = sorted(set(options) - set(names))
    if stray:
        raise ConfigError(f"--reward_kwargs names {', '.join(stray)}, not among the run's rewards ({', '.join(names)}).")
    run_defaults = {"max_completion_length": max_completion_length}
    return [bind_options(get_reward(name), name, options.get(name, {}), run_defaults) for name in names]


def build_model_rewards(algo_cfg: AlgoConfig, judge_vllm: dict | None = None) -> list:
    """The run's reward models (--reward_model, in order) and judge (--judge_model), loaded now so a
    checkpoint that does not fit fails at start-up. judge_vllm: the options of the judge's own vLLM
    engine (`judge_vllm_options`), used with --judge_use_vllm."""
    if algo_cfg.judge_model and algo_cfg.judge_use_vllm and judge_vllm is None:
        raise ValueError("--judge_use_vllm: build_model_rewards needs the judge's engine options (judge_vllm_options)")
    rewards = [
        RewardModelReward(path, device=algo_cfg.reward_model_device, batch_size=algo_cfg.reward_model_batch_size)
        for path in algo_cfg.reward_model
    ]
    if algo_cfg.judge_model:
        rewards.append(JudgeReward(
            algo_cfg.judge_model, model_type=algo_cfg.judge_model_type, device=algo_cfg.reward_model_device,
            prompt_file=algo_cfg.judge_prompt, parse=algo_cfg.judge_parse, score_max=algo_cfg.judge_score_max,
            max_new_tokens=algo_cfg.judge_max_new_tokens, batch_size=algo_cfg.reward_model_batch_size,
            vllm=judge_vllm if algo_cfg.judge_use_vllm else None,
        ))
    return rewards


def judge_vllm_options(algo_cfg: AlgoConfig, rollout_cfg: RolloutConfig, max_prompt_length: int, seed: int) -> dict:
    """The judge's colocated vLLM engine: room for the policy's prompt (`max_prompt_length`,
    --max_prompt_length) and completion, the judge's own words and its reply; memory as the
    --vllm_* flags say."""
    return dict(
        max_model_len=max_prompt_length + rollout_cfg.max_completion_length + algo_cfg.judge_max_new_tokens + 256,
        seed=seed, gpu_memory_utilization=rollout_cfg.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=rollout_cfg.vllm_kv_cache_memory_bytes,
    )
