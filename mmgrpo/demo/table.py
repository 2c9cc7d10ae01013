"""The demo's result table: each task's held-out score at the start and after GRPO, in 80 columns.

    from mmgrpo.demo.table import TaskResult, result_table
    console.print(result_table([TaskResult("shapes-color", "vqa_accuracy", 0.45, 0.98, 0.53, 0.49, 0.57, 1e-4, 0.40)]))

A row wraps onto a second line (the metric under the dataset, the verdict under the difference)
rather than cutting a name short. The verdict reads the 95% interval: "better" or "worse" when it
excludes 0, "no significant change" when it spans 0. The last column is what the demo aims to show
for the task, not a pass or fail.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.table import Table

SIGNIFICANCE = 0.01  # the p-value under which the demo calls a lift shown


@dataclass
class TaskResult:
    """One task's comparison, as `mmgrpo.eval.compare` gives its row for the demo's metric."""

    dataset: str
    metric: str
    start: float
    after: float
    diff: float
    ci_low: float
    ci_high: float
    p: float
    aim: float
    """The lift the demo aims to show for this task (at p < SIGNIFICANCE)."""


def verdict(ci_low: float, ci_high: float) -> str:
    """What a difference's 95% interval says.

    >>> verdict(0.49, 0.57), verdict(-0.05, 0.02), verdict(-0.08, -0.01)
    ('better', 'no significant change', 'worse')
    """
    if ci_low > 0:
        return "better"
    if ci_high < 0:
        return "worse"
    return "no significant change"


def result_table(results: list[TaskResult], samples: int | None = None) -> Table:
    """The table of `results`, under 80 columns wide with every name whole."""
    title = "Held-out test split" + (f", {samples} samples a task" if samples else "") + ": the start and after GRPO"
    table = Table(title=title, box=box.SIMPLE_HEAD, caption=(
        f"The demo aims to show each score up by the last column, at p < {SIGNIFICANCE}."
    ))
    table.add_column("dataset\nmetric", no_wrap=True)
    table.add_column("start", justify="right", no_wrap=True)
    table.add_column("after\nGRPO", justify="right", no_wrap=True)
    table.add_column("difference\n[95% interval]", no_wrap=True)
    table.add_column("p", justify="right", no_wrap=True)
    table.add_column("the demo\naims at", justify="right", no_wrap=True)
    for r in results:
        table.add_row(
            f"{r.dataset}\n{r.metric}",
            f"{r.start:.3f}",
            f"{r.after:.3f}",
            f"{r.diff:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]\n{verdict(r.ci_low, r.ci_high)}",
            f"{r.p:.2g}",
            f"{r.aim:+.2f}",
        )
    return table
