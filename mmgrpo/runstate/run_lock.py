"""One run per output folder: a lock file held for the run's life.

    lock = RunLock.acquire(out)      # ConfigError naming the other run if one is alive there
    ...                              # the run: its checkpoints, logs, config.yaml
    lock.release()                   # the file goes (also at exit, if the run ends by an error)

The lock is `out/.mmgrpo-run.lock`: one JSON line {pid, host, started} under a POSIX record lock
(`fcntl.lockf`), which the kernel drops when its process ends, however it ends (kill -9 included),
and which child processes (DataLoader workers) do not inherit. Taking it:

| what is there | then |
|---|---|
| no lock file, or one nobody holds | taken; a file naming another process (a run killed before it could remove it) is stale: taken over with one line naming that run |
| a file held by a live process | refused: a ConfigError naming its pid, host and start time |
| a file system without record locks (some network mounts) | the recorded pid decides on this host (alive: refused; gone: taken over); a lock from another host is refused, naming the file to delete if that run is known to be gone |

All ranks of a torchrun job are one run: rank 0 takes the lock before any rank writes
(mmgrpo/training/output_dir.py `preflight`), and the others wait at the barrier after `build_run`.
A second `acquire` of a folder in the process holding it returns the same lock.

>>> import tempfile
>>> scratch = tempfile.TemporaryDirectory(); folder = Path(scratch.name)  # removed with `scratch`
>>> lock = RunLock.acquire(folder)
>>> read_holder(folder)["pid"] == os.getpid(), RunLock.acquire(folder) is lock
(True, True)
>>> lock.release(); (folder / LOCK_FILE).exists()
False
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from mmgrpo.errors import ConfigError

LOCK_FILE = ".mmgrpo-run.lock"
_HELD: dict[Path, RunLock] = {}  # this process's locks by file; closing another descriptor of one would drop it
NO_RECORD_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLock:
    """This process's hold on an output folder (`acquire`, `release`)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, folder: str | os.PathLike) -> RunLock:
        """Take the folder's lock, or raise a one-line ConfigError naming the run that holds it."""
        path = Path(folder).resolve() / LOCK_FILE
        if path in _HELD:
            return _HELD[path]
        for _ in range(20):  # the file can be removed by the run that held it between our open and our lock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                holder = _read(fd)
                if not _lock(fd, holder, path):
                    raise ConfigError(_refusal(path, holder))
                if not _same_file(fd, path):  # we locked a file that was removed meanwhile: try the new one
                    os.close(fd)
                    continue
            except BaseException:
                os.close(fd)
                raise
            holder = _read(fd)  # as it is now that we hold it
            if holder.get("pid") not in (None, os.getpid()) or holder.get("host", _host()) != _host():
                print(f"mmgrpo: {path.parent}: the run that held it ({_describe(holder)}) is gone; taking over its lock",
                      file=sys.stderr, flush=True)
            _write(fd, {"pid": os.getpid(), "host": _host(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z")})
            lock = _HELD[path] = cls(path, fd)
            return lock
        raise ConfigError(f"{path}: the lock file keeps changing (another run starting or ending there); try again")

    def release(self) -> None:
        """Remove the lock file and let go (idempotent). Removed first, while still held, so that no
        other run can take a file that is about to disappear."""
        if _HELD.get(self.path) is not self:
            return
        del _HELD[self.path]
        try:
            if _same_file(self.fd, self.path):
                self.path.unlink()
        except OSError:  # the folder turned read-only: the file stays, unlocked, and the next run takes it over
            pass
        finally:
            os.close(self.fd)


def read_holder(folder: str | os.PathLike) -> dict:
    """What the folder's lock file says ({} when there is none or it is empty)."""
    path = Path(folder).resolve() / LOCK_FILE
    if path in _HELD:  # through our own descriptor: closing another one would drop our lock (POSIX)
        return _read(_HELD[path].fd)
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def live_holder(folder: str | os.PathLike) -> dict | None:
    """Who holds the folder's lock, if another live process does (read only: nothing is taken or
    written); None when the folder is free or this process holds it. For checks that read the
    folder before `acquire` (a resumed run's flags), so that a live run there is what they name."""
    path = Path(folder).expanduser().resolve() / LOCK_FILE
    if path in _HELD or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        holder = _read(fd)
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # no one holds it (dropped as fd closes: we held none)
            return None
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EAGAIN):
                return holder
            if err.errno not in NO_RECORD_LOCKS:
                return None  # acquire names what is wrong with the file
        alive = holder.get("pid") not in (None, os.getpid()) and (
            holder.get("host") != _host() or _alive(int(holder.get("pid", 0))))
        return holder if alive else None
    finally:
        os.close(fd)


def refuse_live_run(folder: str | os.PathLike, flag: str = "--output_dir") -> None:
    """ConfigError when `folder` is, or lies inside, the output folder of a live run of another
    process (its lock file says so): a command that writes there (`mmgrpo eval --output_dir`) would
    mix its files with the run's, or be overwritten by them. Reads only; nothing is taken.

    >>> import tempfile
    >>> scratch = tempfile.TemporaryDirectory(); folder = Path(scratch.name)  # removed with `scratch`
    >>> refuse_live_run(folder / "eval")  # no run there: nothing to refuse
    """
    target = Path(folder).expanduser().resolve()
    for candidate in (target, *target.parents):
        holder = live_holder(candidate) if candidate.is_dir() else None
        if holder:
            where = "is the output folder" if candidate == target else f"is inside {candidate}, the output folder"
            raise ConfigError(f"{flag} {folder} {where} of a live training run ({_describe(holder)}): writing there "
                              f"would mix with its files; wait for it to end, or give another {flag}")


def in_use_error(folder: str | os.PathLike, holder: dict) -> ConfigError:
    """The one-line refusal `acquire` gives for a folder that `holder` holds."""
    return ConfigError(_refusal(Path(folder).expanduser().resolve() / LOCK_FILE, holder))


@atexit.register
def _release_all() -> None:
    """A run that ended by an error before its own release: its lock file goes with the process."""
    for lock in list(_HELD.values()):
        lock.release()


def _lock(fd: int, holder: dict, path: Path) -> bool:
    """True when this process now holds `fd`'s file; False when a live run does."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if err.errno not in NO_RECORD_LOCKS:
            raise ConfigError(f"{path}: cannot lock the output folder ({err.strerror}); pick another --output_dir") from None
    # No record locks on this file system: the recorded pid decides, on this host.
    if not holder or holder.get("pid") == os.getpid():
        return True
    return holder.get("host") == _host() and not _alive(int(holder.get("pid", 0)))


def _refusal(path: Path, holder: dict) -> str:
    where = "" if holder.get("host", _host()) == _host() else f" (on another host; delete {path} if that run is gone)"
    return (f"--output_dir {path.parent} is in use by another run ({_describe(holder)}){where}: wait for it to end or "
            "stop it, or give another --output_dir")


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode()
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


def _write(fd: int, holder: dict) -> None:
    data = (json.dumps(holder) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _host() -> str:
    return socket.gethostname()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
