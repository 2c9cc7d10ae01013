"""Asynchronous training (--max_staleness K) against synchronous, on the same work: samples/s, and
where the overlap comes from.

    python benchmarks/async_rollout.py                           # sync, K = 1, K = 2; in-process engine on a copy
    python benchmarks/async_rollout.py --workload mixed          # rollouts of varying length (K = 2's case)
    python benchmarks/async_rollout.py --partial                 # and K = 2 with --partial_rollouts (any engine)
    python benchmarks/async_rollout.py --smoke                   # seconds: what tests/test_async.py runs
    .venv-vllm/bin/python benchmarks/async_rollout.py --engine vllm-colocate
    .venv-vllm/bin/python benchmarks/async_rollout.py --engine vllm-server --servers 2 \\
        --nproc_per_node 2 --parallel fsdp2                     # server mode, 2 trainer ranks, 2 servers

Each run is a fresh `mmgrpo train` (under torchrun with --nproc_per_node > 1), one torch thread per
Python thread, the modes alternating A B C per repeat. --engine vllm-server starts --servers
`mmgrpo rollout-server` processes that every run shares (the trainer gets their ports as
--vllm_server_port, a list when there are several); --trainer_flags passes more flags to every
trainer (e.g. servers started elsewhere: "--vllm_server_host 10.0.0.2 --vllm_server_port 8000").

Workloads, on a tiny Qwen2-VL (hidden 256), G completions of a fixed length per prompt (a random
model does not end its answers, so each row runs to its budget):
  fixed   every prompt --max_completion_length tokens: every rollout takes about as long
  mixed   colour prompts capped at a sixth of that (the registry's per-dataset
          max_completion_length) mixed with count prompts at the full length: a step's rollout is
          short or long by the prompts it drew, as with real answers

Printed per mode, means over the timed steps of a run (a step's checkpoint save left out), medians
over its runs:
  samples/s      completions of all trainer ranks / wall seconds
  rollout wait   time/rollout: what the step waited for its completions (async: only what generating
                 took beyond the training it overlapped)
  generate       rollout/generate_s: the engine's seconds on the step's rollouts (async: in the background)
  train          time/reward + plan + old + ref + adv + update
  weight sync    time/weight_sync: the trainer's side of loading the newest weights (or copying them)
  token staleness  the steps each completion token lags the policy, mean (--partial_rollouts: its
                 later chunks' tokens are fresher than the row's first; else every token lags as its row)
  CPU s          CPU seconds of each run's processes (trainers and the servers' share is not counted)
then each mode's samples/s against sync's in the same repeat. The overlap needs a core (or a device)
for each side: on 2 shared CPU cores both slow down when they run together.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PHASES = ("time/reward", "time/plan", "time/old", "time/ref", "time/adv", "time/update")


def modes(max_staleness: list[int], partial: bool = False) -> dict[str, list[str]]:
    """sync, each K, and with `partial` each K >= 2 again with --partial_rollouts (it needs K >= 2)."""
    found = {"sync": [], **{f"K={k}": ["--max_staleness", str(k)] for k in max_staleness}}
    if partial:
        found.update({f"K={k} partial": ["--max_staleness", str(k), "--partial_rollouts"] for k in max_staleness if k >= 2})
    return found


def token_staleness(metrics: dict) -> float:
    """The mean steps a completion token lags the policy: --partial_rollouts logs it; otherwise a
    token lags as its row, so the mean over the rows' staleness shares (staleness/share_k).

    >>> token_staleness({"staleness/share_0": 0.25, "staleness/share_2": 0.75}), token_staleness({})
    (1.5, 0.0)
    """
    if "partial/token_staleness_mean" in metrics:
        return metrics["partial/token_staleness_mean"]
    return sum((int(key.rsplit("_", 1)[1]) * share for key, share in metrics.items() if key.startswith("staleness/share_")), 0.0)


def workload_flags(args, work: Path) -> list[str]:
    """The datasets and budgets of --workload."""
    from mmgrpo.data.synthetic import synthetic_dataset_dir

    if args.workload == "fixed":
        folder = synthetic_dataset_dir("shapes-color", image_size=args.image_size, train_size=200, test_size=10)
        return ["--dataset", str(folder / "train.jsonl"), "--reward_funcs", "answer_format"]
    short = max(1, args.max_completion_length // 6)
    registry = work / "mixed.yaml"
    synthetic = f"{{train_size: 200, test_size: 10, image_size: {args.image_size}}}"
    registry.write_text(
        "datasets:\n"
        f"  - {{name: bench-short, synthetic: shapes-color, synthetic_args: {synthetic}, max_completion_length: {short}}}\n"
        f"  - {{name: bench-long, synthetic: shapes-count, synthetic_args: {synthetic}}}\n"
    )
    return ["--dataset_registry", str(registry), "--dataset", "bench-short", "bench-long", "--reward_funcs", "answer_format"]


def run_once(args, mode_flags: list[str], out: Path) -> tuple[list[dict], float]:
    """One `mmgrpo train`: (the timed steps' metrics, CPU seconds of its processes)."""
    train = [
        "-m", "mmgrpo", "train", "--model", args.model, "--model_type", "qwen2-vl", *args.data_flags,
        "--num_generations", str(args.num_generations),
        "--per_device_train_batch_size", str(args.num_generations * args.prompts),
        "--max_completion_length", str(args.max_completion_length), "--max_steps", str(args.warmup + args.steps),
        "--learning_rate", "1e-5", "--beta", "0.04", "--dataloader_num_workers", "0", "--torch_threads", "1",
        "--report_to", "none", "--log_completions", "0", "--logging_steps", "1000", "--save_steps", "0", "--seed", "0",
        "--output_dir", str(out), *args.engine_flags, *mode_flags, *args.trainer_flags.split(),
    ]
    if args.nproc_per_node > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(args.nproc_per_node), *train, "--parallel", args.parallel]
    else:
        command = [sys.executable, *train]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(mode_flags) or 'sync'} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[args.warmup:], (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def summary(steps: list[dict], cpu: float) -> dict[str, float]:
    """Means over the timed steps (a slow step counts: hiding those is what K > 1 is for), each
    step's time without its checkpoint save (the last step always saves)."""
    def mean(fn):
        return statistics.fmean(fn(m) for m in steps)

    seconds = [m["time/step"] - m["time/save"] for m in steps]
    samples = [m["samples_per_s"] * m["time/step"] for m in steps]  # B x G, over all ranks
    return {
        "samples_per_s": sum(samples) / sum(seconds),
        "s_per_step": statistics.fmean(seconds),
        "wait": mean(lambda m: m["time/rollout"]),
        "generate": mean(lambda m: m["rollout/generate_s"]),
        "train": mean(lambda m: sum(m.get(k, 0.0) for k in TRAIN_PHASES)),
        "sync": mean(lambda m: m.get("time/weight_sync", 0.0)),
        "staleness": max(m["rollout/staleness"] for m in steps),
        "token_staleness": mean(token_staleness),
        "cpu": cpu,
    }


def report(results: dict[str, list[dict]]) -> list[str]:
    """The markdown table of docs/benchmarks.md: per mode the medians of its runs, and the samples/s
    ratio to sync in the same repeat (median, min, max)."""
    lines = ["| mode | samples/s | vs sync | s/step | rollout wait | generate | train | weight sync | staleness | token staleness | CPU s / run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        ratios = [r["samples_per_s"] / s["samples_per_s"] for r, s in zip(runs, results["sync"])]
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if mode != "sync" else "1"
        lines.append(f"| {mode} | {med['samples_per_s']:.1f} | {spread} | {med['s_per_step']:.3f} | {med['wait']:.3f} | "
                     f"{med['generate']:.3f} | {med['train']:.3f} | {med['sync']:.4f} | {max(r['staleness'] for r in runs)} | "
                     f"{med['token_staleness']:.2f} | {med['cpu']:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_staleness", type=int, nargs="+", default=[1, 2], help="the K to measure (default 1 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step and rank (default 2)")
    parser.add_argument("--max_completion_length", type=int, default=48)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--workload", choices=["fixed", "mixed"], default="fixed", help="see above (default fixed)")
    parser.add_argument("--model", default=None, help="a checkpoint (default: tiny Qwen2-VL, hidden 256)")
    parser.add_argument("--engine", choices=["in-process", "vllm-colocate", "vllm-server"], default="in-process",
                        help="in-process: the engine on a copy of the model in a thread; vllm-colocate: vLLM in the "
                             "trainer; vllm-server: --servers `mmgrpo rollout-server` processes")
    parser.add_argument("--servers", type=int, default=1, help="--engine vllm-server: servers started (default 1)")
    parser.add_argument("--nproc_per_node", type=int, default=1, help="trainer ranks (torchrun) (default 1)")
    parser.add_argument("--parallel", default="fsdp2", help="--nproc_per_node > 1: the trainers' --parallel (default fsdp2)")
    parser.add_argument("--trainer_flags", default="", help="more flags for every trainer, one string")
    parser.add_argument("--partial", action="store_true", help="each K >= 2 also with --partial_rollouts")
    parser.add_argument("--smoke", action="store_true", help="one short run per mode on the smallest model: seconds")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        args.repeats, args.steps, args.warmup, args.num_generations, args.prompts = 1, 2, 1, 2, 1
        args.max_completion_length, args.image_size, args.model = 6, 64, args.model or "tiny:qwen2-vl"
    from mmgrpo.models.tiny import build_tiny

    args.model = args.model or str(build_tiny("qwen2-vl", hidden_size=256, intermediate_size=512, num_attention_heads=8))
    work = Path(tempfile.mkdtemp(prefix="mmgrpo-async-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # runs, checkpoints: hundreds of MB
    args.data_flags = workload_flags(args, work)
    args.engine_flags, servers = [], []
    if args.engine == "vllm-colocate":
        args.engine_flags = ["--use_vllm", "--vllm_max_model_len", "2048"]
    if args.engine == "vllm-server":
        servers = [start_rollout_server(args.model) for _ in range(args.servers)]
        args.engine_flags = ["--use_vllm", "--vllm_mode", "server", "--vllm_server_port", *[str(port) for _, port in servers],
                             "--vllm_max_model_len", "2048"]
    print(f"{args.engine}, {args.nproc_per_node} trainer rank(s); {args.workload} workload: G={args.num_generations} x "
          f"{args.prompts} prompts per rank, {args.max_completion_length} completion tokens, {args.image_size}px images; "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeats} runs per mode, alternating", flush=True)
    results: dict[str, list[dict]] = {mode: [] for mode in modes(args.max_staleness, args.partial)}
    try:
        for index in range(args.repeats):
            for mode, flags in modes(args.max_staleness, args.partial).items():
                result = summary(*run_once(args, flags, work / f"{mode}-{index}"))
                results[mode].append(result)
                print(f"  run {index + 1} {mode:<11} {result['samples_per_s']:6.1f} samples/s  {result['s_per_step']:.3f} s/step "
                      f"(wait {result['wait']:.3f}, generate {result['generate']:.3f}, train {result['train']:.3f})  "
                      f"{result['cpu']:.0f} CPU s", flush=True)
    finally:
        for server, _ in servers:
            server.terminate()
            server.wait(30)
    lines = report(results)
    print("\n".join(lines))
    return lines


def start_rollout_server(model: str):
    """`mmgrpo rollout-server` on a free local port, once it answers: (process, port)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # vLLM on CPU binds its OpenMP threads to every core by default ("auto"), spinning where the
    # trainer would run: one thread, unbound, leaves the trainer a core of its own
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    server = subprocess.Popen(
        [sys.executable, "-m", "mmgrpo.cli", "rollout-server", "--model", model, "--model_type", "qwen2-vl",
         "--port", str(port), "--vllm_max_model_len", "2048", "--vllm_kv_cache_memory_bytes", str(256 << 20)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server, port
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the rollout server did not start")


if __name__ == "__main__":
    main()
