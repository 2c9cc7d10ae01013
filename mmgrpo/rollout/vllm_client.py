"""The trainer's side of `--vllm_mode server`: a rollout engine whose vLLM runs in one or several
`mmgrpo rollout-server`s, for every trainer rank (one process, or torchrun on one or several nodes).

    engine = VLLMServerRollout([("10.0.0.5", 8000), ("10.0.0.6", 8000)], model_path, template,
                               rank=rank, world_size=world_size)   # every server checked at start-up
    rollout = engine.generate(prompts, sampling)    # this rank's prompts to its servers, ids + log-probs back
    engine.update_weights(named_tensors, version)   # every rank iterates (gathers); rank 0 pushes to every server

Requests: rank r sends its prompts to server r mod S when there are no more servers than ranks,
and otherwise splits them over servers r, r + W, r + 2W, ... (`servers_of_rank`). A prompt's seeds
travel with it (`sampling_options`), so its completions do not depend on the server that drew them.

Weights go from trainer rank 0, which has each full tensor anyway (FSDP2 / ZeRO-3 gather one at a
time on every rank), in buckets that close only between sibling groups (`weight_chunks`: a fused
layer's weights in one bucket), then `/weights/finish` tags the version on every server:
`--vllm_weight_transfer collective` broadcasts them over a process group of its own with every
server (mmgrpo/rollout/weight_group.py: gloo, or NCCL where trainer and servers are all on GPUs);
`http` posts safetensors chunks, through /dev/shm to a server on this host, in the body otherwise.

Faults: every request and the weight group have a timeout, and after the start-up check, every
rollout and every sync the trainer ranks agree (`RankAgreement`: each rank's error, if any, to
all), so a server that died or hangs stops every rank with the same line naming the server and the
newest complete checkpoint to resume from; no rank is left waiting in a collective.
"""

from __future__ import annotations

import datetime
import http.client
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlencode

import torch

import mmgrpo
from mmgrpo import errors
from mmgrpo.errors import ConfigError, MMGRPOError
from mmgrpo.rollout.base import PartialRollout, Rollout, RolloutEngine, SamplingParams
from mmgrpo.rollout.vllm_partial import (
    ChunkRequest,
    chunk_options,
    chunk_requests,
    chunk_result,
    rollout_of_partial,
)
from mmgrpo.rollout.vllm_requests import (
    check_media_tokens,
    check_prompt_lengths,
    check_vllm_prompts,
    rollout_from_completions,
    sampling_options,
)
from mmgrpo.rollout.vllm_weights import vllm_named
from mmgrpo.rollout.vllm_wire import encode_prompts, model_fingerprint, model_identity
from mmgrpo.rollout.weight_group import (
    BucketBuffer,
    group_device,
    is_local,
    join_group,
    open_store,
    reachable_address,
    send_bucket,
    send_end,
)
from mmgrpo.rollout.weight_sync import sibling_group


class RolloutServerError(MMGRPOError):
    """The rollout server is unreachable, died, or refused a request."""


def servers_of_rank(rank: int, world_size: int, num_servers: int) -> list[int]:
    """The servers trainer rank `rank` sends its prompts to: every server serves some rank.

    >>> servers_of_rank(1, 4, 2), servers_of_rank(3, 4, 2), servers_of_rank(0, 2, 5), servers_of_rank(0, 1, 1)
    ([1], [1], [0, 2, 4], [0])
    """
    if num_servers <= world_size:
        return [rank % num_servers]
    return list(range(rank, num_servers, world_size))


