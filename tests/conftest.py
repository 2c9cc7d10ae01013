"""Shared test fixtures: offline, one thread, tiny models built once per cache.

Tiny checkpoints are cached under $MMGRPO_CACHE (default ~/.cache/mmgrpo); the builder writes
atomically, so parallel pytest-xdist workers can ask for the same one.
"""

import os

# Before torch / transformers are imported by any test module.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# What a full run writes from an empty cache, as measured here: pytest's temp folders (1.7 GB by
# the end of a run), torch's compile cache in the temp folder (about 0.2 GB more a run) and the
# real-width random models in the model cache (3.5 GB).
NEEDS_FREE_GB = 6


def pytest_sessionstart(session):
    """Stop at once, saying where, when the disk cannot hold the run: a full disk otherwise shows
    up minutes later as scattered errors from inside pytest, torch and safetensors."""
    import shutil
    import tempfile

    from mmgrpo.models.model_cache import default_cache_dir

    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller checked
    cache = default_cache_dir()
    while not cache.exists():
        cache = cache.parent
    for folder, what in ((tempfile.gettempdir(), "temp folder (TMPDIR)"), (cache, "model cache (MMGRPO_CACHE)")):
        free = shutil.disk_usage(folder).free / 2**30
        if free < NEEDS_FREE_GB:
            pytest.exit(f"only {free:.1f} GB free for the {what} {folder}; the suite needs about {NEEDS_FREE_GB} GB "
                        f"there: free some space, or point the variable at a folder on a larger disk", returncode=3)


@pytest.fixture(scope="session")
def tiny_qwen2_vl_path() -> str:
    """Folder of the tiny random Qwen2-VL checkpoint (built on first use, then cached)."""
    from mmgrpo.models.tiny import build_tiny

    return str(build_tiny("qwen2-vl"))


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_path() -> str:
    """Folder of the tiny random Qwen2.5-VL checkpoint (built on first use, then cached)."""
    from mmgrpo.models.tiny import build_tiny

    return str(build_tiny("qwen2.5-vl"))
