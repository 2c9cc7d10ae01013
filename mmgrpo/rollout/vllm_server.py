"""`mmgrpo rollout-server`: vLLM serving rollouts to a trainer on other devices or another node.

    mmgrpo rollout-server --model tiny:qwen2-vl --model_type qwen2-vl --host 127.0.0.1 --port 8000
    mmgrpo train ... --use_vllm --vllm_mode server --vllm_server_host 127.0.0.1 --vllm_server_port 8000

A small HTTP API of our own over an in-process vLLM engine (vLLM's OpenAI server returns text, not
the ids and sampling log-probs of n samples with our media options, and has no place for our weight
version tag):

    GET  /health                   {"identity", "model", "weight_version"}: the trainer checks the identity
    POST /generate                 .npz body (mmgrpo/rollout/vllm_wire.py) -> {"completions": [{"ids", "logps"}],
                                   "prompt_token_ids", "weight_version"}; refused (409) when the weights are not
                                   the version the trainer expects (a restarted server lost them)
    POST /weights?path=P           load the safetensors file P (same host, /dev/shm) or the body into vLLM,
                                   in place; the tensors a chunk does not name keep their values (the
                                   trainer names them as vLLM loads them: mmgrpo/rollout/vllm_weights.py)
    POST /weights/finish?version=N caches reset (prefix, encoder), the weights are version N

One request runs at a time (a lock): the trainer syncs between rollouts, never during one.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from mmgrpo.errors import ConfigError
from mmgrpo.rollout.vllm_requests import completions_of, repack_tied_heads, vllm_prompt, vllm_sampling
from mmgrpo.rollout.vllm_wire import decode_prompts, model_identity


class RolloutService:
    """The server's state: the engine, the weight version, one request at a time."""

    def __init__(self, llm, model_path: str, max_model_len: int):
        self.llm, self.model_path, self.max_model_len = llm, model_path, max_model_len
        self.identity = model_identity(model_path)
        self.weight_version = 0
        self.lock = threading.Lock()

    def health(self) -> dict:
        return {"identity": self.identity, "model": self.model_path, "weight_version": self.weight_version,
                "max_model_len": self.max_model_len}

    def generate(self, body: bytes) -> tuple[int, dict]:
        meta, media = decode_prompts(body)
        with self.lock:
            if meta["version"] != self.weight_version:
                return 409, {"error": f"the server holds weights of version {self.weight_version}, the trainer "
                                      f"expects {meta['version']} (was the server restarted?)"}
            requests = [vllm_prompt(p["text"], m, meta["processor_kwargs"], meta["sampling_rate"])
                        for p, m in zip(meta["prompts"], media)]
            copies = [int(options.pop("copies", 1)) for options in meta["options"]]  # greedy: 1 sample, G copies
            params = [vllm_sampling(options) for options in meta["options"]]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        rows = [row for output, n in zip(outputs, copies) for row in completions_of([output], n)]
        return 200, {"completions": rows, "prompt_token_ids": [list(o.prompt_token_ids) for o in outputs],
                     "weight_version": self.weight_version}

    def load(self, body: bytes, path: str | None) -> tuple[int, dict]:
        from safetensors.torch import load, load_file

        tensors = load_file(path) if path else load(body)
        with self.lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
        if path:
            os.unlink(path)  # the trainer's /dev/shm chunk, read
        return 200, {"loaded": len(tensors)}

    def finish(self, version: int) -> tuple[int, dict]:
        import torch

        with self.lock:
            if not torch.cuda.is_available():
                repack_tied_heads(self.llm)  # after the last chunk: the embedding a tied head shares is in
            self.llm.reset_prefix_cache()
            engine = self.llm.llm_engine
            if hasattr(engine, "reset_encoder_cache"):
                engine.reset_encoder_cache()
            self.weight_version = version
        return 200, {"weight_version": version}


def handler_for(service: RolloutService):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the trainer logs what matters
            pass

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if urlparse(self.path).path == "/health":
                return self._reply(200, service.health())
            self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                if url.path == "/generate":
                    return self._reply(*service.generate(body))
                if url.path == "/weights":
                    return self._reply(*service.load(body, query.get("path")))
                if url.path == "/weights/finish":
                    return self._reply(*service.finish(int(query["version"])))
            except Exception as error:  # the trainer shows it; the server keeps serving
                return self._reply(500, {"error": f"{type(error).__name__}: {error}"})
            self._reply(404, {"error": f"no route {url.path}"})

    return Handler


def listen(host: str, port: int) -> ThreadingHTTPServer:
    """The bound server socket; requests wait in its backlog until `serve_forever` (the engine is ready)."""
    try:
        return ThreadingHTTPServer((host, port), BaseHTTPRequestHandler)
    except OSError as error:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({error.strerror or error}); "
                          "pick a free --port or stop what holds it") from None


def main(argv: list[str] | None = None) -> None:
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
    args = parser.parse_args(argv)
    # The port is taken before the engine starts: vLLM's own sockets (gloo on CPU) take free ports as it
    # starts, and one of them could be this one; a port already in use fails here, not minutes later.
    server = listen(args.host, args.port)

    import torch

    from mmgrpo.models.loading import load_template
    from mmgrpo.rollout.vllm_colocate import llm_options
    from mmgrpo.rollout.vllm_requests import (
        check_supported,
        known_mismatch,
        kv_cache_error,
        one_way_media_attention,
        require_vllm,
    )
    from mmgrpo.rollout.vllm_weights import vllm_checkpoint, weight_load_error

    path, _, template = load_template(args.model, args.model_type)  # no --model_type: inferred from the checkpoint
    model_type = template.name
    vllm = require_vllm()
    check_supported(str(path), template)
    if (mismatch := known_mismatch(template)) is not None:
        raise mismatch
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    options = llm_options(
        vllm_checkpoint(str(path), template), max_model_len=args.vllm_max_model_len, dtype=args.dtype, seed=args.seed, cuda=cuda,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization, tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=False, kv_cache_memory_bytes=args.vllm_kv_cache_memory_bytes, distributed=False,
    )
    options.pop("weight_transfer_config", None)  # weights arrive over HTTP (see docs/vllm.md for NCCL)
    try:
        llm = vllm.LLM(**options)
    except (ValueError, RuntimeError) as error:
        flag = "--vllm_kv_cache_memory_bytes" if not cuda else "--vllm_gpu_memory_utilization"
        raise (weight_load_error(error, template, str(path)) or kv_cache_error(error, flag) or error) from None
    if not cuda and (error := one_way_media_attention(llm, template)) is not None:
        raise error
    server.RequestHandlerClass = handler_for(RolloutService(llm, str(path), args.vllm_max_model_len))
    print(f"mmgrpo rollout-server: serving {path} ({model_type}) on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
