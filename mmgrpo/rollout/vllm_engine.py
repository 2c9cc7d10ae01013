"""The vLLM rollout engine a run asks for (`--use_vllm`), built once in `build_rollout_engine`.

    engine = build_vllm_engine(cfg, model_path, template, strategy)

`--vllm_mode colocate`: a vLLM engine in this process (mmgrpo/rollout/vllm_colocate.py), one per rank
under torchrun. `--vllm_mode server`: a client of `mmgrpo rollout-server` (mmgrpo/rollout/vllm_client.py),
which checks at start-up that the server answers and serves this model.
"""

from __future__ import annotations

from mmgrpo.errors import ConfigError


def max_model_len(cfg) -> int:
    """--vllm_max_model_len, or the longest prompt + completion the run allows."""
    return cfg.rollout.vllm_max_model_len or cfg.data.max_prompt_length + cfg.rollout.max_completion_length


def build_vllm_engine(cfg, model_path: str, template, strategy):
    rollout = cfg.rollout
    if rollout.vllm_mode == "server":
        from mmgrpo.rollout.vllm_client import VLLMServerRollout

        if strategy is not None and strategy.world_size > 1:
            raise ConfigError(
                "--vllm_mode server serves one trainer process for now; under torchrun use --vllm_mode colocate."
            )
        return VLLMServerRollout(
            rollout.vllm_server_host, rollout.vllm_server_port, model_path, template,
            timeout=rollout.vllm_server_timeout,
        )
    from mmgrpo.rollout.vllm_colocate import VLLMColocateRollout

    distributed = strategy is not None and strategy.world_size > 1
    return VLLMColocateRollout(
        model_path, template, max_model_len=max_model_len(cfg), seed=cfg.seed,
        dtype="bfloat16" if strategy is not None and strategy.bf16 else "float32",
        gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
        tensor_parallel_size=rollout.vllm_tensor_parallel_size, enable_sleep_mode=rollout.vllm_enable_sleep_mode,
        kv_cache_memory_bytes=rollout.vllm_kv_cache_memory_bytes, distributed=distributed,
        rank=strategy.rank if strategy is not None else 0,
    )


def validate_vllm(cfg) -> None:
    """The --use_vllm checks that need no model: vLLM importable, sizes that make sense."""
    import importlib.util

    from mmgrpo.rollout.vllm_requests import INSTALL_HINT

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(INSTALL_HINT + ".")
    rollout = cfg.rollout
    if not 0 < rollout.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"--vllm_gpu_memory_utilization {rollout.vllm_gpu_memory_utilization}: give a share in (0, 1].")
    if rollout.vllm_enable_sleep_mode:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--vllm_enable_sleep_mode needs a CUDA GPU (vLLM on CPU has no sleep mode): drop the flag.")
    if rollout.vllm_tensor_parallel_size < 1:
        raise ConfigError("--vllm_tensor_parallel_size must be at least 1.")
    if rollout.vllm_kv_cache_memory_bytes is not None and rollout.vllm_kv_cache_memory_bytes <= 0:
        raise ConfigError("--vllm_kv_cache_memory_bytes must be a positive number of bytes (e.g. 268435456).")
    if max_model_len(cfg) <= rollout.max_completion_length:
        raise ConfigError(
            f"--vllm_max_model_len {max_model_len(cfg)} leaves no room for a prompt before --max_completion_length "
            f"{rollout.max_completion_length}: raise it."
        )
