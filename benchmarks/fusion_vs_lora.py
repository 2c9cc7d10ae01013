"""GRPO through a fusion module against GRPO through LoRA of about as many parameters, from one SFT start.

    python benchmarks/fusion_vs_lora.py --sft_model runs/fusion_sft/sft-2/final      # 3 seeds, 150 steps each
    python benchmarks/fusion_vs_lora.py --sft_model ... --seeds 0 --steps 4 --eval_limit 20   # a smoke run
    python benchmarks/fusion_vs_lora.py --sft_model ... --summarize                  # the table again, no training

Results and how to read them: docs/benchmarks.md, "Fusion modules against LoRA".

1. Two arms, the same GRPO run otherwise (the demo's mixture and settings, configs/demo_grpo.yaml,
   without its evaluations during training): `fusion` trains only a gated cross-attention module
   after decoder layer --fusion_layers (`--train_type fusion`; the reference is the SFT model),
   `lora` only LoRA adapters on the language model (`--train_type lora --target_modules llm`) of
   rank --lora_rank, chosen so both train about as many parameters (both counts are printed).
2. One run per arm and seed (a subprocess each, one torch thread, alternating fusion, lora, ...),
   with the modality probe every --probe_steps steps (fusion/reliance/image in metrics.jsonl).
3. The SFT start and every final checkpoint are evaluated by `mmgrpo eval --fusion_probe` on each
   task's test split (greedy, --eval_limit samples): accuracy and reliance side by side; per seed,
   `mmgrpo compare` of lora against fusion on each task (difference, 95% interval, p).
4. summary.json, summary.md and fusion_vs_lora.png (accuracy and reliance per arm) in --output_dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"shapes-color": "vqa_accuracy", "shapes-count": "vqa_accuracy", "shapes-ground": "iou_acc@0.5"}
ARMS = ("fusion", "lora")
# The demo's GRPO stage (configs/demo_grpo.yaml) without its in-training evaluations.
GRPO_FLAGS = [
    "--model_type", "qwen2-vl", "--dataset", "shapes-color:3", "shapes-count:1", "shapes-ground-hits:1",
    "--num_generations", "4", "--max_completion_length", "40", "--temperature", "1.0", "--beta", "0.2",
    "--loss_type", "dapo", "--max_tokens_per_microbatch", "1024", "--lr_scheduler_type", "constant",
    "--logging_steps", "10", "--report_to", "none", "--torch_threads", "1",
]


def arm_flags(arm: str, args) -> list[str]:
    if arm == "fusion":
        return ["--train_type", "fusion", "--fusion_module", args.fusion_module, "--fusion_layers", args.fusion_layers]
    return ["--train_type", "lora", "--target_modules", "llm", "--lora_rank", str(args.lora_rank),
            "--lora_alpha", str(2 * args.lora_rank), "--lora_dropout", "0"]


def run(command: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... failed (exit {done.returncode}): see {log}")


def mmgrpo(*argv: str) -> list[str]:
    return [sys.executable, "-m", "mmgrpo", *argv]


def trained_parameters(checkpoint: Path) -> int:
    """Parameters a checkpoint's run trained: its fusion modules' or its LoRA adapter's."""
    from safetensors import safe_open

    for name in ("fusion_modules.safetensors", "adapter_model.safetensors"):
        if (checkpoint / name).is_file():
            with safe_open(str(checkpoint / name), "pt") as f:
                return sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return 0


def evaluate(model: Path, out: Path, limit: int, tasks: list[str]) -> None:
    """`mmgrpo eval --fusion_probe` on each task's test split (skipped where eval.json exists)."""
    for task in tasks:
        folder = out / task
        if not (folder / "eval.json").is_file():
            run(mmgrpo("eval", "--model", str(model), "--dataset", f"{task}:test", "--limit", str(limit),
                       "--max_completion_length", "40", "--output_dir", str(folder), "--fusion_probe"),
                out / f"{task}.log")


def read_eval(folder: Path, task: str) -> dict:
    result = json.loads((folder / task / "eval.json").read_text())
    probe = json.loads((folder / task / "fusion_probe.json").read_text())
    return {"accuracy": result["metrics"][TASKS[task]], "reliance": probe.get("fusion/reliance/image", float("nan"))}


