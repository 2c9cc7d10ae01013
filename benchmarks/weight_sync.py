"""Weight sync to a rollout server: seconds per GB over HTTP (safetensors through /dev/shm) and over
the collective weight group (gloo here), side by side on the same server, alternating per repeat.

    .venv-vllm/bin/python benchmarks/weight_sync.py                     # 2.7M and ~100M parameters, 5 repeats
    .venv-vllm/bin/python benchmarks/weight_sync.py --models 2.7m --repeats 1   # the smoke run a test makes

For each model one `mmgrpo rollout-server` (vLLM, fp32) runs in its own process, and this process
holds the model and two clients of that server, `--vllm_weight_transfer http` and `collective`.
One sync sends every parameter (full training, nothing frozen) and ends when the server has
reloaded them all in place and taken the version: what `time/weight_sync` measures in a run. Printed
per model and transfer: the median seconds per sync and per GB (fp32 bytes), CPU seconds per sync
of this process and of the server (the two share 2 cores here: wall time includes waiting), the
ratio HTTP / collective, and what NCCL's published bandwidth implies for a 7B model on GPUs.
`--plot` writes a PNG of the seconds per GB.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

MODELS = {
    "2.7m": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_hidden_layers=3),
    "100m": dict(hidden_size=320, intermediate_size=1280, num_attention_heads=10, num_key_value_heads=2,
                 vocab_size=151936),
}
# (transfer, address): HTTP to a server on this host goes through /dev/shm, to another host in the
# request body (here: this host's own network address, through the kernel's TCP stack)
ARMS = {"http (/dev/shm)": ("http", "local"), "http (body)": ("http", "network"),
        "collective (gloo)": ("collective", "local")}

# NCCL's published bus bandwidth at large messages (nccl-tests), GB/s: 8x H100 SXM over NVLink 4
# measures 460-480 (all_reduce); across nodes one NDR InfiniBand NIC carries at most 400 Gb/s = 50 GB/s.
NCCL_GBPS = {"NVLink (H100 SXM, one node)": 450.0, "InfiniBand NDR, one NIC (across nodes)": 45.0}
SEVEN_B_GB = 7.6e9 * 2 / 1e9  # a 7B model (Qwen2.5-7B: 7.6B parameters) in bf16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def network_address() -> str | None:
    """This host's address on its default route (None without one): a server reached there is "remote"."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))  # picks the route, sends nothing
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def start_server(model_path: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "mmgrpo.cli", "rollout-server", "--model", model_path, "--model_type", "qwen2-vl",
               "--host", "0.0.0.0", "--port", str(port), "--vllm_max_model_len", "1024", "--vllm_kv_cache_memory_bytes", str(64 << 20)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the rollout server exited at start-up: run `{' '.join(command)}` to see why")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise SystemExit("the rollout server did not start within 600 s") from None
            time.sleep(0.5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(model_name: str, repeats: int, progress) -> dict:
    from mmgrpo.models.loading import load_model, load_template
    from mmgrpo.models.tiny import build_tiny
    from mmgrpo.rollout.vllm_client import VLLMServerRollout

    path = str(build_tiny("qwen2-vl", **MODELS[model_name]))
    model = load_model(path)
    _, _, template = load_template(path, "qwen2-vl")
    parameters = sum(p.numel() for p in model.parameters())
    gigabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    port = free_port()
    server = start_server(path, port)
    try:
        started = time.perf_counter()
        hosts = {"local": "127.0.0.1", "network": network_address()}
        clients = {arm: VLLMServerRollout([(hosts[where], port)], path, template, transfer=transfer, timeout=600)
                   for arm, (transfer, where) in ARMS.items() if hosts[where]}
        setup = time.perf_counter() - started
        results = {arm: {"wall": [], "cpu": [], "server_cpu": []} for arm in clients}
        task = progress.add_task(f"{model_name} weight syncs", total=(repeats + 1) * len(clients))
        version = 0
        for repeat in range(repeats + 1):  # the first round warms up
            for arm, client in clients.items():
                weights = ((name, p.detach()) for name, p in model.named_parameters())
                wall, cpu, server_cpu = time.perf_counter(), time.process_time(), cpu_seconds(server.pid)
                client.update_weights(weights, version)
                if repeat:
                    results[arm]["wall"].append(time.perf_counter() - wall)
                    results[arm]["cpu"].append(time.process_time() - cpu)
                    results[arm]["server_cpu"].append(cpu_seconds(server.pid) - server_cpu)
                version += 1
                progress.advance(task)
        for client in clients.values():
            client.close()
    finally:
        server.terminate()
        server.wait(60)
    return {"parameters": parameters, "gigabytes": gigabytes, "setup_s": setup, "arms": results}


def seconds_per_gb(measured: dict) -> dict[str, float]:
    return {arm: statistics.median(row["wall"]) / measured["gigabytes"] for arm, row in measured["arms"].items()}


def report(name: str, measured: dict) -> list[str]:
    gb, arms = measured["gigabytes"], measured["arms"]
    lines = [f"\n{name}: {measured['parameters'] / 1e6:.1f}M parameters, {gb * 1e3:.0f} MB per sync (fp32)",
             "| transfer | s / sync | s / GB | CPU s / sync (trainer + server) |", "|---|---|---|---|"]
    for arm, row in arms.items():
        wall = statistics.median(row["wall"])
        lines.append(f"| {arm} | {wall:.3f} | {wall / gb:.2f} | "
                     f"{statistics.median(row['cpu']):.2f} + {statistics.median(row['server_cpu']):.2f} |")
    collective = arms["collective (gloo)"]["wall"]
    for arm in [arm for arm in arms if arm.startswith("http")]:
        ratios = [h / c for h, c in zip(arms[arm]["wall"], collective)]
        lines.append(f"{arm} / collective: {statistics.median(ratios):.2f}x median of the pairs "
                     f"({', '.join(f'{r:.2f}' for r in ratios)})")
    return lines


def nccl_lines(measured: dict) -> list[str]:
    lines = [f"\nA 7B model in bf16 ({SEVEN_B_GB:.1f} GB per sync) over NCCL, at its published bandwidth (transfer only):"]
    lines += [f"  {link}: {SEVEN_B_GB / gbps:.2f} s ({gbps:.0f} GB/s)" for link, gbps in NCCL_GBPS.items()]
    for name, m in measured.items():
        lines.append(f"  at the s/GB measured here on CPU ({name}): "
                     f"{', '.join(f'{arm} {v * SEVEN_B_GB:.0f} s' for arm, v in seconds_per_gb(m).items())}")
    return lines


def plot(measured: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    arms = list(next(iter(measured.values()))["arms"])
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        values = [seconds_per_gb(m)[arm] for m in measured.values()]
        axis.bar([x + i * width for x in range(len(measured))], values, width, label=arm)
    axis.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(measured))],
                    [f"{name} ({m['gigabytes'] * 1e3:.0f} MB per sync)" for name, m in measured.items()])
    axis.set_ylabel("seconds per GB (lower is better)")
    axis.set_title("Weight sync into a vLLM rollout server (CPU)")
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    from rich.progress import Progress

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["2.7m", "100m"])
    parser.add_argument("--repeats", type=int, default=5, help="Timed syncs per transfer (after one warm-up each).")
    parser.add_argument("--plot", type=Path, default=None, help="Write a PNG of the seconds per GB there.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    measured = {}
    with Progress() as progress:
        for name in args.models:
            measured[name] = measure(name, args.repeats, progress)
    for name, m in measured.items():
        print("\n".join(report(name, m)))
    print("\n".join(nccl_lines(measured)))
    if args.plot:
        plot(measured, args.plot)
        print(f"\nplot: {args.plot}")
    return measured


if __name__ == "__main__":
    main()
