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
    first of concurrent builders wins and the others discard their copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
