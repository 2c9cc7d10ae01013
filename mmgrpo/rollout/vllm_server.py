"""`mmgrpo rollout-server`: vLLM serving rollouts to trainers on other devices or other nodes.

    mmgrpo rollout-server --model tiny:qwen2-vl --model_type qwen2-vl --host 127.0.0.1 --port 8000
    mmgrpo train ... --use_vllm --vllm_mode server --vllm_server_host 127.0.0.1 --vllm_server_port 8000

A small HTTP API of our own over an in-process vLLM engine (vLLM's OpenAI server returns text, not
the ids and sampling log-probs of n samples with our media options, and has no place for our weight
version tag):

    GET  /health                   {"identity", "fingerprint", "model", "mmgrpo", "device", "weight_version",
                                   "max_model_len"}: the trainer checks the model and the version at start-up
    POST /generate                 .npz body (mmgrpo/rollout/vllm_wire.py) -> {"completions": [{"ids", "logps"}],
                                   "prompt_token_ids", "weight_version"}; refused (409) when the weights are not
                                   the version the trainer expects (a restarted server lost them)
    POST /weights?path=P           load the safetensors file P (same host, /dev/shm) or the body into vLLM,
                                   in place; the tensors a chunk does not name keep their values (the
                                   trainer names them as vLLM loads them: mmgrpo/rollout/vllm_weights.py)
    POST /weights/group?...        join trainer rank 0's weight group (mmgrpo/rollout/weight_group.py):
                                   address, port, session, rank, world_size, backend, timeout
    POST /weights/receive?session=S  receive one sync's buckets over that group (in the background), each
                                   reloaded in place as it arrives
    POST /weights/finish?version=N the sync is complete (waits for the receiving), caches reset (prefix,
                                   encoder), the weights are version N
    POST /weights/leave?session=S  the trainer is done: the group is dropped

Every trainer rank sends its own /generate requests; one runs at a time (a lock), and a sync holds
the lock from its first bucket to its last, so no rollout sees half-loaded weights. A group that
breaks mid-sync (the trainer was killed) is dropped at once (gloo raises when its peer's sockets
close; otherwise at the group's timeout): the weights are then partial (version -1, every rollout
refused) until a trainer, a new one included, sends them whole. The server needs no restart.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import mmgrpo
from mmgrpo.errors import ConfigError
from mmgrpo.rollout.vllm_requests import (
    completions_of,
    continued_prompt,
    repack_tied_heads,
    vllm_prompt,
    vllm_sampling,
)
from mmgrpo.rollout.vllm_wire import decode_prompts, model_fingerprint, model_identity
from mmgrpo.rollout.weight_group import BucketBuffer, connect_store, group_device, join_group, receive_buckets


@dataclass
class WeightGroup:
    """A trainer's weight group as this server holds it."""

    session: str
    backend: str
    timeout: float
    process_group: object = None
    joined: threading.Event = field(default_factory=threading.Event)
    error: str | None = None  # why joining or the last sync failed
    receiving: threading.Thread | None = None
    received: int = 0  # tensors of the sync now or last received
    buffer: BucketBuffer | None = None  # where buckets arrive, reused by every sync of this group


