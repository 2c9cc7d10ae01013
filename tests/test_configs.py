"""Every shipped config in configs/ reads as its command's options and passes the checks its
command makes before a model loads: the options, the training mixture, the evaluation datasets
and metrics, and the `--stop_at` metric."""

from pathlib import Path

import pytest

from mmgrpo.config import SFTConfig, TrainConfig
from mmgrpo.config.checks import parse_stop_at
from mmgrpo.config.flags import build_parser, config_from_namespace
from mmgrpo.data.catalog import mix_datasets
from mmgrpo.training.build import training_eval
from mmgrpo.training.startup_checks import check_sft_flags, check_train_flags

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_a_shipped_config_passes_its_commands_start_up_checks(path):
    cls = TrainConfig if "grpo" in path.stem else SFTConfig
    cfg = config_from_namespace(cls, build_parser(cls).parse_args(["--config", str(path)]))
    (check_train_flags if cls is TrainConfig else check_sft_flags)(cfg)
    assert len(mix_datasets(cfg.data.dataset, split=cfg.data.split, extra_files=cfg.data.dataset_registry)) > 0
    evaluator = training_eval(cfg)  # resolves every eval dataset and metric
    if getattr(cfg, "stop_at", None):
        assert parse_stop_at(cfg.stop_at)[0] in evaluator.metric_names()
