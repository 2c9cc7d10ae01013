"""The options of `mmgrpo train` and `mmgrpo sft`: what they are, how flags and YAML set them, what is checked.

    schema.py   the nested dataclasses (TrainConfig, SFTConfig and their sections), a docstring per field
    domains.py  `flag(default, domain, resume=...)`: each field's values and resume kind, beside it; `check_domains`
    flags.py    those dataclasses as command-line flags and `--config` YAML; `--help` from the docstrings
    checks.py   the rules between flags (`validate_train`, `validate_sft`) and the flags with a syntax of their own
    server.py   `mmgrpo rollout-server`'s flags (its parser, read before torch and vLLM load)

The checks that need a part (a registered loss, vLLM installed, the world size) are
mmgrpo/training/startup_checks.py's: config/ imports only mmgrpo.errors, mmgrpo.registry and mmgrpo.runstate.

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