class RolloutService:
    """The server's state: the engine, the weight version, the trainer's weight group; one request at a time."""

    def __init__(self, llm, model_path: str, max_model_len: int, device: str = "cpu", video_metadata: dict | None = None):
        self.llm, self.model_path, self.max_model_len, self.device = llm, model_path, max_model_len, device
        self.video_metadata = video_metadata or {}  # the family's keys for vLLM's video metadata (its template's)
        self.identity = model_identity(model_path)
        self.fingerprint = model_fingerprint(model_path)
        self.instance = uuid.uuid4().hex[:8]  # changes with every start: a restart is visible
        self.weight_version = 0
        self.lock = threading.Lock()  # the engine: generate, reload, cache reset
        self.group: WeightGroup | None = None  # the group of the trainer connected now
        self.sync: WeightGroup | None = None  # the group of the sync in flight, until /weights/finish
        self.sync_error: str | None = None  # why the last sync over a group failed (the trainer asks /health)
        self.group_lock = threading.Lock()  # joins and drops
        self.replaced: dict[str, str] = {}  # a trainer's weight group -> the later trainer's that took the server

    def health(self) -> dict:
        return {"identity": self.identity, "fingerprint": self.fingerprint, "model": self.model_path,
                "mmgrpo": mmgrpo.__version__, "device": self.device, "instance": self.instance,
                "weight_version": self.weight_version, "max_model_len": self.max_model_len,
                "group": self.group.session if self.group else None, "sync_error": self.sync_error}

    def generate(self, body: bytes) -> tuple[int, dict]:
        meta, media = decode_prompts(body)
        with self.lock:
            if meta["version"] != self.weight_version:
                return 409, {"error": f"the server holds weights of version {self.weight_version}, the trainer "
                                      f"expects {meta['version']} (was the server restarted, or a sync cut short?)"}
            requests = [vllm_prompt(p["text"], m, meta["processor_kwargs"], meta["sampling_rate"], self.video_metadata)
                        for p, m in zip(meta["prompts"], media)]
            copies = [int(options.pop("copies", 1)) for options in meta["options"]]  # greedy: 1 sample, G copies
            continued = [0] * len(requests)  # tokens appended to each prompt (a completion continued or scored)
            for i, options in enumerate(meta["options"]):  # --partial_rollouts, --teacher_server_port
                if (tokens := options.pop("continue_ids", None)) is not None:
                    requests[i] = continued_prompt(requests[i], self.llm.get_tokenizer(), tokens)
                    continued[i] = len(tokens)
            params = [vllm_sampling(options) for options in meta["options"]]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        rows = [row for output, n in zip(outputs, copies) for row in completions_of([output], n)]
        reply = {"completions": rows, "prompt_token_ids": [list(o.prompt_token_ids) for o in outputs],
                 "weight_version": self.weight_version}
        if any(options.get("prompt_logprobs") is not None for options in meta["options"]):  # a teacher scoring
            reply["prompt_logprobs"] = [appended_logprobs(output, n) for output, n in zip(outputs, continued)]
        return 200, reply

    def load(self, body: bytes, path: str | None) -> tuple[int, dict]:
        from safetensors.torch import load, load_file

        tensors = load_file(path) if path else load(body)  # a /dev/shm file: the trainer deletes it
        with self.lock:
            self._reload(tensors)
        return 200, {"loaded": len(tensors)}

    def finish(self, version: int) -> tuple[int, dict]:
        import torch

        sync, self.sync = self.sync, None  # the group of the sync over a group (None: over HTTP)
        if sync is not None:
            sync.receiving.join(sync.timeout)
            if sync.receiving.is_alive():
                return 504, {"error": f"the sync's buckets did not all arrive within {sync.timeout:.0f} s"}
            if sync.error:  # the group broke or a bucket did not load: the weights stay partial (version -1)
                return 500, {"error": sync.error}
        with self.lock:
            if not torch.cuda.is_available():
                repack_tied_heads(self.llm)  # after the last chunk: the embedding a tied head shares is in
            self.llm.reset_prefix_cache()
            engine = self.llm.llm_engine
            if hasattr(engine, "reset_encoder_cache"):
                engine.reset_encoder_cache()
            self.weight_version = version
        return 200, {"weight_version": version}

    # ---- the weight group ---------------------------------------------------------------------

    def join(self, query: dict, own_address: str) -> tuple[int, dict]:
        """Join trainer rank 0's group in the background (its rank 0 joins as this returns)."""
        backend = query["backend"]
        if backend == "nccl" and self.device != "cuda":
            return 400, {"error": f"this server runs vLLM on {self.device}: its weight group cannot be NCCL"}
        group = WeightGroup(session=query["session"], backend=backend, timeout=float(query["timeout"]))
        with self.group_lock:
            if self.group is not None and self.group.session != group.session:
                self.replaced[self.group.session] = group.session  # so the earlier trainer is told who holds it
            self._drop(wait=True)  # a trainer killed mid-sync: its group goes, this one comes
            self.group = group
        threading.Thread(target=self._join, args=(group, query, own_address), daemon=True).start()
        return 202, {"joining": group.session}

    def receive(self, session: str) -> tuple[int, dict]:
        group = self.group
        if group is None or group.session != session:
            if session in self.replaced:
                return 409, {"error": f"another trainer (weight group {self.replaced[session]}) joined this server "
                                      "after this one and holds it now: a rollout server serves one training run at "
                                      "a time; give each run its own server (--vllm_server_port)"}
            return 409, {"error": f"this server (instance {self.instance}) never held a weight group of this trainer: "
                                  "it was restarted since the trainer joined; start the run again against it"}
        if not group.joined.wait(group.timeout) or group.process_group is None:
            return 500, {"error": f"joining the trainer's weight group failed: {group.error or 'timed out'}"}
        if group.receiving is not None and group.receiving.is_alive():
            return 409, {"error": "a sync is already running"}
        group.error, group.received, self.sync_error = None, 0, None
        group.receiving = threading.Thread(target=self._receive, args=(group,), daemon=True)
        self.sync = group
        group.receiving.start()
        return 202, {"receiving": session}

    def leave(self, session: str) -> tuple[int, dict]:
        with self.group_lock:
            if self.group is not None and self.group.session == session:
                self._drop(wait=True)
        return 200, {"left": session}

    def _join(self, group: WeightGroup, query: dict, own_address: str) -> None:
        try:
            store = connect_store(query["address"], int(query["port"]), group.timeout)
            group.process_group = join_group(
                store, group.session, rank=int(query["rank"]), world_size=int(query["world_size"]),
                backend=group.backend, address=own_address, timeout=group.timeout,
            )
        except Exception as error:  # the trainer sees it on /weights/receive
            group.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        finally:
            group.joined.set()

    def _receive(self, group: WeightGroup) -> None:
        with self.lock:
            stage = "the weight group broke"
            try:
                group.buffer = group.buffer or BucketBuffer(group_device(group.backend))
                for bucket in receive_buckets(group.process_group, group.buffer):
                    stage = "loading them into vLLM failed"
                    self._reload(bucket)
                    group.received += len(bucket)
                    stage = "the weight group broke"
            except Exception as error:  # the trainer died or hung mid-sync, or vLLM refused a weight
                first = str(error).splitlines()[0] if str(error) else type(error).__name__
                group.error = f"{stage} after {group.received} tensors: {type(error).__name__}: {first}"
                self.weight_version = -1  # partial weights: every rollout is refused until a whole sync
                self.sync_error = group.error
                print(f"mmgrpo rollout-server: {group.error}; dropped the group, the weights are partial until a "
                      "trainer sends them whole", flush=True)
                if self.group is group:  # not under group_lock: a join waiting for this thread holds it
                    self.group = None
                group.process_group = None

    def _drop(self, wait: bool) -> None:
        """Forget the current group (the caller holds group_lock); a sync in flight ends first."""
        group, self.group = self.group, None
        if group is None:
            return
        if wait and group.receiving is not None:
            group.receiving.join(group.timeout)
        group.process_group = None

    def _reload(self, tensors: dict) -> None:
        """Load (HF name, tensor) pairs in place (the caller holds the engine lock)."""
        from mmgrpo.rollout.vllm_weights import reload_weights

        reload_weights(self.llm, tensors.items())


