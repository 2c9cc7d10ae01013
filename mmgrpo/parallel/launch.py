"""Processes, ranks and devices: what torchrun (or the deepspeed launcher) gives a run.

    rank, world_size, local_rank, created = init_process_group(timeout_s=1800, sharded=True)
    device = pick_device(local_rank)
    bf16 = configure_precision(device, requested_bf16)
    with rank_errors(): train(cfg)          # an error names its rank; a timed-out collective says why
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from mmgrpo.errors import MMGRPOError


def env_world_size() -> int:
    """Processes in this run as the launcher (torchrun, the deepspeed launcher) says; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def notice(text: str) -> None:
    """A one-line notice on stderr, from rank 0 only."""
    if env_rank() == 0:
        print(f"mmgrpo: {text}", file=sys.stderr, flush=True)


def init_process_group(timeout_s: float, sharded: bool) -> tuple[int, int, int, bool]:
    """(rank, world_size, local_rank, created): NCCL on GPUs, gloo on CPU, with a timeout.

    A rank that dies or hangs makes the others' next collective fail after `timeout_s` seconds
    instead of waiting forever. FSDP2 and ZeRO-3 need a group even in one process (a local one).
    """
    world_size = env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1 and not sharded:
        return 0, 1, local_rank, False
    if world_size == 1:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank, False
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), local_rank, True


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    # DeepSpeed (imported by transformers' saving and peft even without ZeRO) would otherwise warn on
    # every run that it found no accelerator; on this machine the CPU is the one it would pick anyway
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return torch.device("cpu")


def bf16_by_default() -> bool:
    """What --bf16 left unset means here: on where a CUDA GPU has bfloat16 (Ampere and later),
    off on the CPU and on older GPUs (float32)."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def configure_precision(device: torch.device, precision: str) -> str:
    """TF32 matmuls on Ampere+; bf16 only where the device supports it (a notice otherwise).

    Returns the precision the run computes in: `precision`, or `fp32` where bf16 is missing.
    """
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device)[0] >= 8:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            notice(f"{torch.cuda.get_device_name(device)} has no bfloat16: --bf16 ignored, training in float32.")
            return "fp32"
    elif device.type == "cpu" and env_world_size() > 1:
        notice("no GPU: training on CPU, ranks talk over gloo.")
    return precision


@contextmanager
def rank_errors():
    """Under a launcher, errors name their rank; a collective that timed out says what to look for.

    Wrap a command's body: `with rank_errors(): train(cfg)`.
    """
    world_size = env_world_size()
    if world_size == 1:
        yield
        return
    where = f"rank {env_rank()} of {world_size}"
    try:
        yield
    except MMGRPOError as err:
        raise type(err)(f"{where}: {err}") from None
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        hint = ""
        if "timed out" in text.lower() or "timeout" in text.lower() or "connection" in text.lower():
            hint = (" Another rank probably died (its error is above) or hung; collectives wait "
                    "--ddp_timeout seconds for the others.")
        print(f"mmgrpo: {where} failed: {type(err).__name__}: {text}.{hint}", file=sys.stderr, flush=True)
        raise
