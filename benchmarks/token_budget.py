"""Fixed micro-batches against a token budget (`--max_tokens_per_microbatch`) on one GRPO step.

    python benchmarks/token_budget.py                  # about a minute
    python benchmarks/token_budget.py --budget 3000 --repeats 5

The rollout is replaced by fixed completions with a long tail of lengths (one prompt in four
has completions of 150-256 tokens, the others 16-64), so that the only difference between the
two runs is how rows are grouped into log-prob forwards:
  fixed   --per_device_train_batch_size 16 (two groups of G = 8 per forward)
  budget  --max_tokens_per_microbatch N (default: the padded size of the largest fixed forward,
          so no forward is bigger than before)
Both run the reference and update forwards of the same step on a tiny Qwen2-VL (hidden 256,
fp32, one thread), alternately; printed are pad_fraction, the forwards' seconds and the step's
CPU seconds. (That both give the same loss and gradients is tests/test_batching.py's job.)
"""

from __future__ import annotations

import argparse
import atexit
import copy
import dataclasses
import random
import shutil
import statistics
import tempfile
import time

import PIL.Image
import torch

from mmgrpo.config import TrainConfig
from mmgrpo.data.prompt_batches import PromptEncoder
from mmgrpo.data.sample import normalize_row
from mmgrpo.engine import grpo_step
from mmgrpo.models.tiny import build_tiny
from mmgrpo.rollout.base import Rollout, RolloutEngine
from mmgrpo.training.build import build_run


def long_tail_lengths(num_prompts: int, group: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(150, 256) if p % 4 == 1 else rng.randint(16, 64) for p in range(num_prompts) for _ in range(group)]


class FixedEngine(RolloutEngine):
    """A rollout engine that returns the same completions every time (the forwards are measured)."""

    def __init__(self, rollout):
        self.rollout = rollout

    def generate(self, prompts, sampling):
        return copy.copy(self.rollout)  # a fresh one to score each time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    parser.add_argument("--num_generations", type=int, default=8, help="G (default 8)")
    parser.add_argument("--budget", type=int, default=0, help="tokens per forward (default: the largest fixed forward)")
    parser.add_argument("--repeats", type=int, default=3, help="steps per variant, alternating (default 3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    B, G, T = args.prompts, args.num_generations, 256
    lengths = long_tail_lengths(B, G)
    model = build_tiny("qwen2-vl", hidden_size=256, intermediate_size=512, num_attention_heads=8)
    out = tempfile.mkdtemp(prefix="mmgrpo-token-budget-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    cfg = TrainConfig.from_args([
        "--model", str(model), "--model_type", "qwen2-vl", "--reward_funcs", "answer_format", "--num_generations", str(G),
        "--per_device_train_batch_size", str(min(16, B * G)), "--gradient_accumulation_steps", str(max(1, B * G // 16)),
        "--max_completion_length", str(T), "--beta", "0.04", "--learning_rate", "0", "--dataloader_num_workers", "0",
        "--output_dir", out,
    ])
    run = build_run(cfg)
    optimizer = torch.optim.SGD(run.policy.trainable_parameters(), lr=0.0)
    ids = torch.randint(100, 600, (B * G, T), generator=torch.Generator().manual_seed(0))  # [N, T]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()  # [N, T]
    rollout = Rollout(ids.masked_fill(mask == 0, run.template.completion_pad_id), mask, torch.tensor(lengths) == T)
    run = dataclasses.replace(
        run, rollout=FixedEngine(rollout), optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    encoder = PromptEncoder(run.template, 4096)
    prompts = []
    for i in range(B):
        image = PIL.Image.new("RGB", (224, 224), ((60 * i) % 255, 90, 200))
        sample = normalize_row({"query": "<image>What colour is it?", "images": [image]}, dataset="budget", index=i)
        prompts.append((sample, encoder(sample.load_media())))
    prompt_tokens = max(enc.prompt_ids.shape[-1] for _, enc in prompts)
    budget = args.budget or 2 * prompt_tokens + 16 * max(lengths)  # two prompts + 16 rows at the longest

    results: dict[str, list[dict]] = {"fixed": [], "budget": []}
    for _ in range(args.repeats):
        for name in results:
            cfg.algo.max_tokens_per_microbatch = budget if name == "budget" else 0
            cpu = time.process_time()
            metrics, _ = grpo_step(run, prompts, step=1)
            metrics["cpu"] = time.process_time() - cpu
            results[name].append(metrics)

    print(f"{B} prompts of {prompt_tokens} tokens x G={G}; completion lengths 16-64, one prompt in four 150-256; "
          f"budget {budget} tokens")
    for name, runs in results.items():
        seconds = [m["time/ref"] + m["time/update"] for m in runs]
        print(f"{name:<7} pad_fraction {runs[0]['pad_fraction']:.3f}, {runs[0]['micro_batches']} forwards, "
              f"ref+update {statistics.median(seconds):.2f} s (CPU {statistics.median(m['cpu'] for m in runs):.2f} s "
              f"for the step)")
    ratios = [(f["time/ref"] + f["time/update"]) / (b["time/ref"] + b["time/update"])
              for f, b in zip(results["fixed"], results["budget"])]
    print(f"fixed/budget ref+update seconds: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
