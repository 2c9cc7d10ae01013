"""Bad input with --use_vllm: one clear line, at start-up where it can be known then.

Runs in both venvs: without vLLM, --use_vllm says how to install it; with vLLM, a prompt longer
than --vllm_max_model_len names the sample, and too small a KV cache names the flag to change.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgrpo.config import TrainConfig
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.training.startup_checks import check_train_flags

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ROOT = Path(__file__).resolve().parents[1]


def args(tmp_path, *extra):
    return ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", "format", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--dataloader_num_workers", "0",
            "--max_steps", "1", "--report_to", "none", "--output_dir", str(tmp_path / "run"), "--use_vllm", *extra]


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_use_vllm_without_vllm_says_how_to_install(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mmgrpo.cli", "train", *args(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and "pip install mmgrpo[vllm]" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_bad_vllm_flags_fail_before_any_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="vllm_mode"):
        check_train_flags(TrainConfig.from_args(args(tmp_path, "--vllm_mode", "remote")))
    if HAS_VLLM:
        with pytest.raises(ConfigError, match="vllm_max_model_len 8 leaves no room"):
            check_train_flags(TrainConfig.from_args(args(tmp_path, "--vllm_max_model_len", "8")))
        if not torch.cuda.is_available():
            with pytest.raises(ConfigError, match="--vllm_enable_sleep_mode needs a CUDA GPU"):
                check_train_flags(TrainConfig.from_args(args(tmp_path, "--vllm_enable_sleep_mode")))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make venv-vllm)")
def test_a_prompt_longer_than_max_model_len_names_the_sample(tmp_path):
    from mmgrpo.engine import train

    with pytest.raises(DataError, match=r"sample shapes-color/train/\d+: prompt of \d+ tokens .* --vllm_max_model_len 40"):
        train(TrainConfig.from_args(args(tmp_path, "--vllm_max_model_len", "40")))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make venv-vllm)")
def test_too_small_a_kv_cache_names_the_flag(tmp_path):
    from mmgrpo.engine import train

    with pytest.raises(ConfigError, match="--vllm_kv_cache_memory_bytes"):
        train(TrainConfig.from_args(args(tmp_path, "--vllm_max_model_len", "4096", "--vllm_kv_cache_memory_bytes", "65536")))
