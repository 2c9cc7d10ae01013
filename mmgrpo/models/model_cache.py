"""Where built checkpoints live and how one lands there: shared by the `tiny:` (mmgrpo/models/tiny.py)
and `random:` (mmgrpo/models/real_configs.py) builders.

    publish_checkpoint(default_cache_dir() / "name-hash", lambda folder: model.save_pretrained(folder))
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def default_cache_dir() -> Path:
    """`$MMGRPO_CACHE/models` if set, else `~/.cache/mmgrpo/models`."""
    root = os.environ.get("MMGRPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mmgrpo")
    return Path(root) / "models"


def publish_checkpoint(target: Path, write) -> Path:
    """`write(folder)` into a private temp folder beside `target`, then rename it into place: the
    first of concurrent builders wins and the others discard their copy. A `target` without a
    config.json (a folder something left incomplete) is moved aside and replaced.

    >>> root = Path(tempfile.mkdtemp())
    >>> (root / "m").mkdir(); _ = (root / "m" / "tokenizer.json").write_text("{}")  # no config.json
    >>> done = publish_checkpoint(root / "m", lambda folder: (folder / "config.json").write_text("{}"))
    >>> sorted(p.name for p in done.iterdir()), [p.name for p in root.iterdir() if p.name != "m"]
    (['config.json'], [])
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        for _ in range(3):
            try:
                os.rename(tmp, target)
                break
            except OSError:
                if (target / "config.json").exists():  # another builder's, complete: ours is discarded
                    break
                _discard(target)
        else:
            raise OSError(f"could not publish the checkpoint {target}: the folder there keeps coming back incomplete")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _discard(folder: Path) -> None:
    """Move an incomplete folder out of the way (renamed first, so no reader sees it half deleted)."""
    aside = folder.with_name(f".{folder.name}-incomplete-{os.getpid()}")
    try:
        os.rename(folder, aside)
    except OSError:
        return  # gone already, or another process moved it
    shutil.rmtree(aside, ignore_errors=True)
