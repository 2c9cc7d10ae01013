"""Disk space for checkpoints: a warning at start-up when the output folder's disk cannot hold the
checkpoints the run keeps, and a disk that fills up during a save named in one line.

    needed = checkpoint_bytes(model, trainable_only=False)     # weights + AdamW's two moments, in bytes
    kept = checkpoints_kept(total_steps, save_steps=10, save_total_limit=2, keeps_best=True)
    warn_if_short(out, needed, kept)                           # one line on stderr, or nothing
    error = disk_full_error(err, path, needed, kept_names)     # a CheckpointError, or None for another error

The estimate is what a checkpoint writes: the saved weights (fp32 as trained; LoRA: the adapters),
AdamW's two moments of every weight that trains, and small files. The warning compares the free
space with the estimate x (checkpoints kept + 1): `--save_total_limit N` keeps N, and the next one is
written beside them before the oldest goes (atomic saves: mmgrpo/runstate/checkpoint.py).

>>> human(11_305_834)
'11.3 MB'
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path

import torch

from mmgrpo.errors import CheckpointError

FULL = (errno.ENOSPC, errno.EDQUOT)
# what libraries say instead of an errno: safetensors (Rust's StorageFull), torch's zip writer
FULL_TEXT = ("no space left on device", "storagefull", "disk quota exceeded", "file write failed")
SMALL_FILES = 1 << 20  # config, processor, tokenizer, RNG states, training state


def human(size: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def tensor_bytes(value) -> int:
    """Bytes of every tensor in a (nested) dict / list, as torch.save and safetensors write them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def checkpoint_bytes(model: torch.nn.Module, *, trainable_only: bool) -> int:
    """A training checkpoint's size, estimated from the model before it trains: the saved weights
    (fp32; `trainable_only`: LoRA's adapters) and two fp32 moments per trained weight (AdamW)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    saved = trained if trainable_only else sum(p.numel() for p in model.parameters())
    return 4 * saved + 8 * trained + SMALL_FILES


def checkpoints_kept(total_steps: int, save_steps: int, save_total_limit: int | None, keeps_best: bool) -> int:
    """How many checkpoints of a run can be on disk at once: one every `save_steps` (--save_steps; 0:
    the last only), at most `save_total_limit` of them, and checkpoint-best when the run `keeps_best`
    (it evaluates: --eval_dataset).

    >>> checkpoints_kept(100, save_steps=10, save_total_limit=None, keeps_best=False)
    11
    >>> checkpoints_kept(100, save_steps=10, save_total_limit=2, keeps_best=True)
    3
    """
    saves = total_steps // save_steps + 1 if save_steps else 1
    best = 1 if keeps_best else 0
    return min(saves, save_total_limit or saves) + best


def warn_if_short(folder: str | os.PathLike, needed: int, kept: int) -> str | None:
    """One line on stderr (returned too) when the disk of `folder` has less free space than
    `needed` x (`kept` + 1); None when there is room."""
    folder = Path(folder)
    free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    want = needed * (kept + 1)
    if free >= want:
        return None
    line = (f"mmgrpo: warning: {folder} has {human(free)} free; this run's checkpoints need about {human(want)} "
            f"({human(needed)} each x ({kept} kept + 1 being written)): free space, lower --save_total_limit, or give "
            "an --output_dir on a larger disk, or a save will fail")
    print(line, file=sys.stderr, flush=True)
    return line


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (or what it was raised from) says the disk or quota is full."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in FULL:
            return True
        if any(text in str(err).lower() for text in FULL_TEXT):
            return True
        err = err.__cause__ or err.__context__
    return False


UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
UNWRITABLE_TEXT = ("read-only file system", "permission denied")


def is_unwritable(err: BaseException) -> bool:
    """Whether `err` (or what it was raised from) says the folder cannot be written any more: a file
    system remounted read-only (a failing disk, an expired lease), or permissions taken away."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in UNWRITABLE:
            return True
        if any(text in str(err).lower() for text in UNWRITABLE_TEXT):
            return True
        err = err.__cause__ or err.__context__
    return False


def unwritable_error(err: BaseException, path: Path, kept: list[str]) -> CheckpointError | None:
    """A one-line CheckpointError for a save of `path` into a folder that turned read-only (or lost its
    write permission) during the run, naming the checkpoints that are kept; None for another error."""
    if not is_unwritable(err):
        return None
    reason = getattr(err, "strerror", None) or str(err)
    return CheckpointError(
        f"not saving {Path(path).name}: {Path(path).parent} cannot be written any more ({reason}); "
        f"{', '.join(kept) or 'no earlier checkpoint'} {'are' if len(kept) > 1 else 'is'} kept. Make the folder "
        "writable again (or copy the run to one that is), then resume with --resume_from_checkpoint latest"
    )


def disk_full_error(err: BaseException, path: Path, needed: int, kept: list[str], written: int = 0,
                    free: int | None = None) -> CheckpointError | None:
    """A one-line CheckpointError for a save of `path` that failed on a full disk (None otherwise):
    the folder, the free space, the bytes the checkpoint needs and the checkpoints that are kept
    (`kept`: their names, listed by the caller after the partial save is removed).

    Full: the error says so, or, at the failure (`free`, measured before the partial save is
    removed), less space was left than the `needed - written` bytes still to write: torch's writer
    fails with "basic_ios::clear: iostream error" and "unexpected pos", never naming the disk.
    Call it after the partial save is removed."""
    if not (is_disk_full(err) or (free is not None and free < max(needed - written, SMALL_FILES))):
        return None
    folder = Path(path).parent
    free = shutil.disk_usage(folder).free
    return CheckpointError(
        f"not saving {path.name}: the disk of {folder} is full ({human(free)} free; this checkpoint needs about "
        f"{needed:,} bytes, {human(needed)}); the partial save was removed, {', '.join(kept) or 'no earlier checkpoint'} "
        f"{'are' if len(kept) > 1 else 'is'} kept. Free space or give an --output_dir on a larger disk, then resume "
        "with --resume_from_checkpoint latest"
    )
