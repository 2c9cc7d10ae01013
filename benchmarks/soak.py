"""Soak: does a long run's memory grow? GRPO on the tiny Qwen2-VL for 1,000+ steps with each rollout
engine (HF generate, the shared-prefix engine, vLLM colocated), in-training evaluation and checkpoint
saves included, with the memory of the trainer and of its DataLoader workers read at every step.

    nice -n 10 .venv/bin/python benchmarks/soak.py --engines hf shared_prefix --steps 1000 --out runs/soak
    nice -n 10 .venv-vllm/bin/python benchmarks/soak.py --engines vllm --steps 1000 --out runs/soak
    .venv/bin/python benchmarks/soak.py --report runs/soak     # the table and soak.png of what is there
    .venv/bin/python benchmarks/soak.py --smoke --out /tmp/soak  # 16 steps of one engine (tests/test_soak.py)

Each engine trains in its own `mmgrpo train` process (the interpreter running this script; vLLM
needs .venv-vllm). While it runs, this script follows its metrics.jsonl: when step N's line appears,
it reads the anonymous resident memory (RssAnon: the heap, tensors, caches; what a leak grows) of
the trainer and of its child processes, and the trainer's RSS (/proc). RSS also counts mapped
libraries, which the kernel drops and reloads under memory pressure; a forked worker's private or
proportional memory rises whenever the trainer rewrites pages they shared, with nothing allocated
(by 234 MB at once, seen here); RssAnon moves only with what a process maps itself. The growth is the
slope of a least-squares line over the steps after warm-up (the first 20%), in MB per 100 steps,
with a 95% interval; a leak of a tenth of a MB per step shows as +10.
Writes soak-<engine>.json (every sample) and, over all engines in the folder, soak.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VLLM_FLAGS = ["--use_vllm", "--vllm_max_model_len", "1024", "--vllm_kv_cache_memory_bytes", str(64 << 20)]
ENGINES = {"hf": ["--shared_prefix", "false"], "shared_prefix": [], "vllm": VLLM_FLAGS}


def train_flags(out: Path, steps: int, every: int) -> list[str]:
    """The soaked run: evaluation and a checkpoint (two kept) every `every` steps."""
    return [
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", "vqa_accuracy", "format",
        "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "16",
        "--learning_rate", "1e-4", "--beta", "0.04", "--max_steps", str(steps), "--dataloader_num_workers", "2",
        "--eval_dataset", "shapes-color:test", "--eval_steps", str(every), "--eval_limit", "8",
        "--save_steps", str(every), "--save_total_limit", "2", "--logging_steps", str(10**6),
        "--report_to", "none", "--output_dir", str(out),
    ]


def status_mb(pid: int, key: str) -> float:
    """A /proc/<pid>/status figure in MB (RssAnon, VmRSS ...); 0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0.0


def children_of(pid: int) -> list[int]:
    """Every process below `pid` (DataLoader workers, their helpers)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def new_steps(path: Path, offset: int) -> tuple[list[int], int]:
    """Steps of the complete lines appended to metrics.jsonl after byte `offset`, and the new offset."""
    if not path.is_file():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a line being written is read next time
    steps = [json.loads(line)["step"] for line in data[:end].splitlines() if line.strip()]
    return steps, offset + end


def soak(engine: str, steps: int, every: int, out: Path, python: str) -> dict:
    """Run one engine for `steps` steps; returns {"engine", "samples": [[step, trainer anon MB, workers MB, s, trainer
    RSS MB]], ...}."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    run_dir = out / f"run-{engine}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [python, "-m", "mmgrpo", "train", *train_flags(run_dir, steps, every), "--overwrite_output_dir", *ENGINES[engine]]
    log = open(out / f"soak-{engine}.log", "w")
    started, cpu_before = time.perf_counter(), os.times()
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    samples, offset = [], 0
    columns = (TextColumn(f"[bold]soak {engine}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rss]:.0f} MB"), TimeRemainingColumn())
    with Progress(*columns) as bar:
        task = bar.add_task(engine, total=steps, rss=0.0)
        while True:
            done = process.poll() is not None
            logged, offset = new_steps(run_dir / "metrics.jsonl", offset)
            if logged:
                anon, rss = status_mb(process.pid, "RssAnon"), status_mb(process.pid, "VmRSS")
                workers = sum(status_mb(child, "RssAnon") for child in children_of(process.pid)) or None  # None: ended
                for step in logged:
                    samples.append([step, anon, workers, time.perf_counter() - started, rss])
                bar.update(task, completed=logged[-1], rss=anon)
            if done:
                break
            time.sleep(0.02)
    log.close()
    if process.returncode != 0:
        tail = (out / f"soak-{engine}.log").read_text()[-3000:]
        raise SystemExit(f"soak {engine}: mmgrpo train exited {process.returncode}:\n{tail}")
    cpu_after = os.times()
    result = {
        "engine": engine, "steps": steps, "every": every, "python": python,
        "wall_s": time.perf_counter() - started,
        "cpu_s": (cpu_after.children_user + cpu_after.children_system) - (cpu_before.children_user + cpu_before.children_system),
        "samples": samples,
    }
    result.update(growth(samples))
    (out / f"soak-{engine}.json").write_text(json.dumps(result) + "\n")
    return result


