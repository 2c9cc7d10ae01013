"""`mmgrpo eval` samples per second: a plain HF generate loop, today's eval, and eval --use_vllm.

    .venv-vllm/bin/python benchmarks/eval_speed.py [--family qwen2-vl] [--limit 48] [--num_samples 1,4] \
        [--max_new_tokens 32] [--threads 1]
    python benchmarks/eval_speed.py --model "random:qwen2.5-vl-3b?num_hidden_layers=2&vision_depth=2" --limit 8
    python benchmarks/eval_speed.py --model random:qwen2.5-vl-3b --device cuda --torch_dtype bfloat16   # a GPU

The same split (shapes-color:test), the same metrics, one process:
  - hf loop:  one sample per `generate` call (HFRollout, batch 1): what an eval script that loops
              over a dataset does;
  - eval:     `mmgrpo eval` as it runs by default: batches of 32 prompts, each prompt prefilled once
              for its k samples (the shared-prefix engine where the family allows it);
  - vllm:     `mmgrpo eval --use_vllm`: the batches through a colocated vLLM engine (its start-up not
              timed; every engine makes one warm-up call of 2 samples first). Needs vLLM: run it in .venv-vllm; elsewhere that column is left out.
Greedy (k = 1) and pass@k sampling (k > 1, temperature 1). The answers of the greedy runs are
compared, and the table says whether they are equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2-vl", help="tiny model family (tiny:<family>)")
    parser.add_argument("--model", default=None,
                        help="another model than the tiny one, e.g. random:qwen2.5-vl-3b?num_hidden_layers=2 (its family's template)")
    parser.add_argument("--limit", type=int, default=48, help="samples of the test split")
    parser.add_argument("--num_samples", default="1,4", help="completions per sample, comma-separated (1 = greedy)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="as `mmgrpo eval --device` (cpu, cuda, cuda:N, auto)")
    parser.add_argument("--torch_dtype", default="auto", help="as `mmgrpo eval --torch_dtype` (auto: float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--json", default=None, help="also write the table's rows to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.eval.evaluate import evaluate, load_for_eval
    from mmgrpo.models.tiny import build_tiny
    from mmgrpo.rollout import HFRollout

    torch.set_num_threads(args.threads)
    path = args.model or str(build_tiny(args.family))
    if args.model and args.model.startswith("random:"):
        from mmgrpo.models.real_configs import random_family

        args.family = random_family(args.model)
    dataset = resolve_dataset("shapes-color:test", split="test")
    engine, template = load_for_eval(path, args.family, device=args.device, torch_dtype=args.torch_dtype)
    engines = {"hf loop": (HFRollout(engine.model, template), 1), "eval": (engine, 32)}
    if importlib.util.find_spec("vllm") is not None:
        vllm, _ = load_for_eval(path, args.family, device=args.device, torch_dtype=args.torch_dtype,
                                vllm={"max_model_len": 2048, "seed": 0, "gpu_memory_utilization": 0.9,
                                      "kv_cache_memory_bytes": 256 << 20})  # fmt: skip
        engines["vllm"] = (vllm, 32)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for k in [int(x) for x in args.num_samples.split(",")]:
            answers, row = {}, {"k": k}
            for name, (rollout, batch_size) in engines.items():
                evaluate(rollout, template, dataset, os.path.join(scratch, f"warm-{name}-{k}"), metrics=dataset.reward_funcs,
                         model_name=path, num_samples=k, max_new_tokens=args.max_new_tokens, batch_size=batch_size,
                         limit=2, show_progress=False)  # warm-up: first calls compile and allocate
                start = time.perf_counter()
                result = evaluate(rollout, template, dataset, os.path.join(scratch, f"{name}-{k}"),
                                  metrics=dataset.reward_funcs, model_name=path, num_samples=k,
                                  max_new_tokens=args.max_new_tokens, batch_size=batch_size, limit=args.limit,
                                  show_progress=False)  # fmt: skip
                seconds = time.perf_counter() - start
                row[name] = args.limit / seconds
                answers[name] = [s["completions"] for s in result["samples"]]
                print(f"{name}, k={k}: {args.limit} samples in {seconds:.2f} s = {row[name]:.1f} samples/s", flush=True)
            if k == 1:
                row["equal"] = all(a == answers["eval"] for a in answers.values())
            rows.append(row)
    names = list(engines)
    print(f"\n{args.model or 'tiny:' + args.family}, {args.limit} samples of shapes-color:test, {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s), {args.device} in {args.torch_dtype}")
    print("| k | " + " | ".join(f"{n} samples/s" for n in names) + " | eval / hf loop | greedy answers equal |")
    print("|---|" + "---|" * (len(names) + 2))
    for row in rows:
        cells = " | ".join(f"{row[n]:.1f}" for n in names)
        print(f"| {row['k']} | {cells} | {row['eval'] / row['hf loop']:.2f}x | {row.get('equal', '')} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": path, "device": args.device, "torch_dtype": args.torch_dtype, "limit": args.limit,
                       "max_new_tokens": args.max_new_tokens, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
