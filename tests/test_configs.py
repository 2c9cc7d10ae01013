"""Every shipped config in configs/ reads as its command's options and passes their checks."""

from pathlib import Path

import pytest

from mmgrpo.config import SFTConfig, TrainConfig
from mmgrpo.config_args import build_parser, config_from_namespace
from mmgrpo.config_checks import parse_stop_at
from mmgrpo.data.registry import resolve_dataset

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_a_shipped_config_reads_and_names_real_datasets(path):
    cls = TrainConfig if "grpo" in path.stem else SFTConfig
    cfg = config_from_namespace(cls, build_parser(cls).parse_args(["--config", str(path)]))
    cfg.validate()
    for spec in [*cfg.data.dataset, *cfg.eval.eval_dataset]:
        name = spec.rsplit(":", 1)[0] if spec.rsplit(":", 1)[-1].replace(".", "").isdigit() else spec
        assert len(resolve_dataset(name)) > 0, spec
    if getattr(cfg, "stop_at", None):
        assert parse_stop_at(cfg.stop_at)[0] in ("vqa_accuracy", "answer_format", "loss")