def appended_logprobs(output, count: int) -> list[float]:
    """The log-probs of the last `count` prompt tokens of a vLLM output requested with prompt_logprobs
    (the completion a teacher scores, appended to its prompt)."""
    if not count:
        return []
    ids, steps = output.prompt_token_ids[-count:], output.prompt_logprobs[-count:]
    return [step[token].logprob for token, step in zip(ids, steps)]


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
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (its timeout)
                pass

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
                if url.path == "/weights/group":  # this server's address as the trainer reached it
                    own_address = self.connection.getsockname()[0].removeprefix("::ffff:")
                    return self._reply(*service.join(query, own_address))
                if url.path == "/weights/receive":
                    return self._reply(*service.receive(query["session"]))
                if url.path == "/weights/finish":
                    return self._reply(*service.finish(int(query["version"])))
                if url.path == "/weights/leave":
                    return self._reply(*service.leave(query["session"]))
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


def main(args) -> None:
    """Serve with the parsed flags of `mmgrpo rollout-server` (mmgrpo/config/server.py's parser)."""
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
    options.pop("weight_transfer_config", None)  # weights arrive over HTTP or our own weight group
    try:
        llm = vllm.LLM(**options)
    except (ValueError, RuntimeError) as error:
        flag = "--vllm_kv_cache_memory_bytes" if not cuda else "--vllm_gpu_memory_utilization"
        raise (weight_load_error(error, template, str(path)) or kv_cache_error(error, flag) or error) from None
    if not cuda and (error := one_way_media_attention(llm, template)) is not None:
        raise error
    service = RolloutService(llm, str(path), args.vllm_max_model_len, device="cuda" if cuda else "cpu",
                             video_metadata=template.vllm_video_metadata)
    server.RequestHandlerClass = handler_for(service)
    print(f"mmgrpo rollout-server: serving {path} ({model_type}) on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
