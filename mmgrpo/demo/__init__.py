"""The embedded demo: a tiny Qwen2-VL gets better at three visual tasks by reward alone.

    make demo                                  # = .venv/bin/mmgrpo demo --output_dir runs/demo
    mmgrpo demo --seed 1                       # another GRPO seed from the same shipped start
    mmgrpo demo --from_scratch --seed 1        # rebuild the start for seed 1 first (about 30 minutes)

1. check the shipped SFT start (mmgrpo/demo/start/: `tiny:qwen2-vl?vision_init_gain=3&rope_theta=10`,
   ~1M parameters, trained on colour, counting and boxes; mmgrpo/demo/shipped_start.py says how), so every
   machine starts GRPO from the same weights; `--from_scratch` builds it for this seed instead
2. evaluate the start on each held-out test split (400 samples a task)
3. GRPO on the mixture (mmgrpo/demo/configs/grpo.yaml), each dataset scored by its own rewards,
   with evaluations on the validation splits during training (the report draws them)
4. evaluate the GRPO model on the same test splits
5. compare the two per task (paired bootstrap interval, McNemar p-value) and print them side by
   side, with what the demo aims to show for each task; write the run's HTML report

Every stage runs with one torch thread (--torch_threads): on 2 shared cores OpenMP's spin-waits
made this tiny model 3-4x slower with two.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from mmgrpo.demo import shipped_start as demo_start
from mmgrpo.demo.table import TaskResult, result_table
from mmgrpo.runstate.runlog import console

CONFIGS = Path(__file__).resolve().parent / "configs"
GRPO_CONFIG = CONFIGS / "grpo.yaml"
# (dataset, the metric the demo reports, the lift the demo aims to show at p < 0.01; issue 38)
TASKS = [
    ("shapes-color", "vqa_accuracy", 0.40),
    ("shapes-count", "vqa_accuracy", 0.10),
    ("shapes-ground", "iou_acc@0.5", 0.05),
]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mmgrpo demo", description=__doc__.strip().splitlines()[0])
    p.add_argument("--output_dir", default="runs/demo", help="Where every stage writes its folder.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the GRPO stage (and of the start's stages with --from_scratch).")
    p.add_argument("--from_scratch", action="store_true",
                   help="Build the SFT start for --seed (output_dir/start/, about 30 minutes on 2 cores) instead of "
                        "using the shipped one.")
    p.add_argument("--start", default=None, help="Start GRPO from this checkpoint folder instead of the shipped start.")
    p.add_argument("--grpo_config", default=str(GRPO_CONFIG), help="The GRPO stage's config.")
    p.add_argument("--grpo_steps", type=int, default=None, help="Override the GRPO stage's steps (smaller for a smoke run).")
    p.add_argument("--start_steps", type=int, default=None, help="With --from_scratch: override each start stage's steps.")
    p.add_argument("--eval_limit", type=int, default=None, help="Evaluate only the first N samples per dataset.")
    p.add_argument("--torch_threads", type=int, default=1, help="torch threads of every stage (see above).")
    args = p.parse_args(argv)
    if args.from_scratch and args.start:
        p.error("--from_scratch builds the start; --start names one: give one of them")
    if args.start_steps and not args.from_scratch:
        p.error("--start_steps shrinks the start's stages, which only run with --from_scratch")
    return args


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (data-loading workers) so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def grpo_argv(args, start: Path, out: Path) -> list[str]:
    """The GRPO stage's flags: its config, the start, seed, threads and folder; a demo run again
    replaces its GRPO folder (mmgrpo train refuses a used --output_dir otherwise)."""
    steps = ["--max_steps", str(args.grpo_steps)] if args.grpo_steps else []
    return ["--config", args.grpo_config, "--model", str(start), "--output_dir", str(out / "grpo"),
            "--seed", str(args.seed), "--torch_threads", str(args.torch_threads), "--overwrite_output_dir"] + steps


def evaluate_all(model_path: str, out: Path, limit: int | None) -> dict[str, dict]:
    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.eval.evaluate import evaluate, load_for_eval

    engine, template = load_for_eval(model_path, None)  # the model type the checkpoint recorded
    results = {}
    for name, _, _ in TASKS:
        dataset = resolve_dataset(f"{name}:test")
        results[name] = evaluate(engine, template, dataset, out / name, metrics=dataset.reward_funcs,
                                 model_name=model_path, max_new_tokens=40, limit=limit)
    return results


def scores_line(results: dict[str, dict]) -> str:
    return ", ".join(f"{name} {metric} {results[name]['metrics'][metric]:.3f}" for name, metric, _ in TASKS)


def main(argv: list[str] | None = None):
    args = parse_args(argv)  # before the heavy imports: --help stays instant
    import torch

    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train
    from mmgrpo.eval.compare import compare, write_compare
    from mmgrpo.eval.report import write_report

    torch.set_num_threads(args.torch_threads)
    out = Path(args.output_dir)
    started = time.perf_counter()
    TrainConfig.from_args(grpo_argv(args, Path("start"), out))  # the GRPO flags parse before anything runs

    console.rule("1/5 the SFT start")
    if args.from_scratch:
        start = demo_start.build_start(out / "start", seed=args.seed, torch_threads=args.torch_threads, steps=args.start_steps,
                            eval_limit=args.eval_limit)
    elif args.start:
        start = Path(args.start)
    else:
        start = demo_start.checked_start()
        console.print(f"the shipped start: {start} ({demo_start.read_manifest(start).get('built_by', '')})")

    console.rule("2/5 evaluate the start")
    before = evaluate_all(str(start), out / "eval_start", args.eval_limit)
    console.print(f"the start: {scores_line(before)}")

    console.rule(f"3/5 GRPO from the start, seed {args.seed}")
    cfg = TrainConfig.from_args(grpo_argv(args, start, out))
    cfg.data.dataset_registry = [str(demo_start.REGISTRY)]
    if args.eval_limit and cfg.eval.eval_dataset:  # a smoke run evaluates little during training too
        cfg.eval.eval_limit = min(args.eval_limit, cfg.eval.eval_limit or args.eval_limit)
    run_dir = train(cfg)
    grpo_model = run_dir / f"checkpoint-{cfg.max_steps}"

    console.rule("4/5 evaluate the GRPO model")
    evaluate_all(str(grpo_model), out / "eval_grpo", args.eval_limit)

    console.rule("5/5 compare")
    results = []
    for name, metric, aim in TASKS:
        comparison = compare(out / "eval_start" / name, out / "eval_grpo" / name, seed=args.seed)
        write_compare(comparison, out / "compare" / f"{name}.json")
        row = next(r for r in comparison["metrics"] if r["metric"] == metric)
        results.append(TaskResult(name, metric, row["a"], row["b"], row["diff"], row["ci_low"], row["ci_high"],
                                  row["p"], aim))
    console.print(result_table(results, samples=len(before[TASKS[0][0]]["samples"])))
    console.print(f"GRPO run report: {write_report(run_dir)}")
    console.print(f"comparisons: {out / 'compare'}")
    console.print(f"demo finished in {time.perf_counter() - started:.0f} s ({cpu_seconds():.0f} CPU s)")
    return results
