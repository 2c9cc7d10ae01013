"""The embedded demo: a tiny Qwen2-VL learns to see, by reward alone.

    make demo                       # or: .venv/bin/mmgrpo demo --output_dir runs/demo

1. build `tiny:qwen2-vl` offline (random weights, ~1M parameters)
2. SFT warm start on the shapes mixture (configs/demo_sft.yaml): learns the answer format and
   begins to read the image
3. evaluate the SFT model on each held-out test split (the baseline)
4. GRPO on the mixture (configs/demo_grpo.yaml), each dataset scored by its own rewards, with
   held-out evaluations during training (the report draws them against steps and seconds)
5. evaluate the GRPO model on the same splits
6. compare the two per dataset (paired bootstrap interval, McNemar / permutation p-value),
   print them side by side, and write the run's HTML report

Every stage runs with one torch thread (--torch_threads): on 2 shared cores OpenMP's spin-waits
made this tiny model 3-4x slower with two; the data-loading workers use the other core.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from rich.table import Table

from mmgrpo.runlog import console

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# (dataset, metric the demo reports, what it means)
TASKS = [
    ("shapes-color", "vqa_accuracy", "colour of the shape (VQAv2 soft accuracy)"),
    ("shapes-count", "vqa_accuracy", "how many shapes (exact)"),
    ("shapes-ground", "iou_acc@0.5", "box of a named shape (Acc@IoU0.5)"),
]
# The lift over the SFT start each task aims at (issue 15), met when the difference reaches it with
# p < 0.01. Counting and boxes do not reach theirs with this ~1M-parameter model in the demo's
# budget (docs/benchmarks.md, "Demo", says why); the table says so rather than hiding it.
GOALS = {"shapes-color": 0.40, "shapes-count": 0.20, "shapes-ground": 0.10}
SIGNIFICANCE = 0.01


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mmgrpo demo", description=__doc__.strip().splitlines()[0])
    p.add_argument("--output_dir", default="runs/demo", help="Where every stage writes its folder.")
    p.add_argument("--sft_config", default=str(CONFIGS / "demo_sft.yaml"), help="SFT stage config.")
    p.add_argument("--grpo_config", default=str(CONFIGS / "demo_grpo.yaml"), help="GRPO stage config.")
    p.add_argument("--sft_steps", type=int, default=None, help="Override the SFT steps (smaller for a smoke run).")
    p.add_argument("--grpo_steps", type=int, default=None, help="Override the GRPO steps.")
    p.add_argument("--eval_limit", type=int, default=None, help="Evaluate only the first N test samples per dataset.")
    p.add_argument("--seed", type=int, default=0, help="Seed of every stage.")
    p.add_argument("--torch_threads", type=int, default=1, help="torch threads of every stage (see above).")
    return p.parse_args(argv)


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (data-loading workers) so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def goal_status(diff: float, p: float, goal: float) -> str:
    """"yes" when the lift reaches the goal with p < 0.01; else what it fell short on.

    >>> goal_status(0.45, 0.001, 0.40), goal_status(0.05, 0.001, 0.20), goal_status(-0.01, 0.5, 0.10)
    ('yes', 'no (below goal)', 'no (worse)')
    """
    if diff >= goal and p < SIGNIFICANCE:
        return "yes"
    if diff < 0:
        return "no (worse)"
    return "no (below goal)" if diff < goal else "no (p >= 0.01)"


def evaluate_all(model_path: str, out: Path, limit: int | None) -> dict[str, dict]:
    from mmgrpo.data.registry import resolve_dataset
    from mmgrpo.eval.run import evaluate, load_for_eval

    engine, template = load_for_eval(model_path, None)  # the model type the checkpoint recorded
    results = {}
    for name, _, _ in TASKS:
        dataset = resolve_dataset(f"{name}:test")
        results[name] = evaluate(engine, template, dataset, out / name, metrics=dataset.reward_funcs,
                                 model_name=model_path, max_new_tokens=40, limit=limit)
    return results


def main(argv: list[str] | None = None) -> None:
    import torch

    from mmgrpo.config import SFTConfig, TrainConfig
    from mmgrpo.engine import train
    from mmgrpo.eval.compare import compare, write_compare
    from mmgrpo.eval.report import write_report
    from mmgrpo.models.tiny import resolve_model_path
    from mmgrpo.sft import sft

    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    out = Path(args.output_dir)
    start = time.perf_counter()
    common = ["--output_dir", "", "--seed", str(args.seed), "--torch_threads", str(args.torch_threads)]
    common[1] = str(out / "sft")
    sft_argv = ["--config", args.sft_config, *common] + (["--max_steps", str(args.sft_steps)] if args.sft_steps else [])
    sft_cfg = SFTConfig.from_args(sft_argv)

    console.rule(f"1/6 build {sft_cfg.model.model}")
    console.print(f"checkpoint: {resolve_model_path(sft_cfg.model.model)}")

    console.rule("2/6 SFT warm start")
    sft_model = sft(sft_cfg)

    console.rule("3/6 evaluate the SFT start")
    before = evaluate_all(str(sft_model), out / "eval_sft", args.eval_limit)

    console.rule("4/6 GRPO")
    common[1] = str(out / "grpo")
    # a demo run again replaces its GRPO stage (mmgrpo train refuses a used --output_dir otherwise)
    grpo_argv = ["--config", args.grpo_config, "--model", str(sft_model), *common, "--overwrite_output_dir"]
    grpo_argv += ["--max_steps", str(args.grpo_steps)] if args.grpo_steps else []
    grpo_cfg = TrainConfig.from_args(grpo_argv)
    if args.eval_limit and grpo_cfg.eval.eval_dataset:  # a smoke run evaluates little during training too
        grpo_cfg.eval.eval_limit = min(args.eval_limit, grpo_cfg.eval.eval_limit or args.eval_limit)
    run_dir = train(grpo_cfg)
    grpo_model = run_dir / f"checkpoint-{grpo_cfg.max_steps}"

    console.rule("5/6 evaluate the GRPO model")
    after = evaluate_all(str(grpo_model), out / "eval_grpo", args.eval_limit)

    console.rule("6/6 compare")
    table = Table(title="held-out test accuracy: SFT start vs after GRPO")
    for column in ("dataset", "metric", "SFT", "GRPO", "diff [95% CI]", "p", "goal", "met"):
        table.add_column(column)
    for name, metric, _ in TASKS:
        result = compare(out / "eval_sft" / name, out / "eval_grpo" / name, seed=args.seed)
        write_compare(result, out / "compare" / f"{name}.json")
        row = next(r for r in result["metrics"] if r["metric"] == metric)
        table.add_row(name, metric, f"{row['a']:.3f}", f"{row['b']:.3f}",
                      f"{row['diff']:+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]", f"{row['p']:.2g}",
                      f"{GOALS[name]:+.2f}", goal_status(row["diff"], row["p"], GOALS[name]))
    console.print(table)
    report = write_report(run_dir)
    console.print(f"GRPO run report: {report}")
    console.print(f"comparisons: {out / 'compare'}")
    console.print(f"demo finished in {time.perf_counter() - start:.0f} s ({cpu_seconds():.0f} CPU s)")
    return before, after
