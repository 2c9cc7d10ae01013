"""Experiment trackers a run reports to (`--report_to tensorboard wandb mlflow`), beside metrics.jsonl.

Each tracker gets every step's metrics and the step's completions table (the prompts, their G
completions and each reward, as completions.jsonl holds them):

- `tensorboard`: event files in the run folder (scalars only);
- `wandb`: `wandb.init(project=$WANDB_PROJECT or "mmgrpo", name=--run_name or the run folder's name, dir=<run folder>)`,
  scalars with `run.log(step=...)`, the table as `completions`; `WANDB_MODE=offline` writes under
  <run folder>/wandb/ with no account or network (`wandb sync` uploads it later);
- `mlflow`: a run in experiment $MLFLOW_EXPERIMENT_NAME (default "mmgrpo") at $MLFLOW_TRACKING_URI,
  default a file store in <run folder>/mlruns (`mlflow ui --backend-store-uri <run folder>/mlruns`);
  flattened options as params, scalars as metrics (`/` becomes `.`: MLflow's file store makes folders
  of slashes, so `reward` and `reward/format` would collide; other characters it refuses become `_`),
  the table as `completions/step_<N>.json` artifacts.

    >>> mlflow_metric_name("reward/reward_model:rm@1")
    'reward.reward_model_rm_1'
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mmgrpo.errors import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")
TABLE_COLUMNS = ["step", "sample_id", "prompt", "completion", "reward", "advantage", "rewards"]


def report_targets(report_to) -> list[str]:
    """--report_to as a list of trackers; `none` alone means only metrics.jsonl.

    >>> report_targets("tensorboard"), report_targets(["wandb", "mlflow"]), report_targets(["none"])
    (['tensorboard'], ['wandb', 'mlflow'], [])
    """
    targets = [report_to] if isinstance(report_to, str) else list(report_to or [])
    targets = [t for item in targets for t in str(item).replace(",", " ").split()]
    if targets == ["none"] or not targets:
        return []
    unknown = [t for t in targets if t not in TRACKERS]
    if unknown:
        raise ConfigError(f"--report_to {' '.join(targets)}: {', '.join(map(repr, unknown))} is not one of "
                          f"{', '.join(TRACKERS)} (or none alone).")
    return list(dict.fromkeys(targets))


def table_rows(records: list[dict]) -> list[list]:
    """One row per completion of the step's records (completions.jsonl's objects)."""
    rows = []
    for record in records:
        prompt = json.dumps(record.get("prompt"), default=str)
        for i, completion in enumerate(record.get("completions", [])):
            rewards = {name: values[i] for name, values in record.get("rewards", {}).items()}
            rows.append([record.get("step"), record.get("sample_id"), prompt, completion,
                         _at(record.get("reward"), i), _at(record.get("advantage"), i), json.dumps(rewards)])
    return rows


def _at(values, i):
    return values[i] if isinstance(values, list) and i < len(values) else None


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None and k != "step"}


class TensorBoardTracker:
    def __init__(self, output_dir: Path, options: dict, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # resuming: the crashed run's events after the resumed step are hidden (purge_step)
        self.writer = SummaryWriter(str(output_dir), purge_step=None if resume_step is None else resume_step + 1)

    def log(self, metrics: dict, records: list[dict], step: int) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, output_dir: Path, options: dict, resume_step: int | None = None):
        wandb = _require("wandb", "wandb")
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mmgrpo"), name=options.get("run_name") or Path(output_dir).name,
                              dir=str(output_dir), config=options, reinit="finish_previous")

    def log(self, metrics: dict, records: list[dict], step: int) -> None:
        payload = dict(_scalars(metrics))
        if records:
            payload["completions"] = self.wandb.Table(columns=TABLE_COLUMNS, data=table_rows(records))
        self.run.log(payload, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before W&B's service has written the history to the run file (seen on a
        # loaded machine: the file held its header only); teardown waits for the service to close it.
        self.wandb.teardown()


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. ]")


def mlflow_metric_name(name: str) -> str:
    return _MLFLOW_BAD.sub("_", name.replace("/", "."))


def _flatten(options: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in options.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]  # MLflow caps a param value's length
    return out


class MlflowTracker:
    def __init__(self, output_dir: Path, options: dict, resume_step: int | None = None):
        mlflow = _require("mlflow", "mlflow-skinny")
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps the file store in maintenance mode behind this switch; a local folder
            # needs no server or database, which is what a training run on its own wants
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(output_dir).resolve() / "mlruns").as_uri()
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "mmgrpo"))
        self.run = mlflow.start_run(run_name=options.get("run_name") or Path(output_dir).name)
        mlflow.log_params(_flatten(options))

    def log(self, metrics: dict, records: list[dict], step: int) -> None:
        self.mlflow.log_metrics({mlflow_metric_name(k): v for k, v in _scalars(metrics).items()}, step=step)
        if records:
            columns = {name: [row[i] for row in table_rows(records)] for i, name in enumerate(TABLE_COLUMNS)}
            self.mlflow.log_table(data=columns, artifact_file=f"completions/step_{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def _require(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"--report_to {module} needs the {package} package: pip install {package} "
                          "(pinned in requirements.txt)") from None


def make_trackers(output_dir: Path, options: dict, report_to: str | list[str], resume_step: int | None = None) -> list:
    """The trackers --report_to names, each given the run's options (a nested dict: W&B's config,
    MLflow's params). A resumed run (resume_step) starts a new W&B / MLflow run whose steps continue
    from the resumed one; TensorBoard hides the crashed run's later events."""
    classes = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
    trackers = []
    for name in report_targets(report_to):
        try:
            trackers.append(classes[name](output_dir, options, resume_step))
        except ImportError:  # tensorboard (the default) is optional outside the pinned set
            if name != "tensorboard":
                raise
    return trackers
