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
