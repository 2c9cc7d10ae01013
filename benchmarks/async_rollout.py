"""Asynchronous (one-step off-policy) rollouts against synchronous ones, on the same work.

    python benchmarks/async_rollout.py                      # in-process engine on a copy, about 3 minutes
    python benchmarks/async_rollout.py --repeats 5 --steps 8 --max_completion_length 64
    .venv-vllm/bin/python benchmarks/async_rollout.py --engine vllm-server   # rollouts in a rollout-server process

--engine vllm-server starts one `mmgrpo rollout-server` process (vLLM) that every run uses: the rollout
then runs in another process, so the overlap with training does not share the trainer's Python thread.
Also printed: time/weight_sync per step and its share of the step (the cost of syncing the weights).

Each run is a fresh `mmgrpo train` subprocess (one torch thread per Python thread, so the rollout
thread and the training thread can each keep one core busy), sync and async alternating, on a
tiny Qwen2-VL (hidden 256), G completions of a fixed length (EOS suppressed through a reward-free
length: the completion length is the maximum for both), images of --image_size pixels.

Printed per mode: seconds per step after the warm-up steps, and where a step's time goes:
  rollout wait   time/rollout: the step waiting for its completions (async: only what generation
                 took beyond the previous step's training)
  generate       rollout/generate_s: the engine generating (async: in the background thread)
  train          time/ref + time/old + time/update + time/adv + time/plan + time/reward
then the sync/async ratio of seconds per step. Overlap needs a second core (or a second device):
here the rollout thread and the training thread share 2 CPU cores with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN_PHASES = ("time/reward", "time/plan", "time/old", "time/ref", "time/adv", "time/update")


def run_once(args, asynchronous: bool, out: Path) -> list[dict]:
    flags = [
        "--model", args.model, "--model_type", "qwen2-vl", "--dataset", args.dataset, "--reward_funcs", "answer_format",
        "--num_generations", str(args.num_generations),
        "--per_device_train_batch_size", str(args.num_generations * args.prompts),
        "--max_completion_length", str(args.max_completion_length), "--max_steps", str(args.warmup + args.steps),
        "--learning_rate", "1e-5", "--beta", "0.04", "--dataloader_num_workers", "0", "--torch_threads", "1",
        "--report_to", "none", "--log_completions", "0", "--logging_steps", "1000", "--seed", "0",
        "--async_generate", str(asynchronous).lower(), "--output_dir", str(out), *args.engine_flags,
    ]
    code = f"from mmgrpo.cli import main; main(['train', *{flags!r}])"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup:]


def summary(steps: list[dict]) -> dict[str, float]:
    def median(fn):
        return statistics.median(fn(m) for m in steps)

    return {
        "s_per_step": median(lambda m: m["time/step"]),
        "wait": median(lambda m: m["time/rollout"]),
        "generate": median(lambda m: m["rollout/generate_s"]),
        "train": median(lambda m: sum(m.get(k, 0.0) for k in TRAIN_PHASES)),
        "sync": median(lambda m: m.get("time/weight_sync", 0.0)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating (default 3)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    parser.add_argument("--max_completion_length", type=int, default=48)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--model", default=None, help="a checkpoint (default: tiny Qwen2-VL, hidden 256)")
    parser.add_argument("--engine", choices=["in-process", "vllm-server"], default="in-process",
                        help="in-process: the engine on a copy of the model in a thread; vllm-server: mmgrpo rollout-server")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mmgrpo.data.synthetic import synthetic_dataset_dir
    from mmgrpo.models.tiny import build_tiny

    args.model = args.model or str(build_tiny("qwen2-vl", hidden_size=256, intermediate_size=512, num_attention_heads=8))
    args.dataset = str(synthetic_dataset_dir("shapes-color", image_size=args.image_size, train_size=200, test_size=10) / "train.jsonl")
    work = Path(tempfile.mkdtemp(prefix="mmgrpo-async-"))
    args.engine_flags, server = [], None
    if args.engine == "vllm-server":
        server, port = start_rollout_server(args.model)
        args.engine_flags = ["--use_vllm", "--vllm_mode", "server", "--vllm_server_port", str(port),
                             "--vllm_max_model_len", "2048"]
    print(f"G={args.num_generations} x {args.prompts} prompts, {args.max_completion_length} completion tokens, "
          f"{args.image_size}px images; {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} runs each")
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    for index in range(args.repeats):
        for mode in results:
            result = summary(run_once(args, mode == "async", work / f"{mode}-{index}"))
            results[mode].append(result)
            print(f"  run {index + 1} {mode:<5} {result['s_per_step']:.3f} s/step (wait {result['wait']:.3f}, "
                  f"generate {result['generate']:.3f}, train {result['train']:.3f})", flush=True)
    for mode, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{mode:<5}: {med['s_per_step']:.3f} s/step = rollout wait {med['wait']:.3f} + train {med['train']:.3f} "
              f"+ the rest; generating took {med['generate']:.3f} s")
    ratios = [s["s_per_step"] / a["s_per_step"] for s, a in zip(results["sync"], results["async"])]
    print(f"sync/async s/step: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    sync_share = [r["sync"] / r["s_per_step"] for r in results["sync"]]
    print(f"weight sync: {statistics.median(r['sync'] for r in results['sync']):.4f} s/step, "
          f"{100 * statistics.median(sync_share):.1f}% of a synchronous step")
    if server is not None:
        server.terminate()
        server.wait(30)


def start_rollout_server(model: str):
    """`mmgrpo rollout-server` on a free local port, once it answers: (process, port)."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
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
