"""The options of `mmgrpo train` and `mmgrpo sft`: what they are, how flags and YAML set them, what is checked.

    schema.py   the nested dataclasses (TrainConfig, SFTConfig and their sections), a docstring per field
    flags.py    those dataclasses as command-line flags and `--config` YAML; `--help` from the docstrings
    checks.py   every contradiction found before a model loads (`validate_train`, `validate_sft`)

    >>> from mmgrpo.config import TrainConfig
    >>> TrainConfig.from_args(["--num_generations", "4"]).rollout.num_generations
    4
"""

from mmgrpo.config.schema import (
    AlgoConfig,
    DataConfig,
    DistConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RunOptions,
    SFTConfig,
    TrainConfig,
)

__all__ = [
    "AlgoConfig", "DataConfig", "DistConfig", "EvalConfig", "ModelConfig", "OptimConfig", "RolloutConfig",
    "RunOptions", "SFTConfig", "TrainConfig",
]
