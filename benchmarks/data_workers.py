"""Data-loading workers against none (`--dataloader_num_workers 2` vs `0`) on the demo's GRPO stage.

    python benchmarks/data_workers.py                       # about three minutes on 2 cores
    python benchmarks/data_workers.py --model mmgrpo/demo/start --steps 40 --pairs 3

Runs `mmgrpo train --config mmgrpo/demo/configs/grpo.yaml` for a few steps with each setting, alternately
(0, 2, 0, 2, ...), each in its own process with one torch thread, and prints per setting the median
over runs of time/data (the loop waiting for prompts) and time/step, the ratio, and whether the
two runs drew the same rewards (the batches do not depend on the workers, docs/data.md).
The first steps of each run (start-up, first batches) are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(model: str, workers: int, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "mmgrpo", "train", "--config", str(ROOT / "mmgrpo" / "demo" / "configs" / "grpo.yaml"),
           "--model", model, "--max_steps", str(steps), "--eval_steps", "0", "--torch_threads", "1",
           "--dataloader_num_workers", str(workers), "--output_dir", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny:qwen2-vl", help="start of the GRPO stage (default: the random tiny model)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--skip", type=int, default=5, help="first steps of each run left out")
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    seconds = {0: {"time/data": [], "time/step": []}, 2: {"time/data": [], "time/step": []}}
    rewards = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for workers in (0, 2):
                rows = run(args.model, workers, args.steps, Path(tmp) / f"w{workers}-{pair}")
                for key in seconds[workers]:
                    seconds[workers][key].append(statistics.mean(r[key] for r in rows[args.skip:]))
                rewards.setdefault(workers, [r["reward"] for r in rows])
    print(f"{'workers':>8} {'time/data':>10} {'time/step':>10}   (medians of {args.pairs} runs, s per step)")
    medians = {w: {k: statistics.median(v) for k, v in s.items()} for w, s in seconds.items()}
    for workers in (2, 0):
        print(f"{workers:>8} {medians[workers]['time/data']:>10.3f} {medians[workers]['time/step']:>10.3f}")
    print(f"time/step with 2 workers / with none: {medians[2]['time/step'] / medians[0]['time/step']:.2f}x")
    print(f"same rewards at every step: {rewards[0] == rewards[2]}")


if __name__ == "__main__":
    main()
