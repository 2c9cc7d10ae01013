"""Scaling: samples/s and peak memory per rank, 1 vs 2 processes, for --parallel none / fsdp2 / zero3.

    .venv/bin/python benchmarks/scaling.py                  # about 6 minutes on 2 CPU cores
    .venv/bin/python benchmarks/scaling.py --steps 8 --repeats 3 --hidden_size 1024
    .venv/bin/python benchmarks/scaling.py --configs zero3:1 fsdp2:2  # some configurations (none:1 always runs)

Each configuration is one real `mmgrpo train` launch (`torchrun --standalone` for 2 processes)
on a tiny random Qwen2-VL (17M parameters by default, so that weights and AdamW states are a
visible part of the memory), with the same per-rank batch: 2 prompts x G=4 completions of up
to 16 tokens, beta 0.04 (a reference model). Two processes therefore train on twice the global
batch (weak scaling). Reported per configuration (medians over --repeats, run round-robin
A B C ... A B C so that load on the shared machine hits all alike):

    samples/s       completions per second over all ranks, steps after the first (warm-up) only
    peak GB / rank  the largest rank's peak memory (RSS on CPU, max allocated on a GPU): metrics.jsonl memory/peak_gb
    CPU s           CPU seconds of the whole launch (start-up included), all ranks

The result replaces the "## Scaling" section of docs/benchmarks.md (other sections are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [("none", 1), ("fsdp2", 1), ("fsdp2", 2), ("zero3", 1), ("zero3", 2)]
SECTION = "## Scaling"


def launch(parallel: str, processes: int, model: str, out: Path, steps: int) -> tuple[list[dict], float, float]:
    """One training launch: (metrics.jsonl rows, wall seconds, CPU seconds of the children)."""
    train = [
        "-m", "mmgrpo", "train", "--parallel", parallel, "--model", model, "--model_type", "qwen2-vl",
        "--dataset", "shapes-color", "--reward_funcs", "vqa_accuracy", "format", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_completion_length", "16", "--beta", "0.04",
        "--max_steps", str(steps), "--dataloader_num_workers", "0", "--torch_threads", "1",
        "--save_steps", "0", "--output_dir", str(out),
    ]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), *train]
    else:
        command = [sys.executable, *train]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{parallel} x {processes} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def table(results: dict, args) -> str:
    lines = [
        SECTION,
        "",
        f"`python benchmarks/scaling.py --steps {args.steps} --repeats {args.repeats} --hidden_size {args.hidden_size}` "
        f"on {platform.machine()}, {os.cpu_count()} CPU cores (shared), {time.strftime('%Y-%m-%d')}: tiny Qwen2-VL "
        f"(hidden {args.hidden_size}, {args.layers} layers), per rank 2 prompts x 4 completions x 16 tokens, beta 0.04, fp32, "
        "gloo. Medians of the runs; samples/s over all ranks, steps after the first.",
        "",
        "| --parallel | processes | samples/s | speed-up vs none | peak GB / rank | CPU s per launch |",
        "|---|---|---|---|---|---|",
    ]
    base = statistics.median(results[("none", 1)]["samples_per_s"])
    for (parallel, processes), runs in results.items():
        rate = statistics.median(runs["samples_per_s"])
        lines.append(
            f"| {parallel} | {processes} | {rate:.1f} | {rate / base:.2f}x | "
            f"{statistics.median(runs['peak_gb']):.2f} | {statistics.median(runs['cpu_s']):.0f} |"
        )
    lines += [
        "",
        "On 2 shared CPU cores two ranks compete for the same cores (and with other jobs: rounds differed up to 2x) "
        "and gloo moves every gathered weight through memory, so this table shows overheads, not the speed-up GPUs "
        "give. Peak memory per rank is the process's peak RSS: it includes the Python and torch runtime (about "
        "0.6-0.8 GB) and is set while every rank still holds the full model it loaded (policy and reference copy) "
        "before sharding, so sharding barely lowers it on CPU; on GPUs `memory/peak_gb` is the device's max "
        "allocated, where the shards are what counts.",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace (or append) the "## Scaling" section, leaving every other section as it is."""
    text = path.read_text() if path.is_file() else "# Benchmarks\n\n"
    if SECTION in text:
        start = text.index(SECTION)
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[end + 1:] if end != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps per launch (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="launches per configuration, round-robin")
    parser.add_argument("--hidden_size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--output", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--configs", nargs="*", default=[f"{p}:{n}" for p, n in CONFIGS],
                        help="parallel:processes to run (default: all; none:1 is the baseline and always runs)")
    args = parser.parse_args()
    known = {f"{p}:{n}" for p, n in CONFIGS}
    unknown = sorted(set(args.configs) - known)
    if unknown:
        raise SystemExit(f"--configs {' '.join(unknown)}: choose among {' '.join(sorted(known))}")
    configs = [config for config in CONFIGS if config == ("none", 1) or f"{config[0]}:{config[1]}" in args.configs]

    from mmgrpo.models.tiny import build_tiny

    heads = max(4, args.hidden_size // 32)
    model = str(build_tiny("qwen2-vl", hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                           num_attention_heads=heads, num_key_value_heads=heads // 2, intermediate_size=4 * args.hidden_size))
    results = {config: {"samples_per_s": [], "peak_gb": [], "cpu_s": []} for config in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for parallel, processes in configs:
                out = Path(tmp) / f"{parallel}-{processes}-{repeat}"
                rows, wall, cpu = launch(parallel, processes, model, out, args.steps)
                measured = rows[1:] or rows
                rate = sum(r["samples_per_s"] for r in measured) / len(measured)
                runs = results[(parallel, processes)]
                runs["samples_per_s"].append(rate)
                runs["peak_gb"].append(max(r["memory/peak_gb"] for r in rows))
                runs["cpu_s"].append(cpu)
                print(f"{parallel:>5} x {processes}: {rate:6.1f} samples/s  peak {runs['peak_gb'][-1]:.2f} GB/rank  "
                      f"{wall:.0f} s wall  {cpu:.0f} s CPU", flush=True)
    section = table(results, args)
    write_section(Path(args.output), section)
    print(section)


if __name__ == "__main__":
    main()
