"""Training beyond one process: `--parallel none | fsdp2 | zero3` (docs/distributed.md).

`build_strategy(cfg.dist, cfg.optim, cfg.precision)` opens the process group and returns the strategy
the training step calls; see mmgrpo/parallel/base.py for the interface.

    base.py      the Strategy interface, its collectives, Prepared, the Wrapper module
    single.py    one process          fsdp2.py   PyTorch FSDP2          zero3.py   DeepSpeed ZeRO-3
    launch.py    process group, device, precision, per-rank errors
    checks.py    flag combinations, before any model loads
    media.py     the blank medium that keeps ranks' tower calls equal
"""

from mmgrpo.config import DistConfig, OptimConfig
from mmgrpo.parallel.base import Prepared, Strategy
from mmgrpo.parallel.compatibility import validate_parallel
from mmgrpo.parallel.launch import configure_precision, init_process_group, pick_device, rank_errors

__all__ = ["Prepared", "Strategy", "build_strategy", "rank_errors", "validate_parallel"]


def build_strategy(dist_cfg: DistConfig, optim_cfg: OptimConfig, precision: str) -> Strategy:
    """The strategy the flags name (`dist_cfg.strategy`; SFT, one process, passes `DistConfig()`),
    with the process group up and the device chosen. optim_cfg: the batch sizes and clipping ZeRO-3's
    config repeats; precision: `bf16` (--bf16, where the device supports it), `fp16` (--fp16) or `fp32`."""
    name = dist_cfg.strategy
    rank, world_size, local_rank, created = init_process_group(dist_cfg.ddp_timeout, sharded=name != "none")
    device = pick_device(local_rank)
    kwargs = dict(rank=rank, world_size=world_size, local_rank=local_rank, device=device, owns_group=created,
                  precision=configure_precision(device, precision))
    if name == "fsdp2":
        from mmgrpo.parallel.fsdp2 import FSDP2

        strategy = FSDP2(dist_cfg, **kwargs)
        if dist_cfg.sequence_parallel_size > 1:
            from mmgrpo.forward.sequence_parallel import new_sequence_group

            strategy.split_sequences(new_sequence_group(dist_cfg.sequence_parallel_size), dist_cfg.sequence_parallel_size)
        return strategy
    if name == "zero3":
        from mmgrpo.parallel.zero3 import ZeRO3

        return ZeRO3(dist_cfg, optim_cfg, **kwargs)
    from mmgrpo.parallel.single import SingleProcess

    return SingleProcess(dist_cfg, **kwargs)
