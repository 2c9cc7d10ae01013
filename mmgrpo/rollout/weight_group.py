"""Weights pushed over a collective group: trainer rank 0 broadcasts them to every rollout server.

    # trainer rank 0 (mmgrpo/rollout/vllm_client.py)
    store = open_store(address, port, timeout)                  # the meeting point, hosted by the trainer
    ... each server is asked to join (POST /weights/group), then:
    group = join_group(store, session, rank=0, world_size=1 + S, backend="gloo", address=..., timeout=...)
    buffer = BucketBuffer(device)                               # reused by every bucket
    for bucket in weight_chunks(named_tensors, bucket_bytes, device):
        send_bucket(group, bucket, buffer)
    send_end(group, device)
    # each server (mmgrpo/rollout/vllm_server.py), rank 1..S
    group = join_group(connect_store(...), session, rank=i, world_size=1 + S, ...)
    for bucket in receive_buckets(group, BucketBuffer(device)):  # {HF name: tensor} until the end mark
        reload(bucket)

A torch.distributed process group of its own, apart from the trainer's: rank 0 is trainer rank 0
(which gathers each full tensor anyway), ranks 1..S the servers' engines. They meet at a
TCPStore that trainer rank 0 hosts at an address every server reaches (any host). The group is
`ProcessGroupGloo` on CPU and `ProcessGroupNCCL` on GPUs, built the same way on the same store:
only the class differs. Every collective has the group's timeout, so a rank whose peer died or
hangs raises instead of waiting for ever; a peer that dies closes its sockets, and gloo raises at
once.

One bucket is three broadcasts: a header (int64 [2]: the table's bytes, the payload's bytes), the
table (JSON: name, dtype, shape and byte offset of each tensor) and the payload (the tensors'
bytes one after another, each start aligned to 16 bytes so every dtype views it in place). A
bucket holds whole sibling groups (`weight_chunks`): vLLM reloads a fused layer from one call.
A header of zeros ends the sync.

>>> import torch
>>> tensors = {"a.weight": torch.arange(3, dtype=torch.bfloat16), "a.bias": torch.ones(2, 2)}
>>> table, payload = pack(tensors)
>>> [row[:3] for row in table], payload.numel()
([['a.weight', 'bfloat16', [3]], ['a.bias', 'float32', [2, 2]]], 32)
>>> unpacked = unpack(table, payload)
>>> all(torch.equal(unpacked[name], tensor) for name, tensor in tensors.items())
True
"""

from __future__ import annotations

import datetime
import json
import math
import socket

import torch
import torch.distributed as dist

ALIGN = 16  # bytes: a payload slice views as any dtype in place
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_local(host: str) -> bool:
    return host in LOCAL_HOSTS or host.startswith("127.")


def reachable_address(server_hosts: list[str]) -> str:
    """This host's address on the route to the servers: where they can reach the group's store.

    All servers on this host: 127.0.0.1. Otherwise the local address of the route to the first
    remote one (a UDP socket's connect picks the route and sends nothing).
    """
    remote = [host for host in server_hosts if not is_local(host)]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((remote[0], 9))
        return probe.getsockname()[0]


def open_store(address: str, port: int, timeout: float) -> dist.TCPStore:
    """The group's TCPStore, hosted by trainer rank 0 (port 0: a free one, `store.port` says which)."""
    return dist.TCPStore(address, port, None, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)


def connect_store(address: str, port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(address, port, None, False, datetime.timedelta(seconds=timeout))


def join_group(store, session: str, *, rank: int, world_size: int, backend: str, address: str, timeout: float):
    """This process's member of the weight group `session`; returns when all `world_size` joined.

    address: this process's own address as its peers reach it (gloo connects there).
    """
    prefixed = dist.PrefixStore(f"mmgrpo-weights/{session}", store)
    delta = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = delta
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def group_device(backend: str) -> torch.device:
    """Where a group's tensors live: the current GPU for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class BucketBuffer:
    """One uint8 buffer per side of the group, as large as the largest bucket and reused by every
    bucket of every sync: packing and receiving then write memory that is already mapped (a fresh
    buffer per bucket paid a page fault per 4 KiB, as much as the transfer itself on CPU).
    A bucket's tensors are views of it until the next bucket: the server's vLLM copies them into its
    own parameters before it receives the next."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.data = torch.empty(0, dtype=torch.uint8, device=self.device)

    def take(self, size: int) -> torch.Tensor:
        if self.data.numel() < size:
            self.data = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.data[:size]


def pack(tensors: dict[str, torch.Tensor], buffer: BucketBuffer | None = None) -> tuple[list, torch.Tensor]:
    """(table, payload): each tensor's [name, dtype, shape, offset] and all their bytes in one uint8 tensor."""
    table, offset = [], 0
    for name, tensor in tensors.items():
        table.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
        offset += math.ceil(tensor.numel() * tensor.element_size() / ALIGN) * ALIGN
    buffer = buffer or BucketBuffer(next(iter(tensors.values())).device)
    payload = buffer.take(offset)  # [bytes]
    for (_, _, _, start), tensor in zip(table, tensors.values()):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        payload[start: start + flat.numel()] = flat
    return table, payload


def unpack(table: list, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """`pack`'s tensors back, as views of `payload` (no copy)."""
    tensors = {}
    for name, dtype, shape, start in table:
        dtype = getattr(torch, dtype)
        size = math.prod(shape) * dtype.itemsize
        tensors[name] = payload[start: start + size].view(dtype).view(shape)
    return tensors


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send_bucket(group, tensors: dict[str, torch.Tensor], buffer: BucketBuffer) -> None:
    """Trainer rank 0: broadcast one bucket (whole sibling groups) to every server."""
    device = buffer.device
    table, payload = pack({name: tensor.to(device) for name, tensor in tensors.items()}, buffer)
    encoded = torch.frombuffer(bytearray(json.dumps(table).encode()), dtype=torch.uint8).to(device)
    _broadcast(group, torch.tensor([encoded.numel(), payload.numel()], dtype=torch.int64, device=device))
    _broadcast(group, encoded)
    _broadcast(group, payload)


def send_end(group, device: torch.device) -> None:
    """Trainer rank 0: the sync's last bucket went."""
    _broadcast(group, torch.zeros(2, dtype=torch.int64, device=device))


def receive_buckets(group, buffer: BucketBuffer):
    """A server: the buckets of one sync as {HF name: tensor}, until the trainer's end mark. A bucket's
    tensors are views of `buffer`, valid until the next bucket is asked for."""
    device = buffer.device
    while True:
        header = torch.zeros(2, dtype=torch.int64, device=device)
        _broadcast(group, header)
        table_bytes, payload_bytes = (int(n) for n in header.tolist())
        if table_bytes == 0:
            return
        encoded = torch.empty(table_bytes, dtype=torch.uint8, device=device)
        _broadcast(group, encoded)
        payload = buffer.take(payload_bytes)
        _broadcast(group, payload)
        yield unpack(json.loads(encoded.cpu().numpy().tobytes().decode()), payload)
