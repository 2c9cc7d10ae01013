"""The zoom-tool recipe, before and after GRPO: how often the model zooms, and how often it answers right.

    python benchmarks/zoom_tool.py --models runs/zoom/sft/final runs/zoom/grpo/checkpoint-60 --limit 200

Each model runs shapes-zoom:test as multi-turn episodes (up to --max_turns model turns, the
built-in image_zoom_in_tool), through the same rollout engine as training, and prints per model:
the share of episodes that call the tool, the share whose call returned a crop, tool errors per
episode, turns per episode, and the colour accuracy of the final answer (`vqa_accuracy`, the
dataset's reward), overall and split by whether the episode got a crop; for every model after the
first, its accuracy difference to the first over the same questions (each question's accuracy over
its episodes paired with the first model's: bootstrap 95% CI and sign-flip p, as `mmgrpo compare`).
Greedy by default; `--num_samples k --temperature t` samples k episodes per question (the same
seeds for every model). Checkpoints saved by mmgrpo keep their pixel limits; pass --max_pixels for
others (the recipe uses 12544: 112 x 112). `--device cuda` runs the models on a GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from mmgrpo.data.catalog import resolve_dataset
from mmgrpo.eval.stats import paired_bootstrap_ci, sign_flip_test
from mmgrpo.forward.policy import Policy
from mmgrpo.models.loading import load_model, load_template
from mmgrpo.rewards import get_reward
from mmgrpo.rollout import build_rollout_engine
from mmgrpo.rollout.base import SamplingParams
from mmgrpo.runstate.runlog import progress_bar


def scores_of(scores):
    return [float(score or 0.0) for score in scores]


def evaluate(model_path: str, args) -> dict:
    path, _, template = load_template(model_path, args.model_type, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    model = load_model(path, dtype=torch.float32, template=template).to(args.device).eval()
    engine = build_rollout_engine(Policy(model, template), max_turns=args.max_turns, tools=["image_zoom_in_tool"])
    view = resolve_dataset(args.dataset, "test")
    indices = list(range(min(args.limit, len(view))))
    accuracy = get_reward("vqa_accuracy")
    rows = []
    with progress_bar(len(indices), model_path) as bar:
        for start in range(0, len(indices), args.batch_size):
            samples = [view[i] for i in indices[start : start + args.batch_size]]
            prompts = [template.encode_prompt(sample.load_media()) for sample in samples]
            params = SamplingParams(num_generations=args.num_samples, max_new_tokens=args.max_completion_length,
                                    temperature=args.temperature, greedy=args.num_samples == 1, seed=args.seed + start)  # fmt: skip
            with torch.no_grad():
                rollout = engine.generate(prompts, params)
            solutions = [s.columns["solution"] for s in samples for _ in range(args.num_samples)]
            scores = accuracy(rollout.texts, solution=solutions)
            crops = [bool(media) for media in rollout.completion_media]
            for row, score in enumerate(scores):
                rows.append({"question": indices[start + row // args.num_samples], "score": float(score or 0.0), "calls": rollout.columns["tool_calls"][row],
                             "errors": rollout.columns["tool_errors"][row], "turns": rollout.columns["turns"][row],
                             "crop": crops[row]})  # fmt: skip
            bar.advance({"reward": sum(scores_of(scores)) / len(scores)}, len(samples))

    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else float("nan")

    with_crop = [r["score"] for r in rows if r["crop"]]
    without = [r["score"] for r in rows if not r["crop"]]
    return {
        "model": model_path, "episodes": len(rows),
        "tool_use": mean(r["calls"] > 0 for r in rows), "crop": mean(r["crop"] for r in rows),
        "errors": mean(r["errors"] for r in rows), "turns": mean(r["turns"] for r in rows),
        "accuracy": mean(r["score"] for r in rows),
        "accuracy_with_crop": mean(with_crop), "accuracy_without_crop": mean(without),
        "per_question": per_question(rows),
    }  # fmt: skip


def per_question(rows: list[dict]) -> list[float]:
    """Each question's accuracy over its sampled episodes, in question order: the pairs of the
    comparison with the first model."""
    totals: dict[int, list[float]] = {}
    for row in rows:
        totals.setdefault(row["question"], []).append(row["score"])
    return [sum(scores) / len(scores) for _, scores in sorted(totals.items())]


def compared(first: dict, other: dict) -> str:
    """Accuracy difference to the first model over the same questions, its 95% CI (paired
    bootstrap over questions) and p (paired sign-flip test), as `mmgrpo compare` computes them."""
    a, b = first["per_question"], other["per_question"]
    if len(a) != len(b):
        return "-"
    low, high = paired_bootstrap_ci(a, b)
    return f"{(sum(b) - sum(a)) / len(a):+.3f} [{low:+.3f}, {high:+.3f}], p {sign_flip_test(a, b):.2g}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="Checkpoints to compare, in order.")
    parser.add_argument("--model_type", default=None, help="Template name; read from mmgrpo checkpoints.")
    parser.add_argument("--dataset", default="shapes-zoom:test")
    parser.add_argument("--limit", type=int, default=200, help="Questions evaluated.")
    parser.add_argument("--max_turns", type=int, default=3)
    parser.add_argument("--max_completion_length", type=int, default=400, help="Token budget of a whole episode.")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--min_pixels", type=int, default=None)
    parser.add_argument("--max_pixels", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="Where the model runs (cpu, cuda, cuda:1, ...).")
    parser.add_argument("--output", default=None, help="Write the figures as JSON here too.")
    args = parser.parse_args(argv)
    results = [evaluate(model, args) for model in args.models]
    print("| model | episodes | tool use | crop returned | tool errors / episode | turns | accuracy | acc. with crop | "
          "acc. without | accuracy vs the first model |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        versus = compared(results[0], r) if r is not results[0] else "-"
        print(f"| {r['model']} | {r['episodes']} | {r['tool_use']:.3f} | {r['crop']:.3f} | {r['errors']:.2f} | "
              f"{r['turns']:.2f} | {r['accuracy']:.3f} | {r['accuracy_with_crop']:.3f} | {r['accuracy_without_crop']:.3f} | "
              f"{versus} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
