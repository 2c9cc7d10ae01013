"""Rollout time on a mixture of short and long answers: finished prompts leaving the decode batch.

A GRPO mixture such as the demo's (colour and count answers of a few tokens beside boxes of about
30) decodes, in one batch, until its longest row ends. `SharedPrefixRollout` drops a prompt from
the decode batch once its G rows have finished; this measures what that saves against the same
engine decoding every row to the end (`drop_finished=False`) and against HF `generate` (the
engine TRL's trainer uses), on the same prompts, alternating A B C per repeat, one thread:

    .venv/bin/python benchmarks/mixed_lengths.py
    .venv/bin/python benchmarks/mixed_lengths.py --prompts 128 --long_every 9 --repeats 5

The prompts are the shapes datasets' (colour and count questions, boxes every `--long_every`-th
prompt), the model the random tiny Qwen2-VL. A random model does not end its answers where a
trained one does, so EOS is never sampled and every row ends at its prompt's budget, as with the
registry's per-dataset `max_completion_length`: `--short` tokens for colour and count, `--long`
for boxes. Printed: median wall and CPU seconds per rollout, and the ratios; the two shared-prefix
runs must give the same completions (checked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def prompts_and_budgets(template, count: int, long_every: int, short: int, long: int):
    from mmgrpo.data.catalog import resolve_dataset

    datasets = {name: resolve_dataset(name) for name in ("shapes-color", "shapes-count", "shapes-ground")}
    prompts, budgets = [], []
    for i in range(count):
        name = "shapes-ground" if i % long_every == long_every - 1 else ("shapes-color", "shapes-count")[i % 2]
        prompts.append(template.encode_prompt(datasets[name][i].load_media()))
        budgets.append(long if name == "shapes-ground" else short)
    return prompts, budgets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--long_every", type=int, default=5, help="every n-th prompt is a box (long answer)")
    parser.add_argument("--short", type=int, default=6, help="colour and count answers' length")
    parser.add_argument("--long", type=int, default=32, help="boxes' answer length")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from mmgrpo.models import load_model, load_processor
    from mmgrpo.models.tiny import build_tiny
    from mmgrpo.rollout import HFRollout, SamplingParams, SharedPrefixRollout
    from mmgrpo.templates import get_template

    path = str(build_tiny("qwen2-vl"))
    model = load_model(path).eval()
    side = 112  # the demo's images: 16 visual tokens
    template = get_template("qwen2-vl", load_processor(path), max_pixels=side * side, min_pixels=side * side)
    prompts, budgets = prompts_and_budgets(template, args.prompts, args.long_every, args.short, args.long)
    no_eos = dict(suppress_token_ids=sorted({*template.suppress_token_ids, *template.eos_token_ids}))
    engines = {
        "hf generate": HFRollout(model, template, **no_eos),
        "shared, every row to the end": SharedPrefixRollout(model, template, drop_finished=False, **no_eos),
        "shared, finished prompts leave": SharedPrefixRollout(model, template, **no_eos),
    }
    params = SamplingParams(num_generations=args.num_generations, max_new_tokens=max(budgets), seed=0,
                            max_new_tokens_per_prompt=budgets)  # fmt: skip
    long_count = sum(b == args.long for b in budgets)
    print(f"{len(prompts)} prompts ({long_count} boxes of {args.long} tokens, the others {args.short}), "
          f"G={args.num_generations}, tiny Qwen2-VL, {side}x{side} images, 1 thread")  # fmt: skip
    wall = {name: [] for name in engines}
    cpu = {name: [] for name in engines}
    outputs = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            rollout = engine.generate(prompts, params)
            if repeat:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
            outputs[name] = rollout
    same = outputs["shared, every row to the end"].completion_ids.equal(
        outputs["shared, finished prompts leave"].completion_ids
    )
    tokens = int(outputs["shared, finished prompts leave"].completion_mask.sum())
    base = {key: statistics.median(values) for key, values in wall.items()}
    for name in engines:
        median = base[name]
        print(f"  {name:<32} {median:7.3f} s/rollout  cpu {statistics.median(cpu[name]):7.3f} s  "
              f"{tokens / median:8.0f} tokens/s  x{base['hf generate'] / median:5.2f} vs hf generate  "
              f"x{base['shared, every row to the end'] / median:5.2f} vs every row to the end")  # fmt: skip
    print(f"  same completions with and without dropping finished prompts: {same}")
    if not same:
        raise SystemExit("the completions differ: dropping finished prompts changed the rollout")


if __name__ == "__main__":
    main()