def split_evenly(count: int, parts: int) -> list[range]:
    """`count` indices in `parts` contiguous runs, the first ones one longer.

    >>> split_evenly(5, 2), split_evenly(1, 3)
    ([range(0, 3), range(3, 5)], [range(0, 1), range(1, 1), range(1, 1)])
    """
    sizes = [count // parts + (i < count % parts) for i in range(parts)]
    bounds = [sum(sizes[:i]) for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def weight_chunks(named_tensors, chunk_bytes: int, device: torch.device | str = "cpu"):
    """(name, tensor) pairs as dicts of tensors on `device`, each closed once it holds `chunk_bytes`,
    but only between sibling groups (`mmgrpo.rollout.weight_sync.sibling_group`): the server's vLLM
    reloads a fused layer (qkv_proj, gate_up_proj) from the weights of one call, so q/k/v never
    straddle two chunks.

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
        chunk[name] = tensor.detach().to(device).contiguous()
        size += tensor.numel() * tensor.element_size()
        group = this_group
    if chunk:
        yield chunk


# a server that is down, slow, or killed mid-answer (IncompleteRead, RemoteDisconnected: http.client)
_DROPPED = (urllib.error.URLError, OSError, http.client.HTTPException)


class RolloutServer:
    """One `mmgrpo rollout-server` over HTTP: every request has a timeout, every failure is a
    RolloutServerError that names the server."""

    def __init__(self, host: str, port: int, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.url = f"http://{host}:{port}"
        self.local = is_local(host)

    def wait_for_health(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    return json.loads(response.read())
            except _DROPPED as error:
                if time.monotonic() > deadline:
                    raise RolloutServerError(
                        f"no rollout server answers at {self.url} after {self.timeout:.0f} s ({_reason(error)}): start "
                        "it with `mmgrpo rollout-server --model ... --model_type ... --port ...`, or check "
                        "--vllm_server_host / --vllm_server_port."
                    ) from None
                time.sleep(0.5)

    def health_now(self, timeout: float = 5.0) -> dict | None:
        """/health once, or None where the server does not answer."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as response:
                return json.loads(response.read())
        except (*_DROPPED, ValueError):
            return None

    def post(self, route: str, body: bytes = b"", query: str = "", timeout: float | None = None) -> dict:
        request = urllib.request.Request(self.url + route + (f"?{query}" if query else ""), data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = json.loads(error.read() or b"{}").get("error", error.reason)
            raise RolloutServerError(f"the rollout server at {self.url} refused {route}: {detail}.") from None
        except (*_DROPPED, json.JSONDecodeError) as error:
            raise RolloutServerError(
                f"the rollout server at {self.url} stopped answering during {route} ({_reason(error)})."
            ) from None


class RankAgreement:
    """Every trainer rank learns the first error of any rank (a gloo all-gather per call), so all stop
    together instead of some waiting in the next collective for a rank that stopped.

    Two groups of their own: rollouts may run in a thread beside the syncs (`--async_generate`), and
    one group's collectives must come in the same order on every rank. So every rank calls
    `generate` (and `update_weights`) equally often, as HF's synced generation already needs under
    FSDP2 / ZeRO-3: extra rounds are agreed across ranks (mmgrpo/rollout/rounds.py), and multi-turn
    episodes, whose turns differ per rank, run in one process (mmgrpo/config/checks.py).
    """

    def __init__(self, world_size: int, timeout: float):
        self.world_size, self.groups = world_size, {}
        if world_size > 1:
            import torch.distributed as dist

            # longer than any one request: a rank waits for a rank whose request times out
            delta = datetime.timedelta(seconds=timeout + 60)
            self.groups = {name: dist.new_group(backend="gloo", timeout=delta) for name in ("sync", "generate")}

    def gather(self, channel: str, value) -> list:
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist

        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.groups[channel])
        return values

    def close(self) -> None:
        import torch.distributed as dist

        for group in self.groups.values():
            dist.destroy_process_group(group)
        self.groups = {}


class VLLMServerRollout(RolloutEngine):
    separate_weights = True
    can_pause = True  # --partial_rollouts: a completion continues from its tokens (mmgrpo/rollout/vllm_partial.py)

    def __init__(self, servers: list[tuple[str, int]], model_path: str, template, *, rank: int = 0,
                 world_size: int = 1, device: torch.device | str = "cpu", timeout: float = 240.0,
                 bucket_bytes: int = 256 << 20, transfer: str = "collective", group_host: str | None = None,
                 group_port: int = 0, checkpoint_dir: str | None = None, suppress_placeholders: bool = True):
        """servers: (host, port) of every server; rank, world_size: this trainer process among all.
        checkpoint_dir: where the run saves its checkpoints (named in the line that stops the run)."""
        self.servers = [RolloutServer(host, port, timeout) for host, port in servers]
        self.mine = [self.servers[i] for i in servers_of_rank(rank, world_size, len(self.servers))]
        self.rank, self.template, self.timeout, self.bucket_bytes = rank, template, timeout, bucket_bytes
        self.device, self.checkpoint_dir = torch.device(device), checkpoint_dir
        self.suppress_placeholders = suppress_placeholders
        self.processor_kwargs = template.rollout_processor_kwargs()
        self.ranks = RankAgreement(world_size, timeout)
        self.weight_group: TrainerWeightGroup | None = None
        error = None
        try:
            healths = [server.wait_for_health() for server in self.servers]
            check_servers(self.servers, healths, model_path)
            self.max_model_len = min(health["max_model_len"] for health in healths)
            backend = "nccl" if self.device.type == "cuda" and all(h["device"] == "cuda" for h in healths) else "gloo"
            if rank == 0 and transfer == "collective":
                self.weight_group = TrainerWeightGroup(self.servers, backend, group_host, group_port, timeout)
        except MMGRPOError as raised:
            error = raised
        self._agree("sync", error)
        # What the servers hold is not known (another run's weights, a checkpoint of the same shape):
        # a version no policy has, so the pipeline sends this run's weights before the first rollout.
        self.weight_version = -1
        self.syncs = 0

    def generate(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None) -> Rollout:
        """B encoded prompts -> B x G completions; resume: a rollout of them paused by `continue_`, finished here."""
        if resume is not None:
            return rollout_of_partial(self.continue_(prompts, sampling, resume), sampling, self.template)
        rollout, error = None, None
        try:
            rollout = self._generate(prompts, sampling)
        except MMGRPOError as raised:
            error = raised
        self._agree("generate", error)
        return rollout

    def continue_(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None,
                  until: int | None = None) -> PartialRollout:
        """One chunk of a rollout (--partial_rollouts) on the servers' weights now, up to decode step
        `until` (None: the end), from where `resume` stopped; every rank calls it (one agreement)."""
        partial, error = resume, None
        try:
            if resume is None or not resume.complete:
                partial = self._continue(prompts, sampling, resume, until)
        except MMGRPOError as raised:
            error = raised
        self._agree("generate", error)
        return partial

    def update_weights(self, named_tensors, version: int) -> None:
        """Every rank iterates `named_tensors` to the end (a sharded model gathers each tensor on every
        rank); rank 0 sends them to every server, then tags them `version`."""
        named_tensors, error = iter(named_tensors), None
        if self.rank == 0:
            try:
                self._push(named_tensors, version)
            except MMGRPOError as raised:
                error = raised
        for _ in named_tensors:  # the other ranks' gathers, and rank 0's after a failure: collectives stay paired
            pass
        self._agree("sync", error)
        self.weight_version = version
        self.syncs += 1

    def close(self) -> None:
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None
        self.ranks.close()

    # ---- rollouts -------------------------------------------------------------------------------

    def _generate(self, prompts: list, sampling: SamplingParams) -> Rollout:
        check_prompt_lengths(prompts, self.max_model_len, sampling.max_new_tokens)
        check_vllm_prompts(prompts, self.template)
        replies = [reply for _, reply in self._fan_out(list(range(len(prompts))),
                                                       lambda server, part: self._request(server, part, prompts, sampling))]
        self.last_prompt_token_ids = [ids for reply in replies for ids in reply["prompt_token_ids"]]
        check_media_tokens(prompts, self.last_prompt_token_ids, self.template)
        rows = [row for reply in replies for row in reply["completions"]]
        return rollout_from_completions(rows, self.template, sampling.max_new_tokens, replies[0]["weight_version"])

    def score(self, prompts: list, completion_ids: torch.Tensor, completion_mask: torch.Tensor, group: int) -> torch.Tensor:
        """[N, T] each completion token's log-prob under the servers' model (--teacher_server_port:
        on-policy distillation's teacher), 0 outside `completion_mask`; completion i is of prompt i // group.
        Each completion goes as one request, its prompt followed by its tokens (`continued_prompt`), and
        vLLM's prompt log-probs of those tokens come back: of the raw logits (temperature 1, whatever the
        request's; so --teacher_server_port needs --temperature 1)."""
        logps, error = torch.zeros(completion_ids.shape, dtype=torch.float32), None
        try:
            lengths = completion_mask.sum(1).tolist()
            requests = [ChunkRequest(row // group, [row], 1, completion_ids[row, :n].tolist())
                        for row, n in enumerate(lengths) if n]
            for part, reply in self._fan_out(requests, lambda server, part: self._request_scores(server, part, prompts)):
                for request, scores in zip(part, reply["prompt_logprobs"], strict=True):
                    logps[request.rows[0], : len(scores)] = torch.tensor(scores, dtype=torch.float32)
        except MMGRPOError as raised:
            error = raised
        self._agree("generate", error)
        return logps * completion_mask.to(logps.device)

    def _request_scores(self, server: RolloutServer, requests: list, prompts: list) -> dict:
        options = [dict(n=1, max_tokens=1, temperature=1.0, logprobs=0, prompt_logprobs=0, detokenize=False,
                        continue_ids=request.tokens) for request in requests]
        return self._post(server, [prompts[request.prompt] for request in requests], options)

    def _continue(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None, until: int | None) -> PartialRollout:
        check_prompt_lengths(prompts, self.max_model_len, sampling.max_new_tokens)
        check_vllm_prompts(prompts, self.template)
        requests = chunk_requests(len(prompts), sampling, resume, until)
        answered = self._fan_out(requests, lambda server, part: self._request_chunk(server, part, prompts, sampling))
        replies = [reply for _, reply in answered]
        asked = [request for part, _ in answered for request in part]
        prompt_ids = [ids[: len(ids) - len(request.tokens or [])]  # the prompt's own ids, before a completion's tokens
                      for part, reply in answered for ids, request in zip(reply["prompt_token_ids"], part)]
        check_media_tokens([prompts[request.prompt] for request in asked], prompt_ids, self.template)
        rows = iter([row for reply in replies for row in reply["completions"]])
        completions = [[next(rows) for _ in request.rows] for request in asked]
        version = replies[0]["weight_version"] if replies else self.weight_version
        return chunk_result(asked, completions, sampling, resume, version, self.template.completion_pad_id,
                            self.template.eos_token_ids)

    def _request_chunk(self, server: RolloutServer, requests: list, prompts: list, sampling: SamplingParams) -> dict:
        options = [chunk_options(request, sampling, self.template, suppress=self.suppress_placeholders) for request in requests]
        return self._post(server, [prompts[request.prompt] for request in requests], options)

    def _fan_out(self, items: list, ask) -> list[tuple[list, dict]]:
        """`items` split evenly over this rank's servers, each part asked of its server by
        `ask(server, part)` (at once where there are several): (part, reply) in order, empty parts not asked."""
        jobs = [(server, [items[i] for i in indices])
                for server, indices in zip(self.mine, split_evenly(len(items), len(self.mine))) if indices]
        if len(jobs) <= 1:
            return [(part, ask(server, part)) for server, part in jobs]
        with ThreadPoolExecutor(len(jobs)) as pool:  # several servers for this rank: at once
            replies = list(pool.map(lambda job: ask(*job), jobs))
        return [(part, reply) for (_, part), reply in zip(jobs, replies)]

    def _request(self, server: RolloutServer, indices: list[int], prompts: list, sampling: SamplingParams) -> dict:
        options = []
        for b in indices:  # b: the prompt's index in this rank's batch, which fixes its seeds
            option = sampling_options(sampling, self.template, b, suppress=self.suppress_placeholders)
            option["copies"] = sampling.num_generations if sampling.greedy else 1
            options.append(option)
        return self._post(server, [prompts[b] for b in indices], options)

    def _post(self, server: RolloutServer, prompts: list, options: list[dict]) -> dict:
        """One /generate request of `server`: each prompt with its sampling options, at this client's version."""
        body = encode_prompts(prompts, options, self.processor_kwargs, self.template.sampling_rate, self.weight_version)
        return server.post("/generate", body)

    # ---- weights --------------------------------------------------------------------------------

    def _push(self, named_tensors, version: int) -> None:
        named_tensors = vllm_named(named_tensors, self.template)  # as vLLM loads them (the family's rules)
        if self.weight_group is not None:
            self.weight_group.push(named_tensors, self.bucket_bytes)
        else:
            for chunk in weight_chunks(named_tensors, self.bucket_bytes):
                self._post_chunk(chunk)
        for server in self.servers:
            server.post("/weights/finish", query=f"version={version}")

    def _post_chunk(self, tensors: dict[str, torch.Tensor]) -> None:
        """HTTP: one /dev/shm file that every server on this host reads; the bytes in the body to the others."""
        from safetensors.torch import save, save_file

        local = [server for server in self.servers if server.local]
        if local:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
            handle, path = tempfile.mkstemp(prefix="mmgrpo-weights-", suffix=".safetensors", dir=folder)
            os.close(handle)
            try:
                save_file(tensors, path)
                for server in local:
                    server.post("/weights", query=f"path={path}")
            finally:
                os.unlink(path)
        remote = [server for server in self.servers if not server.local]
        if remote:
            body = save(tensors)
            for server in remote:
                server.post("/weights", body)

    # ---- faults ---------------------------------------------------------------------------------

    def _agree(self, channel: str, error: MMGRPOError | None) -> None:
        """Raise on every rank where any rank failed: the first failing rank's error, with the
        newest complete checkpoint (as rank 0 sees it) for a server that failed."""
        reported = self.ranks.gather(channel, None if error is None else (type(error).__name__, str(error)))
        failed = next((found for found in reported if found is not None), None)
        if failed is None:
            return
        newest = self.ranks.gather(channel, newest_checkpoint(self.checkpoint_dir) if self.rank == 0 else None)[0]
        kind, message = failed
        if kind != RolloutServerError.__name__:  # a flag or a sample: as the failing rank raised it
            if error is not None:
                raise error
            raise getattr(errors, kind, MMGRPOError)(message)
        raise RolloutServerError(f"{message} {resume_hint(newest)}")


class TrainerWeightGroup:
    """Trainer rank 0's side of the weight group with every server (mmgrpo/rollout/weight_group.py)."""

    def __init__(self, servers: list[RolloutServer], backend: str, host: str | None, port: int, timeout: float):
        self.servers, self.backend, self.timeout = servers, backend, timeout
        self.buffer = BucketBuffer(group_device(backend))  # one bucket's bytes, reused by every sync
        self.session = uuid.uuid4().hex[:12]
        address = host or reachable_address([server.host for server in servers])
        try:
            self.store = open_store(address, port, timeout)
        except (RuntimeError, OSError) as error:
            raise ConfigError(f"--vllm_group_host {address} --vllm_group_port {port}: cannot host the weight group "
                              f"there ({_first_line(error)}); pick a free port or an address of this host.") from None
        query = dict(address=address, port=self.store.port, session=self.session, world_size=len(servers) + 1,
                     backend=backend, timeout=timeout)
        for rank, server in enumerate(servers, start=1):
            server.post("/weights/group", query=urlencode({**query, "rank": rank}))
        try:
            self.group = join_group(self.store, self.session, rank=0, world_size=len(servers) + 1, backend=backend,
                                    address=address, timeout=timeout)
        except RuntimeError as error:
            raise RolloutServerError(
                f"the weight group with the rollout servers at {', '.join(s.url for s in servers)} did not form "
                f"({_first_line(error)}): every server must reach {address}:{self.store.port} (set --vllm_group_host / "
                "--vllm_group_port), or use --vllm_weight_transfer http."
            ) from None

    def push(self, named_tensors, bucket_bytes: int) -> None:
        if self.group is None:
            raise RolloutServerError("the weight group broke in an earlier sync.")
        for server in self.servers:
            server.post("/weights/receive", query=f"session={self.session}")
        try:
            for bucket in weight_chunks(named_tensors, bucket_bytes, self.buffer.device):
                send_bucket(self.group, bucket, self.buffer)
            send_end(self.group, self.buffer.device)
        except RuntimeError as error:  # a server died or hangs mid-sync
            self.group = None  # dropped: its sockets close, and the servers still in it stop waiting
            raise RolloutServerError(
                f"{self._stopped()} during a weight sync over the {self.backend} group ({_first_line(error)})."
            ) from None

    def _stopped(self) -> str:
        """Which servers stopped, by who still answers and what the others say of their sync."""
        healths = {server.url: server.health_now() for server in self.servers}
        silent = [url for url, health in healths.items() if health is None]
        if silent:
            return f"the rollout server at {', '.join(silent)} stopped answering"
        failed = [f"{url} ({health['sync_error']})" for url, health in healths.items() if health.get("sync_error")]
        if failed:
            return f"the rollout server at {', '.join(failed)} failed"
        return f"a rollout server of {', '.join(healths)} stopped receiving"

    def close(self) -> None:
        """Tell the servers this trainer is done: they drop its group at once (best effort)."""
        for server in self.servers:
            try:
                server.post("/weights/leave", query=f"session={self.session}", timeout=5)
            except RolloutServerError:
                pass
        self.group = None


def check_servers(servers: list[RolloutServer], healths: list[dict], model_path: str) -> None:
    """ConfigError unless every server runs this mmgrpo and serves the same checkpoint, of this run's model."""
    for server, health in zip(servers, healths):
        if health.get("mmgrpo") != mmgrpo.__version__:
            raise ConfigError(
                f"the rollout server at {server.url} runs mmgrpo {health.get('mmgrpo', 'older than 0.1')}, this trainer "
                f"mmgrpo {mmgrpo.__version__}: run the same version on both."
            )
    first, first_health = servers[0], healths[0]
    for server, health in zip(servers[1:], healths[1:]):
        if health["fingerprint"] != first_health["fingerprint"]:
            raise ConfigError(
                f"the rollout servers at {first.url} and {server.url} serve different checkpoints: "
                f"{first_health['model']} ({_describe(first_health['identity'])}, fingerprint {first_health['fingerprint']}) "
                f"and {health['model']} ({_describe(health['identity'])}, fingerprint {health['fingerprint']}): "
                "start every server with the trainer's --model."
            )
    expected = model_identity(model_path)
    if first_health["identity"] != expected:
        raise ConfigError(
            f"the rollout server at {first.url} serves {first_health['model']} ({_describe(first_health['identity'])}), "
            f"but this run trains {model_path} ({_describe(expected)}): start it with --model {model_path}."
        )
    fingerprint = model_fingerprint(model_path)
    if first_health["fingerprint"] != fingerprint:  # same architecture: another fine-tune, another step
        raise ConfigError(
            f"the rollout server at {first.url} serves {first_health['model']} (fingerprint {first_health['fingerprint']}), "
            f"another checkpoint than this run's {model_path} (fingerprint {fingerprint}); the weights a run does not "
            f"train are never sent, so they must agree: start it with --model {model_path}."
        )


def newest_checkpoint(folder: str | None) -> str | None:
    """The newest complete checkpoint in the run's output folder, as a path (None: none yet)."""
    from mmgrpo.runstate.checkpoint import latest_checkpoint

    found = latest_checkpoint(folder) if folder else None
    return str(found) if found else None


def resume_hint(checkpoint: str | None) -> str:
    """What to do after a server failed, in one sentence."""
    if checkpoint is None:
        return "No complete checkpoint was saved yet: restart the server and start the run again."
    return (f"Restart the server and resume from the newest complete checkpoint, {checkpoint} "
            "(`--resume_from_checkpoint latest`).")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _reason(error: BaseException) -> str:
    reason = getattr(error, "reason", None) or error
    return str(reason) or type(error).__name__


def _describe(identity: dict) -> str:
    archs = ", ".join(identity.get("architectures") or []) or identity.get("model_type")
    return (f"{archs}, hidden {identity.get('hidden_size')}, {identity.get('num_hidden_layers')} layers, "
            f"vocab {identity.get('vocab_size')}")
