"""Training beyond one process: `--parallel none | fsdp2 | zero3` (docs/distributed.md).

`build_strategy(cfg)` opens the process group and returns the strategy the engine calls; see
mmgrpo/parallel/base.py for the interface.
"""

from mmgrpo.parallel.base import NullLogger, Strategy, build_strategy, rank_errors, validate_parallel

__all__ = ["NullLogger", "Strategy", "build_strategy", "rank_errors", "validate_parallel"]
