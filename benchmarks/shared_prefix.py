"""Group-shared prefix against the naive paths, on a tiny random model, alternating A/B runs.

    python benchmarks/shared_prefix.py [--family qwen2-vl[,qwen3.5,...]] [--image_size 448] [--num_prompts 1] \
        [--num_generations 8] [--max_new_tokens 32] [--repeats 5] [--threads 1]

Several families (comma-separated) run one after the other in one invocation and end in one table.

Times HF generate against the shared-prefix rollout (mmgrpo/rollout/shared_prefix_engine.py: each prompt
prefilled once for its G samples, lean decode steps), and the naive log-prob forward + backward
(the prompt repeated per completion) against the shared one (mmgrpo/forward/shared_prefix.py);
prints the median ratio of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from PIL import Image

from mmgrpo.data.sample import LoadedSample
from mmgrpo.forward.shared_prefix import shared_prefix_hidden
from mmgrpo.grpo.logprobs import completion_logprobs
from mmgrpo.models import load_model, load_processor
from mmgrpo.rollout import HFRollout, SamplingParams, SharedPrefixRollout
from mmgrpo.templates import get_template


def main(argv: list[str] | None = None) -> None:
    """Time HF generate vs this backend (rollout), and the naive vs shared log-prob forward +
    backward, on a tiny random model, alternating A/B runs; prints the median ratios."""

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--family", default="qwen2-vl", help="tiny model family (tiny:<family>), or several, comma-separated")
    parser.add_argument("--model", default=None, help="a checkpoint folder instead of the tiny model")
    parser.add_argument(
        "--image_size", type=int, default=448, help="square image side; max_pixels is set to fit it"
    )
    parser.add_argument("--num_prompts", type=int, default=1)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="A/B pairs per measurement")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    families = args.family.split(",")
    if args.model and len(families) > 1:
        parser.error("--model names one checkpoint: give one --family with it")
    rows = [(family, _measure(family, args)) for family in families]
    if len(rows) > 1:
        print("\n| family | rollout: HF generate / shared prefix | log-prob forward+backward: naive / shared |")
        print("|---|---|---|")
        for family, result in rows:
            cells = [f"{a:.3f} s / {b:.3f} s = {ratio:.2f}x" for a, b, ratio in result.values()]
            print(f"| `{family}` | " + " | ".join(cells) + " |")


def _measure(family: str, args) -> dict:
    """Both comparisons on one family: {name: (median s of A, median s of B, median A/B ratio)}."""
    path = args.model or f"tiny:{family}"
    model, processor = load_model(path), load_processor(path)
    template = get_template(family, processor, max_pixels=args.image_size**2)
    pixels = np.random.RandomState(0).randint(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
    takes_images = "image" in template.modalities  # else a text prompt (Qwen2, Qwen2-Audio)
    question = ("<image>" if takes_images else "") + "How many red circles?"
    samples = [
        LoadedSample(
            id=f"bench/{i}",
            messages=[{"role": "user", "content": question}],
            images=[Image.fromarray(pixels)] if takes_images else [],
        )
        for i in range(args.num_prompts)
    ]
    prompts = [template.encode_prompt(s) for s in samples]
    batch = template.collate(prompts)
    params = SamplingParams(num_generations=args.num_generations, max_new_tokens=args.max_new_tokens)
    backends = {"hf": HFRollout(model, template), "shared": SharedPrefixRollout(model, template)}
    image_tokens = int((batch["input_ids"] == template.media["image"].token_id).sum()) if takes_images else 0
    print(
        f"{path}: {args.num_prompts} prompt(s) of {batch['input_ids'].shape[1]} tokens "
        f"({image_tokens // args.num_prompts} image tokens each), "
        f"G={args.num_generations}, {args.max_new_tokens} new tokens, {args.threads} thread(s)"
    )

    def timed(fn) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    results = {}

    def compare(name: str, runs: dict) -> None:
        for fn in runs.values():  # warm-up
            fn()
        times = {k: [] for k in runs}
        for _ in range(args.repeats):
            for key, fn in runs.items():  # A B A B ...
                times[key].append(timed(fn))
        (a, ta), (b, tb) = times.items()
        wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
        cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
        ratios = [x[0] / y[0] for x, y in zip(ta, tb)]
        print(
            f"{name}: {a} {wall[a]:.3f} s (cpu {cpu[a]:.3f}), {b} {wall[b]:.3f} s (cpu {cpu[b]:.3f}); "
            f"speedup {statistics.median(ratios):.2f}x (pairs {min(ratios):.2f}-{max(ratios):.2f})"
        )
        results[name] = (wall[a], wall[b], statistics.median(ratios))

    rollout = backends["shared"].generate(prompts, params)
    compare("rollout", {k: (lambda b=b: b.generate(prompts, params)) for k, b in backends.items()})

    completion_ids, completion_mask = rollout.completion_ids, rollout.completion_mask
    lm_head = model.get_output_embeddings()
    backbone = model.get_submodule(template.components["backbone"])

    def logprob_step(shared: bool) -> None:
        model.zero_grad(set_to_none=True)
        if shared:
            hidden = shared_prefix_hidden(model, template, batch, completion_ids, completion_mask, args.num_generations)
        else:
            inputs = template.forward_inputs(batch, completion_ids, completion_mask, model=model)
            prompt_len = batch["input_ids"].shape[1]
            hidden = backbone(**inputs, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]
        logps, _ = completion_logprobs(hidden, lm_head.weight, completion_ids)
        (logps * completion_mask).sum().backward()

    model.train()
    compare(
        "log-prob forward+backward",
        {"naive": lambda: logprob_step(False), "shared": lambda: logprob_step(True)},
    )
    return results


if __name__ == "__main__":
    main()
