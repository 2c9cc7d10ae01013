"""What a run leaves behind, and the progress bar people watch.

output_dir/
    config.yaml         the resolved configuration; after a resume, what it changed from which step (`resumed:`)
    metrics.jsonl       one JSON object per step
    completions.jsonl   prompts, their G completions and every reward
    events.out.tfevents.*   TensorBoard scalars (same keys as metrics.jsonl)
    wandb/ , mlruns/    --report_to wandb / mlflow (offline W&B runs, MLflow's file store; mmgrpo/runstate/trackers.py)
    checkpoint-N/       HF folders (safetensors) that from_pretrained loads
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

console = Console(stderr=True, log_path=False)  # a step line says when, not which source line wrote it


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


def step_log_lines(metrics: dict, records=()) -> dict[str, str]:
    """A step's lines in each step log, as `RunLogger.log_step` writes them (a checkpoint keeps
    its step's too: mmgrpo.training.output_dir.restore_step_log)."""
    metrics = {k: _jsonable(v) for k, v in metrics.items()}
    return {
        "metrics.jsonl": json.dumps(metrics) + "\n",
        "completions.jsonl": "".join(json.dumps(record, default=str) + "\n" for record in records),
    }


def write_config(folder: Path, options: dict, resumed: list | None = None) -> None:
    """config.yaml: the flags the run trains with now (`options`, the configuration as a nested
    dict: `cfg.to_dict()`) and, after resumes, `resumed:`, what each one changed from which step
    (TrainState.resumed): the run's flags step by step. `--config config.yaml` reads the flags and
    skips `resumed`."""
    config = dict(options)
    if resumed:
        config["resumed"] = [{"after_step": r["after_step"], "changed": {k: list(v) for k, v in r["changed"].items()}}
                             for r in resumed]
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


class RunLogger:
    """options: the run's configuration as a nested dict (`cfg.to_dict()`), written to config.yaml
    and handed to the trackers `report_to` names (--report_to). resume_step: a resumed run
    continues after this step; TensorBoard hides the crashed run's events of later steps
    (SummaryWriter purge_step). The step logs are trimmed by
    mmgrpo.training.output_dir.OutputPlan.apply()."""

    def __init__(self, output_dir: Path, options: dict, report_to: str | list[str], resume_step: int | None = None,
                 resumed: list | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        write_config(self.dir, options, resumed)
        self.metrics_file = open(self.dir / "metrics.jsonl", "a")
        self.completions_file = open(self.dir / "completions.jsonl", "a")
        from mmgrpo.runstate.trackers import make_trackers

        self.trackers = make_trackers(self.dir, options, report_to, resume_step)  # --report_to: tensorboard, wandb, mlflow

    def log_step(self, metrics: dict, records: list[dict] = (), print_it: bool = True) -> None:
        metrics = {k: _jsonable(v) for k, v in metrics.items()}
        lines = step_log_lines(metrics, records)
        self.completions_file.write(lines["completions.jsonl"])
        self.completions_file.flush()
        self.metrics_file.write(lines["metrics.jsonl"])  # last: a step with its metrics line is logged whole
        self.metrics_file.flush()
        for tracker in self.trackers:
            tracker.log(metrics, list(records), metrics["step"])
        if print_it:
            keys = ["reward", "kl", "loss", "completion_length", "time/step"]
            shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), (int, float)))
            console.log(f"step {metrics['step']}  {shown}")

    def close(self) -> None:
        self.metrics_file.close()
        self.completions_file.close()
        for tracker in self.trackers:
            tracker.close()


class NullLogger:
    """The run logger of ranks other than 0: metrics are reduced over ranks and rank 0 writes them."""

    def log_step(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class _Bar:
    def __init__(self, progress: Progress, task, shown: str = "reward"):
        self.progress, self.task, self.shown = progress, task, shown

    def advance(self, metrics: dict, amount: int = 1) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=amount, value=metrics.get(self.shown or "", float("nan")),
                                 sps=metrics.get("time/step", float("nan")))


@contextmanager
def progress_bar(total: int, description: str, show: bool = True, completed: int = 0, shown: str | None = "reward",
                 unit: str = "step"):
    """A rich bar showing one metric (`shown`: the mean reward unless told; None: no metric) and
    seconds per `unit` from `time/step` (nothing when show is False)."""
    if not show:
        yield _Bar(None, None)
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn((f"{shown} {{task.fields[value]:.3f}}  " if shown else "") + f"{{task.fields[sps]:.2f}} s/{unit}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total, completed=completed, value=float("nan"), sps=float("nan"))
        yield _Bar(progress, task, shown)