def probes(metrics: Path) -> list[list[float]]:
    """[step, fusion/reliance/image] of every probed step of a run (--fusion_probe_steps)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [[row["step"], row["fusion/reliance/image"]] for row in rows if "fusion/reliance/image" in row]


def summarize(args, work: Path, out: Path) -> dict:
    from mmgrpo.eval.compare import compare

    summary = {"start": {task: read_eval(work / "eval_sft", task) for task in args.tasks}, "arms": {}, "compare": {}}
    for arm in ARMS:
        runs = [work / f"{arm}-seed{seed}" for seed in args.seeds]
        summary["arms"][arm] = {
            "parameters": trained_parameters(runs[0] / f"checkpoint-{args.steps}"),
            "tasks": {task: [read_eval(r / "eval", task) for r in runs] for task in args.tasks},
            "probes": [probes(r / "metrics.jsonl") for r in runs],  # per seed: [[step, reliance], ...]
        }
    for seed in args.seeds:
        for task in args.tasks:
            metric = TASKS[task]
            result = compare(work / f"fusion-seed{seed}" / "eval" / task, work / f"lora-seed{seed}" / "eval" / task, seed=seed)
            row = next(r for r in result["metrics"] if r["metric"] == metric)
            summary["compare"].setdefault(task, []).append(
                {"seed": seed, "diff_lora_minus_fusion": row["diff"], "ci": [row["ci_low"], row["ci_high"]], "p": row["p"]})
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["| task | SFT start | fusion (per seed) | LoRA (per seed) | reliance: start / fusion / LoRA | LoRA - fusion (p) per seed |",
             "|---|---|---|---|---|---|"]
    for task in args.tasks:
        start = summary["start"][task]
        arms = {arm: summary["arms"][arm]["tasks"][task] for arm in ARMS}
        accuracy = {arm: " / ".join(f"{r['accuracy']:.3f}" for r in arms[arm]) for arm in ARMS}
        reliance = " / ".join(f"{statistics.mean(r['reliance'] for r in arms[arm]):.3f}" for arm in ARMS)
        diffs = ", ".join(f"{c['diff_lora_minus_fusion']:+.3f} ({c['p']:.2g})" for c in summary["compare"][task])
        lines.append(f"| {task} | {start['accuracy']:.3f} | {accuracy['fusion']} | {accuracy['lora']} | "
                     f"{start['reliance']:.3f} / {reliance} | {diffs} |")
    params = ", ".join(f"{arm} {summary['arms'][arm]['parameters']:,}" for arm in ARMS)
    table = "\n".join(lines) + f"\n\ntrained parameters: {params}\n"
    (out / "summary.md").write_text(table)
    plot(summary, out / "fusion_vs_lora.png")
    print(table)
    return summary


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    tasks = list(summary["start"])
    for k, (key, title) in enumerate((("accuracy", "held-out accuracy (test)"), ("reliance", "image reliance on test answers (nats/token)"))):
        ax = axes[k]
        for i, name in enumerate(("start", *ARMS)):
            values = [[summary["start"][t][key]] if name == "start" else [r[key] for r in summary["arms"][name]["tasks"][t]]
                      for t in tasks]
            xs = [j + (i - 1) * 0.25 for j in range(len(tasks))]
            ax.bar(xs, [statistics.mean(v) for v in values], width=0.25, label=name)
            for x, v in zip(xs, values):
                ax.scatter([x] * len(v), v, color="black", s=8, zorder=3)
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_title(title)
    axes[0].legend()
    ax = axes[2]  # during training: the probe's readings, mean over seeds at each probed step
    for arm in ARMS:
        runs = summary["arms"][arm]["probes"]
        steps = sorted({step for run in runs for step, _ in run})
        by_step = [[value for run in runs for s, value in run if s == step] for step in steps]
        ax.plot(steps, [statistics.mean(v) for v in by_step], marker="o", markersize=3, label=arm)
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_title("image reliance while training (probe, mean of seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft_model", required=True, help="the SFT checkpoint every run starts from")
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), help="held-out tasks evaluated (default: all three)")
    p.add_argument("--steps", type=int, default=150, help="GRPO steps of every run")
    p.add_argument("--prompts_per_step", type=int, default=64, help="prompts of every step, each with G = 4 (the demo's 64)")
    p.add_argument("--learning_rate", type=float, default=1e-3, help="constant rate of both arms")
    p.add_argument("--fusion_module", default="gated_xattn")
    p.add_argument("--fusion_layers", default="0", help="decoder layers of the fusion arm's modules")
    p.add_argument("--lora_rank", type=int, default=16, help="the LoRA arm's rank (16 on the tiny model's LLM: 65,536 "
                   "parameters against 66,049 of one gated_xattn module)")
    p.add_argument("--probe_steps", type=int, default=10, help="--fusion_probe_steps of every run")
    p.add_argument("--eval_limit", type=int, default=200, help="held-out test samples per task")
    p.add_argument("--work_dir", default="runs/fusion_vs_lora/work", help="runs, evaluations and logs")
    p.add_argument("--output_dir", default="runs/fusion_vs_lora", help="summary.json, summary.md, the PNG")
    p.add_argument("--summarize", action="store_true", help="train nothing: summarize what --work_dir holds")
    args = p.parse_args(argv)
    work, out = Path(args.work_dir), Path(args.output_dir)
    work.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        evaluate(Path(args.sft_model), work / "eval_sft", args.eval_limit, args.tasks)
        for seed in args.seeds:
            for arm in ARMS:
                run_dir = work / f"{arm}-seed{seed}"
                final = run_dir / f"checkpoint-{args.steps}"
                if not (final / "checkpoint_complete.json").is_file():
                    print(f"{arm} seed {seed}: GRPO, {args.steps} steps", flush=True)
                    run(mmgrpo("train", "--model", args.sft_model, *GRPO_FLAGS, *arm_flags(arm, args),
                               "--per_device_train_batch_size", str(4 * args.prompts_per_step),
                               "--learning_rate", str(args.learning_rate), "--max_steps", str(args.steps),
                               "--seed", str(seed), "--fusion_probe_steps", str(args.probe_steps),
                               "--output_dir", str(run_dir), "--overwrite_output_dir"), work / f"{arm}-seed{seed}.log")
                print(f"{arm} seed {seed}: evaluation", flush=True)
                model = final
                if arm == "lora":  # `mmgrpo eval` reads a plain HF folder: the adapter merged into the base
                    model = run_dir / "merged"
                    if not (model / "config.json").is_file():
                        run(mmgrpo("export", "--merge_lora", "--model", str(final), "--output_dir", str(model)),
                            work / f"{arm}-seed{seed}-export.log")
                evaluate(model, run_dir / "eval", args.eval_limit, args.tasks)
    summarize(args, work, out)


if __name__ == "__main__":
    main()
