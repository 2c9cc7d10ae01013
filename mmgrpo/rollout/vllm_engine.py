"""The vLLM rollout engine a run asks for (`--use_vllm`), built once in `build_rollout_engine`.

    engine = build_vllm_engine(cfg.rollout, model_path, template, strategy,
                               max_prompt_length=cfg.data.max_prompt_length, seed=cfg.seed, output_dir=cfg.output_dir)

`--vllm_mode colocate`: a vLLM engine in this process (mmgrpo/rollout/vllm_colocate.py), one per rank
under torchrun. `--vllm_mode server`: every rank a client of one or several `mmgrpo rollout-server`s
(mmgrpo/rollout/vllm_client.py), which checks at start-up that every server answers and serves this model.

>>> server_addresses(["10.0.0.5", "10.0.0.6"], [8000]), server_addresses("127.0.0.1", [8000, 8001])
([('10.0.0.5', 8000), ('10.0.0.6', 8000)], [('127.0.0.1', 8000), ('127.0.0.1', 8001)])
"""

from __future__ import annotations

from mmgrpo.config import RolloutConfig
from mmgrpo.errors import ConfigError


def max_model_len(rollout_cfg: RolloutConfig, max_prompt_length: int) -> int:
    """--vllm_max_model_len, or the longest prompt (--max_prompt_length) + completion the run allows."""
    return rollout_cfg.vllm_max_model_len or max_prompt_length + rollout_cfg.max_completion_length


def server_addresses(hosts, ports) -> list[tuple[str, int]]:
    """(host, port) of every server from --vllm_server_host / --vllm_server_port: lists of equal
    length, or one of them a single value shared by all (a YAML scalar counts as one)."""
    hosts = [hosts] if isinstance(hosts, str) else list(hosts)
    ports = [ports] if isinstance(ports, int) else list(ports)
    if not hosts or not ports:
        raise ConfigError("--vllm_server_host / --vllm_server_port: give at least one server.")
    if len(hosts) != len(ports) and 1 not in (len(hosts), len(ports)):
        raise ConfigError(
            f"--vllm_server_host names {len(hosts)} hosts and --vllm_server_port {len(ports)} ports: give one port "
            "per host, or one host (or port) for all."
        )
    count = max(len(hosts), len(ports))
    servers = list(zip(hosts * count if len(hosts) == 1 else hosts, ports * count if len(ports) == 1 else ports))
    repeated = sorted({f"{host}:{port}" for host, port in servers if servers.count((host, port)) > 1})
    if repeated:
        raise ConfigError(f"--vllm_server_host / --vllm_server_port: {', '.join(repeated)} is listed twice; "
                          "list each server once.")
    return servers


def build_vllm_engine(rollout_cfg: RolloutConfig, model_path: str, template, strategy, *, max_prompt_length: int,
                      seed: int, output_dir: str):
    """The engine --vllm_mode names, loading `model_path` itself. max_prompt_length (--max_prompt_length)
    sizes a colocated engine's context and `seed` seeds it; in output_dir, where the run's checkpoints
    go, a server that fails finds the newest one to resume from, which its error names."""
    if rollout_cfg.vllm_mode == "server":
        from mmgrpo.rollout.vllm_client import VLLMServerRollout

        return VLLMServerRollout(
            server_addresses(rollout_cfg.vllm_server_host, rollout_cfg.vllm_server_port), model_path, template,
            rank=strategy.rank if strategy is not None else 0,
            world_size=strategy.world_size if strategy is not None else 1,
            device=strategy.device if strategy is not None else "cpu",
            timeout=rollout_cfg.vllm_server_timeout, bucket_bytes=rollout_cfg.vllm_weight_bucket_mb << 20,
            transfer=rollout_cfg.vllm_weight_transfer, group_host=rollout_cfg.vllm_group_host,
            group_port=rollout_cfg.vllm_group_port, checkpoint_dir=output_dir,
        )
    from mmgrpo.rollout.vllm_colocate import VLLMColocateRollout

    distributed = strategy is not None and strategy.world_size > 1
    return VLLMColocateRollout(
        model_path, template, max_model_len=max_model_len(rollout_cfg, max_prompt_length), seed=seed,
        dtype={"bf16": "bfloat16", "fp16": "float16"}.get(strategy.precision if strategy is not None else "", "float32"),
        gpu_memory_utilization=rollout_cfg.vllm_gpu_memory_utilization,
        tensor_parallel_size=rollout_cfg.vllm_tensor_parallel_size, enable_sleep_mode=rollout_cfg.vllm_enable_sleep_mode,
        kv_cache_memory_bytes=rollout_cfg.vllm_kv_cache_memory_bytes, distributed=distributed,
        rank=strategy.rank if strategy is not None else 0,
    )


def validate_vllm(rollout_cfg: RolloutConfig, max_prompt_length: int) -> None:
    """The --use_vllm checks that need no model (each flag's own range is declared beside it in
    mmgrpo/config/schema.py): vLLM importable (colocated: a server's trainer needs none), sleep mode
    on a GPU, servers listed once, room for a prompt (--max_prompt_length) before the completion."""
    import importlib.util

    from mmgrpo.rollout.vllm_requests import INSTALL_HINT

    if rollout_cfg.vllm_mode != "server" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(INSTALL_HINT + ".")
    if rollout_cfg.vllm_enable_sleep_mode:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--vllm_enable_sleep_mode needs a CUDA GPU (vLLM on CPU has no sleep mode): drop the flag.")
    if rollout_cfg.vllm_mode == "server":
        server_addresses(rollout_cfg.vllm_server_host, rollout_cfg.vllm_server_port)
    longest = max_model_len(rollout_cfg, max_prompt_length)
    if longest <= rollout_cfg.max_completion_length:
        raise ConfigError(
            f"--vllm_max_model_len {longest} leaves no room for a prompt before --max_completion_length "
            f"{rollout_cfg.max_completion_length}: raise it."
        )


def build_teacher_client(algo_cfg, rollout_cfg: RolloutConfig, teacher_path: str, template, strategy):
    """The client of --teacher_model's rollout server (--teacher_server_host/port), which scores the
    student's completions (`VLLMServerRollout.score`); it checks the server serves `teacher_path`.
    No weights are ever sent: it takes the version the server holds as its own."""
    from mmgrpo.rollout.vllm_client import VLLMServerRollout

    client = VLLMServerRollout(
        [(algo_cfg.teacher_server_host, algo_cfg.teacher_server_port)], teacher_path, template,
        rank=strategy.rank if strategy is not None else 0, world_size=strategy.world_size if strategy is not None else 1,
        device=strategy.device if strategy is not None else "cpu", timeout=rollout_cfg.vllm_server_timeout, transfer="http",
    )
    client.weight_version = client.servers[0].wait_for_health()["weight_version"]
    return client
