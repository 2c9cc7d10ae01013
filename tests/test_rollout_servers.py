"""Server mode's parts that need no vLLM: the weight group over real gloo between real processes
(buckets arrive whole and exact; a peer that dies is an error at once, not a hang), the server
flags' errors, and the start-up check of the servers' checkpoints and versions.

The servers themselves (real vLLM) are tested in tests/test_vllm_server.py and tests/test_vllm_servers.py.
"""

import multiprocessing
import os
import signal
import time

import pytest
import torch

from mmgrpo.config import TrainConfig
from mmgrpo.errors import ConfigError
from mmgrpo.models.tiny import build_tiny
from mmgrpo.rollout.vllm_client import RolloutServer, check_servers, weight_chunks
from mmgrpo.rollout.vllm_wire import model_fingerprint, model_identity
from mmgrpo.rollout.weight_group import (
    BucketBuffer,
    join_group,
    open_store,
    receive_buckets,
    send_bucket,
    send_end,
)
from mmgrpo.training.startup_checks import check_train_flags

WEIGHTS = {  # names as a model has them: sibling groups of mixed dtypes and odd sizes
    "model.layers.0.self_attn.q_proj.weight": torch.randn(33, 17),
    "model.layers.0.self_attn.k_proj.weight": torch.randn(5, 17).to(torch.bfloat16),
    "model.layers.0.self_attn.k_proj.bias": torch.randn(5).to(torch.float16),
    "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32),
    "model.layers.1.self_attn.q_proj.weight": torch.randn(33, 17),
    "model.norm.weight": torch.arange(7, dtype=torch.int64),
}


def _receiver(port: int, session: str, results, die_after: int | None) -> None:
    from mmgrpo.rollout.weight_group import connect_store

    group = join_group(connect_store("127.0.0.1", port, 20), session, rank=1, world_size=2, backend="gloo",
                       address="127.0.0.1", timeout=20)
    received = {}
    try:
        for bucket in receive_buckets(group, BucketBuffer()):
            received.update({name: tensor.clone() for name, tensor in bucket.items()})
            results.put(("bucket", sorted(bucket)))
            if die_after is not None and len(received) >= die_after:
                os.kill(os.getpid(), signal.SIGKILL)
        results.put(("done", {name: tensor.tolist() for name, tensor in received.items()}))
    except RuntimeError as error:
        results.put(("error", str(error).splitlines()[0]))


def _start_receiver(session: str, die_after: int | None = None):
    store = open_store("127.0.0.1", 0, 20)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_receiver, args=(store.port, session, results, die_after))
    process.start()
    group = join_group(store, session, rank=0, world_size=2, backend="gloo", address="127.0.0.1", timeout=20)
    return store, group, process, results


def test_buckets_arrive_whole_and_exact_over_gloo():
    store, group, process, results = _start_receiver("exact")
    buckets, buffer = list(weight_chunks(WEIGHTS.items(), chunk_bytes=1000)), BucketBuffer()
    for bucket in buckets:  # one buffer for all: each bucket overwrites the last one's bytes
        send_bucket(group, bucket, buffer)
    send_end(group, torch.device("cpu"))
    arrived = [results.get(timeout=60) for _ in range(len(buckets) + 1)]
    process.join(30)
    assert [names for kind, names in arrived[:-1]] == [sorted(bucket) for bucket in buckets]
    # q/k/v of layer 0 in one bucket (vLLM fuses them), each tensor bit-exact in its dtype
    assert any({"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias"} <= set(names)
               for _, names in arrived[:-1])
    kind, received = arrived[-1]
    assert kind == "done" and set(received) == set(WEIGHTS)
    for name, tensor in WEIGHTS.items():
        assert torch.equal(torch.tensor(received[name], dtype=tensor.dtype), tensor), name


def test_a_receiver_killed_mid_sync_is_an_error_at_once_for_the_sender():
    store, group, process, results = _start_receiver("receiver-dies", die_after=1)
    started = time.monotonic()
    with pytest.raises(RuntimeError):  # the receiver's sockets closed: gloo raises, no 20 s wait
        for bucket in weight_chunks(WEIGHTS.items(), chunk_bytes=1):
            send_bucket(group, bucket, BucketBuffer())
            time.sleep(0.2)
        send_end(group, torch.device("cpu"))
    assert time.monotonic() - started < 15
    process.join(30)
    assert process.exitcode == -signal.SIGKILL


