"""--report_to wandb and mlflow, offline (W&B offline mode, an MLflow file store), with the completions table."""

import json

import pytest

from mmgrpo.config import TrainConfig
from mmgrpo.engine import train
from mmgrpo.runstate.trackers import report_targets

FAST = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "2",
        "--per_device_train_batch_size", "4", "--max_completion_length", "6", "--dataloader_num_workers", "0",
        "--reward_funcs", "vqa_accuracy", "--max_steps", "2"]


def test_one_run_reports_to_wandb_and_mlflow_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    train(TrainConfig.from_args([*FAST, "--report_to", "wandb", "mlflow", "--run_name", "colour-g2", "--output_dir", str(out)]))

    # W&B: an offline run in the run folder, its history holding the metrics, the table as a media file
    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    history = next(wandb_run.glob("run-*.wandb")).read_bytes()
    assert b"reward/vqa_accuracy" in history and b"completion_length" in history
    tables = sorted(wandb_run.glob("files/media/table/completions_*.table.json"))
    assert len(tables) == 2  # one per step
    table = json.loads(tables[0].read_text())
    assert table["columns"][:4] == ["step", "sample_id", "prompt", "completion"] and len(table["data"]) == 4  # B x G

    # MLflow: the default file store in the run folder, read back with MLflow's own client
    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "mmgrpo"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "colour-g2" and run.data.params["rollout.num_generations"] == "2"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == [1, 2]
    assert client.get_metric_history(run.info.run_id, "reward.vqa_accuracy")  # "/" -> "."
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "completions")]
    assert artifacts == ["completions/step_000001.json", "completions/step_000002.json"]


def test_report_to_takes_several_and_none():
    assert TrainConfig.from_args(FAST).report_to == ["tensorboard"]
    assert report_targets(TrainConfig.from_args([*FAST, "--report_to", "none"]).report_to) == []
    assert report_targets("tensorboard,wandb") == ["tensorboard", "wandb"]
    from mmgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="or none alone"):
        report_targets(["none", "wandb"])
