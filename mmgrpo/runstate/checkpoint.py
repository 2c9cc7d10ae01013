"""Checkpoint folders that are complete or absent, never half-written.

    pending = save_atomically(out / "checkpoint-8", write)   # write(folder) fills a staging folder
    pending.wait()                                            # returns at once unless background=True
    latest_checkpoint(out)                                    # out/checkpoint-8: the newest complete one
    check_checkpoint(out / "checkpoint-8")                    # CheckpointError if incomplete or truncated

A save, in order:
  1. awaits the previous save into the same folder, then repairs what a killed save left: a
     finished staging folder whose rename did not happen is renamed into place; other
     `checkpoint-N.tmp` / `*.old` folders are deleted;
  2. `write(staging)` writes every file into `<name>.tmp/` beside the target;
  3. every file and folder of it is fsynced, then `checkpoint_complete.json` (each file with its
     size and sha256) is written and fsynced: the marker comes last, so its presence means the data
     is on disk; the sizes are checked whenever checkpoints are listed, the checksums before a resume
     (`check_checkpoint(path, checksums=True)`), so a file corrupted since is never trained on;
  4. the staging folder is renamed to `<name>`. A target that exists already (`checkpoint-best`,
     a step saved again after a resume) is swapped with it in one atomic exchange
     (renameat2 RENAME_EXCHANGE on Linux; elsewhere two renames that step 1 repairs), and the old
     folder is deleted only after the new one is in place;
  5. the output folder is fsynced and `keep_last` (--save_total_limit) removes the oldest
     complete numbered checkpoints beyond the newest N; `checkpoint-best` is its own folder and stays.

A save that fails (a full disk: one line naming the folder, the bytes needed and the checkpoints
kept; a folder turned read-only: one line naming it and the checkpoints kept;
mmgrpo/runstate/disk_space.py) removes its staging folder. A kill at any instant leaves every
earlier checkpoint loadable, and `latest_checkpoint`, the
loaders and rotation skip a folder without the marker (with a one-line warning). With
`background=True` steps 2-5 run in a thread: the caller hands over data it will not modify
(`mmgrpo.runstate.state` copies tensors first) and training goes on; the thread is not a daemon,
so the interpreter waits for it at exit, and the next save into the same folder awaits it first.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mmgrpo.errors import CheckpointError
from mmgrpo.runstate.disk_space import disk_full_error, unwritable_error

MARKER = "checkpoint_complete.json"
STAGING_SUFFIX = ".tmp"  # a save in progress (or killed)
ASIDE_SUFFIX = ".old"  # a replaced checkpoint waiting for deletion (fallback path only)
DELETING_SUFFIX = ".deleting"  # a rotated-out checkpoint being deleted: never restored, always removed
NUMBERED = re.compile(r"^checkpoint-(\d+)$")
FORMAT_VERSION = 1
logger = logging.getLogger("mmgrpo.runstate.checkpoint")  # one line on stderr, no stack

_IN_FLIGHT: dict[Path, PendingSave] = {}  # output folder -> its save running in the background
_IN_FLIGHT_LOCK = threading.Lock()


class PendingSave:
    """A save that may still be running: `wait()` returns its folder or raises its error."""

    def __init__(self, path: Path, thread: threading.Thread | None = None):
        self.path, self.thread = path, thread
        self.error: BaseException | None = None
        self.seconds = 0.0  # time the write, sync and rename took (in the thread when in background)

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> Path:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None  # raised once
            raise error
        return self.path


# ---- saving ------------------------------------------------------------------------------------


def save_atomically(
    path: str | os.PathLike, write: Callable[[Path], None], *, background: bool = False, keep_last: int | None = None,
    needed_bytes: int | None = None,
) -> PendingSave:
    """Write a checkpoint folder through a staging folder, a completeness marker and a rename.

    write(folder): writes the checkpoint's files into `folder` (which exists and is empty).
    background: run write/sync/rename in a thread and return at once; `wait()` the result.
    keep_last: after the rename, delete the oldest complete `checkpoint-N` beyond the newest N.
    needed_bytes: the checkpoint's expected size, named when the disk fills up (default: what was written).

    >>> import tempfile
    >>> scratch = tempfile.TemporaryDirectory(); out = Path(scratch.name)  # removed with `scratch`
    >>> _ = save_atomically(out / "checkpoint-1", lambda d: (d / "w.txt").write_text("one")).wait()
    >>> _ = save_atomically(out / "checkpoint-2", lambda d: (d / "w.txt").write_text("two"), keep_last=1).wait()
    >>> sorted(p.name for p in out.iterdir()), latest_checkpoint(out).name
    (['checkpoint-2'], 'checkpoint-2')
    """
    path = Path(path)
    try:
        staging = prepare_staging(path)
    except OSError as err:  # the folder turned read-only: nothing was written, the earlier checkpoints stay
        kept = [p.name for p in list_checkpoints(path.parent, warn=False)]
        raise unwritable_error(err, path, kept) or err from None
    pending = PendingSave(path)

    def finish():
        start = time.perf_counter()
        try:
            write(staging)
            commit(staging, path)
            if keep_last:
                rotate_checkpoints(path.parent, keep_last)
        except BaseException as err:  # noqa: B036 (a KeyboardInterrupt also leaves no staging folder)
            written, free = staged_bytes(staging), shutil.disk_usage(path.parent).free  # before the partial save goes
            shutil.rmtree(staging, ignore_errors=True)
            kept = [p.name for p in list_checkpoints(path.parent, warn=False)]
            pending.error = (disk_full_error(err, path, needed_bytes or written, kept, written, free)
                             or unwritable_error(err, path, kept) or err)
        finally:
            pending.seconds = time.perf_counter() - start

    if not background:
        finish()
        pending.wait()  # raises the write's error here
        return pending
    pending.thread = threading.Thread(target=finish, name=f"save {path.name}", daemon=False)
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[path.parent.resolve()] = pending
    pending.thread.start()
    return pending


def staged_bytes(staging: Path) -> int:
    """Bytes a save wrote into `staging` so far."""
    return sum(f.stat().st_size for f in staging.rglob("*") if f.is_file()) if staging.is_dir() else 0


def prepare_staging(path: Path) -> Path:
    """Await the folder's running save, repair what killed saves left, and return an empty
    staging folder `<path>.tmp` for `path` (steps 1-2 of a save; `commit` is the rest)."""
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    wait_for_saves(parent)  # one save at a time per folder: the repair must not touch a live one
    repair_interrupted(parent)
    staging = path.with_name(path.name + STAGING_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def wait_for_saves(folder: str | os.PathLike | None = None) -> None:
    """Await the background save into `folder` (every folder when None); raises its error."""
    with _IN_FLIGHT_LOCK:
        if folder is None:
            pendings = list(_IN_FLIGHT.values())
            _IN_FLIGHT.clear()
        else:
            pending = _IN_FLIGHT.pop(Path(folder).resolve(), None)
            pendings = [pending] if pending is not None else []
    for pending in pendings:
        pending.wait()


def commit(staging: Path, path: Path) -> None:
    """fsync `staging`, write the marker, and move it to `path` (swapping with an existing one)."""
    sizes = sync_tree(staging)
    manifest = {"format": FORMAT_VERSION, "files": sizes, "sha256": file_digests(staging, list(sizes))}
    marker = staging / MARKER
    with open(marker, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(staging)
    if not path.exists():
        os.rename(staging, path)
    elif exchange(staging, path):  # `staging` now holds the old checkpoint
        shutil.rmtree(staging)
    else:
        aside = path.with_name(path.name + ASIDE_SUFFIX)
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)  # a kill here: repair_interrupted puts the finished staging folder in place
        os.rename(staging, path)
        shutil.rmtree(aside)
    fsync_dir(path.parent)


def sync_tree(folder: Path) -> dict[str, int]:
    """fsync every file and subfolder under `folder`; returns {relative path: size in bytes}."""
    sizes = {}
    for root, dirs, files in os.walk(folder):
        for name in sorted(files):
            file = Path(root) / name
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            sizes[file.relative_to(folder).as_posix()] = file.stat().st_size
        for name in dirs:
            fsync_dir(Path(root) / name)
    return sizes


def file_digest(file: Path) -> str:
    """The sha256 of a file, read in 16 MiB blocks (the file was just written: it is in the page cache)."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def file_digests(folder: Path, names: list[str]) -> dict[str, str]:
    """{name: sha256} of files under `folder`, hashed in parallel (hashlib releases the GIL: about
    1.8 GB/s per core with SHA extensions, so a shard or optimizer file per core)."""
    from concurrent.futures import ThreadPoolExecutor

    if len(names) < 2:
        return {name: file_digest(folder / name) for name in names}
    with ThreadPoolExecutor(max_workers=min(8, len(names), os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda name: file_digest(folder / name), names)))


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (new files, renames) durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms that cannot open folders (Windows)
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EBADF):  # some file systems do not sync folders
            raise
    finally:
        os.close(fd)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # old kernel, or a file system without it
        return False
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def repair_interrupted(folder: str | os.PathLike) -> None:
    """Undo what a killed save left in `folder`.

    A complete `<name>.tmp` whose `<name>` is missing (killed between the marker and the rename,
    or between the two renames of the fallback path) is renamed into place; failing that, a
    complete `<name>.old` is put back. Every other `.tmp` / `.old` folder is deleted, and so is a
    `.deleting` one (a rotation killed while it deleted).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return
    restorable = repairable(folder)
    for leftover in sorted(folder.iterdir()):
        if not leftover.is_dir() or not leftover.name.endswith((STAGING_SUFFIX, ASIDE_SUFFIX, DELETING_SUFFIX)):
            continue
        target = folder / leftover.name.rsplit(".", 1)[0]
        if restorable.get(target) == leftover:
            os.rename(leftover, target)
            logger.warning(f"{target}: restored from {leftover.name}, left by a save that was interrupted")
        else:
            shutil.rmtree(leftover, ignore_errors=True)
    fsync_dir(folder)


def repairable(folder: str | os.PathLike) -> dict[Path, Path]:
    """{checkpoint: the leftover `repair_interrupted` would rename to it}: complete `.tmp` / `.old`
    folders whose checkpoint is missing (a `.tmp` first: it is the newer). Reads only, so a rank
    that must not write yet can know which checkpoints the repair will give."""
    folder = Path(folder)
    found: dict[Path, Path] = {}
    for suffix in (STAGING_SUFFIX, ASIDE_SUFFIX):
        for leftover in sorted(folder.glob(f"*{suffix}")):
            target = folder / leftover.name.rsplit(".", 1)[0]
            if leftover.is_dir() and target not in found and not target.exists() and is_complete(leftover):
                found[target] = leftover
    return found


def rotate_checkpoints(folder: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete the oldest complete `checkpoint-N` folders beyond the newest `keep_last`; returns them.

    Incomplete folders are not counted and not touched; `checkpoint-best` is not numbered.
    """
    numbered = list_checkpoints(folder, warn=False)
    removed = numbered[:-keep_last] if keep_last > 0 else []
    for old in removed:
        # Renamed first, in one step: a kill during the deletion then leaves `checkpoint-N.deleting`,
        # which no reader counts and the next save's repair removes, not a half-deleted
        # `checkpoint-N` that rotation would skip as incomplete for ever.
        doomed = old.with_name(old.name + DELETING_SUFFIX)
        os.rename(old, doomed)
        shutil.rmtree(doomed)
    return removed