def test_a_sender_gone_mid_sync_is_an_error_for_the_receiver():
    store, group, process, results = _start_receiver("sender-dies")
    send_bucket(group, dict(list(WEIGHTS.items())[:1]), BucketBuffer())
    assert results.get(timeout=60)[0] == "bucket"
    del group  # the trainer's end of the group closes (as when its process is killed)
    kind, message = results.get(timeout=30)
    process.join(30)
    assert kind == "error", message


def test_a_bucket_is_built_as_the_gathered_tensors_come_never_the_whole_model():
    pulled = []

    def gathered():  # what a sharded model yields: one full tensor at a time
        for pair in WEIGHTS.items():
            pulled.append(pair[0])
            yield pair

    held = 0
    for bucket in weight_chunks(gathered(), chunk_bytes=1000):
        held += len(bucket)
        assert len(pulled) <= held + 1, (pulled, list(bucket))  # the bucket, and the next tensor that closed it
    assert held == len(WEIGHTS)


def _cfg(*extra):
    return TrainConfig.from_args(["--use_vllm", "--vllm_mode", "server", "--report_to", "none", *extra])


@pytest.mark.parametrize("flags, named", [
    (["--vllm_server_host", "10.0.0.1", "10.0.0.2", "10.0.0.3", "--vllm_server_port", "8000", "8001"],
     "--vllm_server_host names 3 hosts and --vllm_server_port 2 ports"),
    (["--vllm_server_port", "8000", "8000"], "127.0.0.1:8000 is listed twice"),
    (["--vllm_weight_bucket_mb", "0"], "--vllm_weight_bucket_mb 0"),
    (["--vllm_weight_transfer", "nccl"], "--vllm_weight_transfer 'nccl'"),
    (["--vllm_group_port", "70000"], "--vllm_group_port 70000"),
])
def test_server_flags_that_cannot_work_are_errors_naming_the_flag(flags, named):
    with pytest.raises(ConfigError, match=named):
        check_train_flags(_cfg(*flags))


def test_several_servers_are_accepted():
    cfg = _cfg("--vllm_server_host", "10.0.0.1", "10.0.0.2", "--vllm_server_port", "8000")
    check_train_flags(cfg)  # a trainer in server mode needs no vLLM installed
    assert cfg.rollout.vllm_server_host == ["10.0.0.1", "10.0.0.2"] and cfg.rollout.vllm_server_port == [8000]


def _health(path, **changes) -> dict:
    import mmgrpo

    return {"identity": model_identity(str(path)), "fingerprint": model_fingerprint(str(path)), "model": str(path),
            "mmgrpo": mmgrpo.__version__, **changes}


def test_servers_of_different_checkpoints_or_versions_are_refused_naming_both(tmp_path):
    ours = build_tiny("qwen2-vl", cache_dir=tmp_path)
    fine_tune = build_tiny("qwen2-vl", cache_dir=tmp_path, seed=1)  # the same architecture, other weights
    a, b = RolloutServer("10.0.0.1", 8000, 5), RolloutServer("10.0.0.2", 8000, 5)
    check_servers([a, b], [_health(ours), _health(ours)], str(ours))  # copies of one checkpoint: fine
    with pytest.raises(ConfigError, match=r"10\.0\.0\.1:8000 and http://10\.0\.0\.2:8000 serve different checkpoints"):
        check_servers([a, b], [_health(ours), _health(fine_tune)], str(ours))
    with pytest.raises(ConfigError, match=rf"another checkpoint than this run's {ours}"):
        check_servers([a, b], [_health(fine_tune), _health(fine_tune)], str(ours))
    with pytest.raises(ConfigError, match=r"10\.0\.0\.2:8000 runs mmgrpo 0\.0\.1, this trainer mmgrpo"):
        check_servers([a, b], [_health(ours), _health(ours, mmgrpo="0.0.1")], str(ours))


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 21\r\n\r\n",  # killed after the headers: IncompleteRead
    b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{\"ok\": tr",  # a whole body that is not JSON
    b"",  # killed before answering: RemoteDisconnected
])
def test_a_server_that_dies_mid_answer_is_a_rollout_server_error(answer):
    import socket
    import threading

    from mmgrpo.rollout.vllm_client import RolloutServerError

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_once():
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(answer)
        connection.close()

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    server = RolloutServer("127.0.0.1", listener.getsockname()[1], 5)
    try:
        with pytest.raises(RolloutServerError, match=r"stopped answering during /weights/finish"):
            server.post("/weights/finish", query="version=3")
    finally:
        thread.join(5)
        listener.close()
