"""The flags of `mmgrpo rollout-server` (mmgrpo/rollout/vllm_server.py serves with them). Here, apart
from the server, so that `--help` and a flag's error come before torch and vLLM are imported."""

from __future__ import annotations

import argparse


def server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmgrpo rollout-server",
        description="Serve rollouts with vLLM to `mmgrpo train --use_vllm --vllm_mode server` (docs/vllm.md).",
    )
    parser.add_argument("--model", required=True, help="The checkpoint the trainer starts from (or tiny:<family>).")
    parser.add_argument("--model_type", default=None, help="Its template name (inferred from the checkpoint when not given).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
    parser.add_argument("--port", type=int, default=8000, help="Port (default 8000).")
    parser.add_argument("--vllm_max_model_len", type=int, default=4096, help="Longest prompt + completion (default 4096).")
    parser.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.9, help="GPU memory share (default 0.9).")
    parser.add_argument("--vllm_tensor_parallel_size", type=int, default=1, help="GPUs per engine (default 1).")
    parser.add_argument("--vllm_kv_cache_memory_bytes", type=int, default=None,
                        help="KV cache in bytes (vLLM on CPU: default 256 MiB).")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16: the trainer's compute dtype (default float32).")
    parser.add_argument("--seed", type=int, default=0)
    return parser