def growth(samples: list, warmup_fraction: float = 0.2) -> dict:
    """The least-squares slope of RSS over the steps after warm-up, MB per 100 steps, with a 95% interval."""
    rows = np.array([[np.nan if v is None else v for v in s[:4]] for s in samples], dtype=float)  # [n, 4]: step, MB, MB, s
    after = rows[rows[:, 0] > rows[:, 0].max() * warmup_fraction]
    out = {"warmup_steps": int(rows[:, 0].max() * warmup_fraction),
           "s_per_step": float((after[-1, 3] - after[0, 3]) / max(1, after[-1, 0] - after[0, 0]))}
    for column, name in ((1, "trainer"), (2, "workers")):
        known = after[~np.isnan(after[:, column])]
        steps, mb = known[:, 0], known[:, column]
        slope, intercept = np.polyfit(steps, mb, 1)
        residual = mb - (slope * steps + intercept)
        spread = math.sqrt(float((residual**2).sum()) / max(1, len(steps) - 2) / max(1e-12, float(((steps - steps.mean()) ** 2).sum())))
        out[f"{name}_mb_per_100_steps"] = 100 * float(slope)
        out[f"{name}_mb_per_100_steps_ci95"] = 100 * 1.96 * spread
        out[f"{name}_mb_after_warmup"] = float(mb[0])
        out[f"{name}_mb_end"] = float(mb[-1])
    return out


def report(out: Path) -> list[dict]:
    """Print the table of every soak-<engine>.json in `out` and draw soak.png."""
    results = [json.loads(p.read_text()) for p in sorted(out.glob("soak-*.json"))]
    for r in results:
        r.update(growth(r["samples"]))
    print(f"{'engine':<14}{'steps':>6}{'s/step':>8}{'trainer anon':>13}{'end':>8}{'MB/100 steps':>18}"
          f"{'workers':>10}{'MB/100 steps':>18}")
    for r in results:
        print(f"{r['engine']:<14}{r['steps']:>6}{r['s_per_step']:>8.2f}{r['trainer_mb_after_warmup']:>13.0f}"
              f"{r['trainer_mb_end']:>8.0f}{r['trainer_mb_per_100_steps']:>+10.2f} ± {r['trainer_mb_per_100_steps_ci95']:<5.2f}"
              f"{r['workers_mb_after_warmup']:>10.0f}{r['workers_mb_per_100_steps']:>+10.2f} ± {r['workers_mb_per_100_steps_ci95']:<5.2f}")
    if results:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in results:
            rows = np.array([s[:2] for s in r["samples"]])
            ax.plot(rows[:, 0], rows[:, 1], label=f"{r['engine']} ({r['trainer_mb_per_100_steps']:+.2f} MB/100 steps)", lw=1)
        ax.axvline(results[0]["warmup_steps"], color="grey", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("trainer's anonymous memory, RssAnon (MB)")
        ax.set_title("GRPO soak, tiny Qwen2-VL: resident memory per step (eval and saves every "
                     f"{results[0]['every']} steps)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "soak.png", dpi=120)
        print(f"plot: {out / 'soak.png'}")
    return results


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="*", default=["hf", "shared_prefix"], choices=list(ENGINES))
    parser.add_argument("--steps", type=int, default=1000, help="GRPO steps per engine.")
    parser.add_argument("--every", type=int, default=100, help="Evaluate and save every N steps.")
    parser.add_argument("--out", default="runs/soak", help="Folder of the runs, soak-<engine>.json and soak.png.")
    parser.add_argument("--python", default=sys.executable, help="The interpreter that runs `mmgrpo train`.")
    parser.add_argument("--smoke", action="store_true", help="16 steps of the first engine, evaluating and saving every 5.")
    parser.add_argument("--report", metavar="FOLDER", help="Only print the table and draw the plot of FOLDER.")
    args = parser.parse_args(argv)
    if args.report:
        return report(Path(args.report))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engines, steps, every = args.engines, args.steps, args.every
    if args.smoke:
        engines, steps, every = engines[:1], 16, 5
    for engine in engines:
        soak(engine, steps, every, out, args.python)
    return report(out)


if __name__ == "__main__":
    main()