# ---- finding and checking ----------------------------------------------------------------------


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The N of a `checkpoint-N` folder name, else None."""
    match = NUMBERED.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(folder: str | os.PathLike, *, warn: bool = True) -> list[Path]:
    """The complete `checkpoint-N` folders in `folder`, oldest first; incomplete ones are skipped
    with a one-line warning each (when `warn`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        step = checkpoint_step(path)
        if step is None or not path.is_dir():
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            found.append((step, path))
        elif warn:
            logger.warning(f"skipping {path}: {problem}")
    return [path for _, path in sorted(found)]


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The complete `checkpoint-N` with the largest N in `folder` (None if there is none)."""
    checkpoints = list_checkpoints(folder)
    return checkpoints[-1] if checkpoints else None


def is_complete(path: str | os.PathLike) -> bool:
    return checkpoint_problem(path) is None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with a checkpoint folder, in a few words; None when it is complete."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        return f"incomplete (no {MARKER}: its save did not finish)"
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError, OSError):
        return f"{MARKER} is unreadable"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, {size} when it was saved (truncated or overwritten)"
    return None


def corrupt_file(path: str | os.PathLike) -> str | None:
    """What is corrupt in a complete checkpoint, in a few words: the first file whose sha256 is not
    the one its save recorded (the bytes changed after the save, at the same size: a bad disk, a copy
    gone wrong, an edit); None when every file matches, or for a checkpoint saved without checksums.
    Reads every file: call it before a resume, not when listing checkpoints."""
    path = Path(path)
    try:
        digests = json.loads((path / MARKER).read_text()).get("sha256") or {}
    except (ValueError, OSError, AttributeError):
        return f"{MARKER} is unreadable"
    found = file_digests(path, [name for name in digests if (path / name).is_file()])
    for name, digest in digests.items():
        if found.get(name) != digest:
            return f"{name} does not match the checksum recorded when it was saved (corrupted since)"
    return None


def check_checkpoint(path: str | os.PathLike, *, checksums: bool = False) -> Path:
    """`path` if it is a complete checkpoint, else a one-line CheckpointError naming the newest
    complete sibling to use instead. checksums: also compare every file with its recorded sha256
    (`corrupt_file`; what a resume does before it reads anything)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such folder")
    problem = checkpoint_problem(path)
    if problem is None and checksums:
        problem = corrupt_file(path)
    if problem is None:
        return path
    others = [p for p in list_checkpoints(path.parent, warn=False) if p != path]
    hint = f"; the newest complete one is {others[-1]}" if others else ""
    raise CheckpointError(f"checkpoint {path} is {problem if problem.startswith('incomplete') else 'damaged: ' + problem}{hint}")
