"""The embedded demo: a tiny Qwen2-VL learns to see, by reward alone.

    make demo                       # or: .venv/bin/mmgrpo demo --output_dir runs/demo

1. build `tiny:qwen2-vl?vision_init_gain=3` offline (random weights, ~1M parameters)
2. SFT warm start in two stages: counting alone, from a wider vision init, until held-out counting
   reads 0.30 (configs/demo_sft.yaml), then the whole mixture until held-out colour accuracy
   reaches 0.40 (configs/demo_sft_colour.yaml); both stop by `--stop_at` on the validation split,
   so GRPO starts every seed from the same colour accuracy
3. evaluate the SFT model on each held-out test split (the baseline)
4. GRPO on the mixture (configs/demo_grpo.yaml), each dataset scored by its own rewards, with
   held-out evaluations during training (the report draws them against steps and seconds)
5. evaluate the GRPO model on the same splits
6. compare the two per dataset (paired bootstrap interval, McNemar / permutation p-value),
   print them side by side, and write the run's HTML report

Every stage runs with one torch thread (--torch_threads): on 2 shared cores OpenMP's spin-waits
made this tiny model 3-4x slower with two. Two data-loading workers encode the prompts ahead of
each step (configs/demo_grpo.yaml).
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from rich.table import Table

from mmgrpo.training.runlog import console

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# (dataset, metric the demo reports, what it means)
TASKS = [
    ("shapes-color", "vqa_accuracy", "colour of the shape (VQAv2 soft accuracy)"),
    ("shapes-count", "vqa_accuracy", "how many shapes (exact)"),
    ("shapes-ground", "iou_acc@0.5", "box of a named shape (Acc@IoU0.5)"),
]
# The lift over the SFT start each task aims at (issue 15), met when the difference reaches it with
# p < 0.01. This ~1M-parameter model meets the colour goal in each of three seeds, and neither count
# nor boxes, in the demo's budget (docs/benchmarks.md, "Demo", says why); the table says so rather
# than hiding it.
GOALS = {"shapes-color": 0.40, "shapes-count": 0.20, "shapes-ground": 0.10}
SIGNIFICANCE = 0.01
SFT_CONFIGS = [str(CONFIGS / "demo_sft.yaml"), str(CONFIGS / "demo_sft_colour.yaml")]
GRPO_CONFIGS = [str(CONFIGS / "demo_grpo.yaml")]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mmgrpo demo", description=__doc__.strip().splitlines()[0])
    p.add_argument("--output_dir", default="runs/demo", help="Where every stage writes its folder.")
    p.add_argument("--sft_config", nargs="+", default=SFT_CONFIGS, help="SFT stage configs, run in turn, each from the model the one before wrote.")
    p.add_argument("--grpo_config", nargs="+", default=GRPO_CONFIGS, help="GRPO stage configs, run in turn, each from the model the one before wrote.")
    p.add_argument("--sft_steps", type=int, default=None, help="Override each SFT stage's steps (smaller for a smoke run).")
    p.add_argument("--grpo_steps", type=int, default=None, help="Override each GRPO stage's steps.")
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


def stage_argv(args, kind: str, config: str, number: int, count: int, out: Path) -> list[str]:
    """The flags of one SFT or GRPO stage: its config, seed, threads, and its folder under `out`:
    <kind> when the demo has one such stage, else <kind>-N."""
    folder = out / (kind if count == 1 else f"{kind}-{number}")
    steps = args.sft_steps if kind == "sft" else args.grpo_steps
    return ["--config", config, "--output_dir", str(folder), "--seed", str(args.seed),
            "--torch_threads", str(args.torch_threads)] + (["--max_steps", str(steps)] if steps else [])


def shrink_evals(cfg, limit: int | None):
    """A smoke run (--eval_limit) evaluates little during training too."""
    if limit and cfg.eval.eval_dataset:
        cfg.eval.eval_limit = min(limit, cfg.eval.eval_limit or limit)
    return cfg


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
    stages = len(args.sft_config)  # every stage's flags parse before the first trains
    sft_cfgs = [shrink_evals(SFTConfig.from_args(stage_argv(args, "sft", config, number, stages, out)), args.eval_limit)
                for number, config in enumerate(args.sft_config, 1)]

    console.rule(f"1/6 build {sft_cfgs[0].model.model}")
    console.print(f"checkpoint: {resolve_model_path(sft_cfgs[0].model.model)}")

    sft_model = None
    for number, sft_cfg in enumerate(sft_cfgs, 1):
        console.rule(f"2/6 SFT warm start, stage {number} of {len(sft_cfgs)}: {Path(args.sft_config[number - 1]).name}")
        if sft_model is not None:
            sft_cfg.model.model = str(sft_model)
        sft_model = sft(sft_cfg)

    console.rule("3/6 evaluate the SFT start")
    before = evaluate_all(str(sft_model), out / "eval_sft", args.eval_limit)

    console.rule("4/6 GRPO")
    grpo_model, run_dirs, stages = sft_model, [], len(args.grpo_config)
    for number, config in enumerate(args.grpo_config, 1):
        if stages > 1:
            console.print(f"GRPO stage {number} of {stages}: {Path(config).name}")
        # a demo run again replaces its GRPO stages (mmgrpo train refuses a used --output_dir otherwise)
        argv = stage_argv(args, "grpo", config, number, stages, out) + ["--model", str(grpo_model), "--overwrite_output_dir"]
        grpo_cfg = shrink_evals(TrainConfig.from_args(argv), args.eval_limit)
        run_dirs.append(train(grpo_cfg))
        grpo_model = run_dirs[-1] / f"checkpoint-{grpo_cfg.max_steps}"

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
    for run_dir in run_dirs:
        console.print(f"GRPO run report: {write_report(run_dir)}")
    console.print(f"comparisons: {out / 'compare'}")
    console.print(f"demo finished in {time.perf_counter() - start:.0f} s ({cpu_seconds():.0f} CPU s)")
    return before, after
