"""The trainer's side of `--vllm_mode server`: a rollout engine whose vLLM runs in `mmgrpo rollout-server`.

    engine = VLLMServerRollout("127.0.0.1", 8000, model_path, template)   # waits for the server, checks its model
    rollout = engine.generate(prompts, sampling)        # prompts + media over HTTP, ids + log-probs back
    engine.update_weights(named_tensors, version)       # safetensors chunks, then a version tag

Weights travel as safetensors chunks of about `chunk_bytes` (never the whole model at once; a fused
layer's weights in one chunk): through
/dev/shm when the server is on this host, in the request body otherwise. Every request has a timeout,
so a server that died or hangs is a one-line error (`RolloutServerError`), not a hang; the run stops
there and the checkpoints it saved stay as they are.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request

import torch

from mmgrpo.errors import ConfigError, MMGRPOError
from mmgrpo.rollout.base import Rollout, RolloutEngine, SamplingParams
from mmgrpo.rollout.vllm_requests import (
    check_media_tokens,
    check_prompt_lengths,
    check_vllm_prompts,
    rollout_from_completions,
    sampling_options,
)
from mmgrpo.rollout.vllm_weights import vllm_named
from mmgrpo.rollout.vllm_wire import encode_prompts, model_identity
from mmgrpo.rollout.weight_sync import sibling_group

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def weight_chunks(named_tensors, chunk_bytes: int):
    """(name, tensor) pairs as dicts of CPU tensors, each closed once it holds `chunk_bytes`, but
    only between sibling groups (`mmgrpo.rollout.weight_sync.sibling_group`): the server's vLLM reloads a fused
    layer (qkv_proj, gate_up_proj) from the weights of one call, so q/k/v never straddle two chunks.

    >>> t = torch.zeros(4)   # 16 bytes
    >>> names = ["l0.attn.q.weight", "l0.attn.k.weight", "l0.attn.v.weight", "l0.mlp.up.weight", "l1.attn.q.weight"]
    >>> [list(c) for c in weight_chunks(((n, t) for n in names), chunk_bytes=16)]
    [['l0.attn.q.weight', 'l0.attn.k.weight', 'l0.attn.v.weight'], ['l0.mlp.up.weight'], ['l1.attn.q.weight']]
    """
    chunk, size, group = {}, 0, None
    for name, tensor in named_tensors:
        this_group = sibling_group(name)
        if chunk and size >= chunk_bytes and this_group != group:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        group = this_group
    if chunk:
        yield chunk


class RolloutServerError(MMGRPOError):
    """The rollout server is unreachable, died, or refused a request."""


class VLLMServerRollout(RolloutEngine):
    separate_weights = True

    def __init__(self, host: str, port: int, model_path: str, template, *, timeout: float = 240.0,
                 chunk_bytes: int = 256 << 20, suppress_placeholders: bool = True):
        self.url = f"http://{host}:{port}"
        self.template, self.timeout, self.chunk_bytes = template, timeout, chunk_bytes
        self.local = host in LOCAL_HOSTS or host.startswith("127.")
        self.suppress_placeholders = suppress_placeholders
        self.processor_kwargs = template.rollout_processor_kwargs()
        health = self._wait_for_server()
        expected = model_identity(model_path)
        if health["identity"] != expected:
            raise ConfigError(
                f"the rollout server at {self.url} serves {health['model']} ({_describe(health['identity'])}), "
                f"but this run trains {model_path} ({_describe(expected)}): start it with --model {model_path}."
            )
        self.max_model_len = health["max_model_len"]
        # What the server holds is not known (another run's weights, a checkpoint of the same shape):
        # a version no policy has, so the pipeline sends this run's weights before the first rollout.
        self.weight_version = -1
        self.syncs = 0

    def generate(self, prompts: list, sampling: SamplingParams) -> Rollout:
        check_prompt_lengths(prompts, self.max_model_len, sampling.max_new_tokens)
        check_vllm_prompts(prompts, self.template)
        options = []
        for b in range(len(prompts)):
            option = sampling_options(sampling, self.template, b, suppress=self.suppress_placeholders)
            option["copies"] = sampling.num_generations if sampling.greedy else 1
            options.append(option)
        body = encode_prompts(prompts, options, self.processor_kwargs, self.template.sampling_rate, self.weight_version)
        reply = self._post("/generate", body)
        self.last_prompt_token_ids = reply["prompt_token_ids"]
        check_media_tokens(prompts, reply["prompt_token_ids"], self.template)
        return rollout_from_completions(reply["completions"], self.template, sampling.max_new_tokens,
                                        reply["weight_version"])

    def update_weights(self, named_tensors, version: int) -> None:
        """Send (HF name, tensor) pairs, renamed as vLLM loads them, in chunks of about `chunk_bytes`,
        then tag them `version`."""
        for chunk in weight_chunks(vllm_named(named_tensors, self.template), self.chunk_bytes):
            self._send_chunk(chunk)
        self._post("/weights/finish", b"", query=f"version={version}")
        self.weight_version = version
        self.syncs += 1

    # ---- HTTP ------------------------------------------------------------------------------------

    def _send_chunk(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save, save_file

        if self.local:  # same host: through shared memory, the server deletes the file once read
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
            handle, path = tempfile.mkstemp(prefix="mmgrpo-weights-", suffix=".safetensors", dir=folder)
            os.close(handle)
            save_file(tensors, path)
            try:
                self._post("/weights", b"", query=f"path={path}")
            finally:
                if os.path.exists(path):
                    os.unlink(path)
        else:
            self._post("/weights", save(tensors))

    def _wait_for_server(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    return json.loads(response.read())
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                if time.monotonic() > deadline:
                    raise RolloutServerError(
                        f"no rollout server answers at {self.url} after {self.timeout:.0f} s ({_reason(error)}): start "
                        "it with `mmgrpo rollout-server --model ... --model_type ... --port ...`, or check "
                        "--vllm_server_host / --vllm_server_port."
                    ) from None
                time.sleep(0.5)

    def _post(self, route: str, body: bytes, query: str = "") -> dict:
        request = urllib.request.Request(self.url + route + (f"?{query}" if query else ""), data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = json.loads(error.read() or b"{}").get("error", error.reason)
            raise RolloutServerError(f"the rollout server at {self.url} refused {route}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            raise RolloutServerError(
                f"the rollout server at {self.url} stopped answering during {route} ({_reason(error)}); restart "
                "`mmgrpo rollout-server` and resume from the last checkpoint."
            ) from None


def _reason(error: BaseException) -> str:
    reason = getattr(error, "reason", None) or error
    return str(reason) or type(error).__name__


def _describe(identity: dict) -> str:
    archs = ", ".join(identity.get("architectures") or []) or identity.get("model_type")
    return (f"{archs}, hidden {identity.get('hidden_size')}, {identity.get('num_hidden_layers')} layers, "
            f"vocab {identity.get('vocab_size')}")
