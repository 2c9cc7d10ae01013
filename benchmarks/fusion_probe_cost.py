"""What the modality probe (--fusion_probe_steps) costs against the GRPO step it measures.

    python benchmarks/fusion_probe_cost.py                                   # the demo's step on the tiny model
    python benchmarks/fusion_probe_cost.py --model runs/fusion_sft/sft-2/final --steps 20

The demo's GRPO step (configs/demo_grpo.yaml: 64 prompts x G = 4, completions up to 40 tokens,
packed log-prob forwards) runs --steps times with the probe on every step, one torch thread. Each
step logs its phases; the probe's seconds (time/probe, wall and CPU) are set against the rest of
the same step, so load on the machine moves both alike. The probe runs once every N steps, so its
share of training time at interval N is probe / (N x step without the probe); printed for N = 1,
10 (the interval docs/fusion.md suggests) and 50. Goal: under 3% at the suggested interval.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny:qwen2-vl?vision_init_gain=3", help="the policy (the demo's tiny model by default)")
    p.add_argument("--steps", type=int, default=12, help="steps measured (the first is a warm-up, not counted)")
    p.add_argument("--rows", type=int, default=4, help="--fusion_probe_rows")
    args = p.parse_args(argv)

    import torch

    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import grpo_step
    from mmgrpo.eval.reliance import probe_step
    from mmgrpo.training.build import build_run

    torch.set_num_threads(1)
    cpu_seconds: list[float] = []

    def timed_probe(*a, **k):  # the probe's CPU seconds beside its wall seconds (time/probe)
        start = time.process_time()
        try:
            return probe_step(*a, **k)
        finally:
            cpu_seconds.append(time.process_time() - start)

    out = tempfile.mkdtemp(prefix="probe_cost_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    cfg = TrainConfig.from_args([
        "--model", args.model, "--model_type", "qwen2-vl", "--dataset", "shapes-color:3", "shapes-count:1", "shapes-ground-hits:1",
        "--min_pixels", "12544", "--max_pixels", "12544", "--num_generations", "4", "--max_completion_length", "40",
        "--beta", "0.2", "--max_tokens_per_microbatch", "1024", "--per_device_train_batch_size", "256",
        "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--max_steps", str(args.steps),
        "--fusion_probe_steps", "1", "--fusion_probe_rows", str(args.rows), "--dataloader_num_workers", "0",
        "--torch_threads", "1", "--report_to", "none", "--output_dir", out,
    ])
    run = build_run(cfg)
    batches = run.prompt_batches()
    probe_s, rest_s, rest_cpu = [], [], []
    for step in range(1, args.steps + 1):
        process = time.process_time()
        metrics, _ = grpo_step(run, next(batches), step, probe=timed_probe)
        step_cpu = time.process_time() - process
        if step == 1:
            cpu_seconds.clear()
            continue
        phases = sum(v for k, v in metrics.items() if k.startswith("time/"))
        probe_s.append(metrics["time/probe"])
        rest_s.append(phases - metrics["time/probe"])
        rest_cpu.append(step_cpu - cpu_seconds[-1])
        print(f"step {step}: step without the probe {rest_s[-1]:.2f} s, probe {probe_s[-1]:.3f} s "
              f"({cpu_seconds[-1]:.3f} CPU s of the step's {step_cpu:.2f})", flush=True)
    probe, rest = statistics.median(probe_s), statistics.median(rest_s)
    probe_cpu, step_cpu = statistics.median(cpu_seconds), statistics.median(rest_cpu)
    print(f"\nmedians over {len(probe_s)} steps, {args.rows} probe rows: step without the probe {rest:.2f} s "
          f"({step_cpu:.2f} CPU s), probe {probe:.3f} s ({probe_cpu:.3f} CPU s)")
    for interval in (1, 10, 50):
        print(f"--fusion_probe_steps {interval}: {100 * probe / (interval * rest):.2f}% of the step's wall time, "
              f"{100 * probe_cpu / (interval * step_cpu):.2f}% of its CPU time")


if __name__ == "__main__":
    main()
