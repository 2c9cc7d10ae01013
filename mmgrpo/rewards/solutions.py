"""Rows without a reference answer: one rule for every reward that needs one (`--missing_solution`).

    needs_solution(get_reward("vqa_accuracy"))          # True: it takes a required `solution`
    rows = rows_without_solution(dataset_view)          # [3, 17]: rows whose `solution` is None or absent
    check_solutions(dataset, reward_set, "error")       # DataError at start-up naming the dataset and rows

A reward needs a solution when its function takes a `solution` argument with no default, or says so
(`needs_solution = True`, as `cosine`, which grades through an accuracy reward). A row without one
would otherwise be scored 0.0 by one reward, raise in another and be skipped by a third; here:
- `--missing_solution error` (the default): the run stops before any model loads, naming the
  dataset, the rows and the rewards that need them;
- `--missing_solution skip`: those samples are scored None by the rewards that need a solution
  (skipped: no reward from them, as a reward's own None), and each step counts them in
  `reward/missing_solution` (completions).

>>> from mmgrpo.data.catalog import DatasetView
>>> rows = [{"query": "q", "solution": "a"}, {"query": "q"}, {"query": "q", "solution": None},
...         {"query": "q", "solution": float("nan")}, {"query": "q", "solution": " "}]
>>> rows_without_solution(DatasetView("toy", "train", rows))
[1, 2, 3, 4]
"""

from __future__ import annotations

import functools
import inspect

from mmgrpo.data.sample import is_missing
from mmgrpo.errors import DataError

SHOWN_ROWS = 5  # rows named in the start-up error; the rest are counted


def needs_solution(func) -> bool:
    """True when the reward cannot grade without a reference answer (see the module docstring).

    >>> needs_solution(lambda completions, solution, **columns: []), needs_solution(lambda completions, **columns: [])
    (True, False)
    """
    inner = func.func if isinstance(func, functools.partial) else func
    if getattr(inner, "needs_solution", None) is not None:
        return bool(inner.needs_solution)
    try:
        parameter = inspect.signature(func).parameters.get("solution")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def rows_without_solution(view) -> list[int]:
    """Positions in a `DatasetView` whose sample has no `solution` (None, NaN, blank or absent).

    An Arrow table with a `solution` column (after the entry's renames) is read as one column;
    other rows are normalised one by one, since a `response` may stand in for the solution."""
    rows = view.rows
    source = next((old for old, new in view.columns.items() if new == "solution"), "solution")
    names = getattr(rows, "column_names", None)
    positions = range(len(view))
    if names is not None and source in names:
        values = rows[source]  # one column, no row normalised
        indices = view.row_indices if view.row_indices is not None else positions
        return [i for i, row in zip(positions, indices) if is_missing(values[row])]
    return [i for i in positions if view[i].columns.get("solution") is None]


def check_solutions(dataset, rewards, mode: str) -> None:
    """--missing_solution error: a DataError naming each dataset's rows without a solution that a
    reward of the run's `RewardSet` needing one would score (a mixture's routes say which apply)."""
    if mode != "error":
        return
    specs = rewards.specs or rewards.names
    needing = [(spec, name) for spec, name, func in zip(specs, rewards.names, rewards.funcs) if needs_solution(func)]
    for view in getattr(dataset, "sources", [dataset]):
        used = [name for spec, name in needing if not rewards.routes or spec in rewards.routes.get(view.name, specs)]
        if not used:
            continue
        missing = rows_without_solution(view)
        if missing:
            ids = ", ".join(view[i].id for i in missing[:SHOWN_ROWS])
            more = f" and {len(missing) - SHOWN_ROWS} more" if len(missing) > SHOWN_ROWS else ""
            raise DataError(
                f"dataset {view.name} (split {view.split}): {len(missing)} of {len(view)} rows have no solution "
                f"({ids}{more}), which {', '.join(used)} need{'s' if len(used) == 1 else ''} to grade an answer; add "
                "it, drop those rows, or pass --missing_solution skip to score them None for those rewards "
                "(counted as reward/missing_solution)"
            )
