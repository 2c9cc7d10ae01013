"""The CUDA / bf16 paths of mmgrpo, checked and timed on one GPU (CI and the developers' machines
have none: run it where one is).

    python benchmarks/cuda_check.py --out runs/cuda_check

1. GRPO in bf16 autocast on the GPU: tiny Qwen2-VL on shapes-color (a length reward that varies
   within every group, and the format reward), G=8, 8 prompts a step,
   32-token completions, 8 steps, the engines `mmgrpo train` picks (shared prefix, lean decode
   steps), fused AdamW: seconds per step and its phases, peak GPU memory, finite losses. The same
   run twice (A, B): how far two identical CUDA runs drift apart (atomics in some backward
   kernels are not deterministic).
2. Exact resume on CUDA: A's checkpoint-4 (with the CUDA RNG state) resumed in a fresh folder
   whose logs stop at step 3, as a kill between checkpoint-4's save and its log line leaves them:
   step 4 comes back from the checkpoint, steps 5-8 are trained again and compared with A's
   (the same sampled completions where the numerics agree; metrics within the A-vs-B drift).
   Parts 1 and 2 run again with --full_determinism: A, B and the resumed run must then agree.
3. Rollout engines in bf16 on the GPU, on the same 16 prompts, greedy, 32 tokens: the lean decode
   step, transformers' decode step (both behind the shared prefix) and HF generate: identical
   tokens, log-prob gap, tokens/s.
4. A user's defaults on the GPU: `mmgrpo train` without --bf16 (bf16 autocast where the GPU has it,
   recorded in config.yaml, said in the start-up summary) and `mmgrpo eval` without --device or
   --torch_dtype (the GPU, bfloat16), timed against `mmgrpo eval --device cpu --torch_dtype float32`.
5. fp16 with loss scaling on the GPU (what a V100/T4 user runs): one process with torch's GradScaler
   and one DeepSpeed ZeRO-3 rank with DeepSpeed's loss scaler (float16 DeepSpeed has no CPU kernel,
   so this is its only check): finite losses, the scale and overflow counts of each step.

Prints a table and writes `cuda_check.json` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARYING = ("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s")  # wall-clock figures
STEPS, SAVE_AT = 8, 4


# a reward that differs within a group from the first step (the random tiny model never answers in
# the format yet), so every step has advantages, gradients and an update to reproduce
LENGTH_REWARD = "def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n"


def train(out: Path, *extra: str) -> float:
    """`mmgrpo train` in a subprocess; returns its wall seconds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    reward = out.parent / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    flags = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "8",
             "--reward_funcs", f"{reward}:length", "answer_format",
             "--per_device_train_batch_size", "64", "--max_completion_length", "32", "--bf16", "true",
             "--max_steps", str(STEPS), "--save_steps", str(SAVE_AT), "--learning_rate", "1e-3",
             "--report_to", "none", "--dataloader_num_workers", "2", "--output_dir", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mmgrpo", "train", *flags, *extra], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"mmgrpo train failed ({out}):\n{done.stderr[-4000:]}")
    return time.perf_counter() - started


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VARYING)}


def completions(out: Path) -> dict[int, list[str]]:
    by_step: dict[int, list[str]] = {}
    for line in (out / "completions.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).append(json.dumps(record.get("completions", record), sort_keys=True))
    return by_step


def drift(a: list[dict], b: list[dict], keys=("loss", "reward", "kl", "grad_norm")) -> float:
    """Largest relative difference of the step metrics `keys` between two runs, step by step."""
    worst = 0.0
    for x, y in zip(a, b):
        for key in keys:
            if isinstance(x.get(key), (int, float)) and isinstance(y.get(key), (int, float)):
                worst = max(worst, abs(x[key] - y[key]) / max(abs(x[key]), abs(y[key]), 1e-12))
    return worst


def check_training(out: Path, *extra: str) -> dict:
    a, b, resumed = out / "A", out / "B", out / "resumed"
    for path in (a, b, resumed):
        shutil.rmtree(path, ignore_errors=True)
    wall_a = train(a, *extra)
    wall_b = train(b, *extra)
    rows_a, rows_b = rows(a), rows(b)
    # a kill right after checkpoint-4 was written, before the loop logged step 4
    resumed.mkdir(parents=True)
    shutil.copytree(a / f"checkpoint-{SAVE_AT}", resumed / f"checkpoint-{SAVE_AT}")
    for name in ("metrics.jsonl", "completions.jsonl"):
        kept = [line for line in (a / name).read_text().splitlines(keepends=True) if json.loads(line)["step"] < SAVE_AT]
        (resumed / name).write_text("".join(kept))
    train(resumed, "--resume_from_checkpoint", "latest", *extra)
    rows_r = rows(resumed)
    steps = [r["step"] for r in rows_a]
    timed = rows_a[1:]  # step 1 includes CUDA warm-up
    phases = {k: statistics.median(r[k] for r in timed) for k in timed[0] if k.startswith("time/")}
    comp_a, comp_b, comp_r = completions(a), completions(b), completions(resumed)
    return {
        "steps": steps,
        "finite": all(isinstance(r.get("loss"), float) for r in rows_a + rows_b + rows_r),
        "s_per_step_median": phases.get("time/step"),
        "phases_median_s": phases,
        "samples_per_s_median": statistics.median(r["samples_per_s"] for r in timed),
        "peak_memory_gb": max(r.get("memory/peak_gb", 0.0) for r in rows_a),
        "wall_s": {"A": wall_a, "B": wall_b},
        "rewards": [r["reward"] for r in rows_a],
        "A_vs_B_drift": drift(rows_a, rows_b),
        "A_vs_B_same_completions_steps": [s for s in steps if comp_a.get(s) == comp_b.get(s)],
        "resumed_steps": [r["step"] for r in rows_r],
        "resumed_step4_restored_equal": stable(rows_r[SAVE_AT - 1]) == stable(rows_a[SAVE_AT - 1]),
        "resumed_vs_A_drift": drift(rows_a[SAVE_AT:], rows_r[SAVE_AT:]),
        "resumed_vs_A_exact_steps": [r["step"] for r, x in zip(rows_r[SAVE_AT:], rows_a[SAVE_AT:]) if stable(r) == stable(x)],
        "resumed_vs_A_same_completions_steps": [s for s in steps[SAVE_AT:] if comp_a.get(s) == comp_r.get(s)],
    }


def check_engines(device_name: str = "cuda") -> dict:
    import torch

    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.forward.policy import autocast
    from mmgrpo.models.loading import load_model, load_template
    from mmgrpo.rollout.base import SamplingParams
    from mmgrpo.rollout.hf import HFRollout
    from mmgrpo.rollout.shared_prefix_engine import SharedPrefixRollout

    device = torch.device(device_name)
    path, _, template = load_template("tiny:qwen2-vl", "qwen2-vl")
    model = load_model(path, dtype=torch.float32, template=template).to(device).eval()
    view = resolve_dataset("shapes-color", "test")
    prompts = [template.encode_prompt(view[i].load_media()) for i in range(16)]
    eos = list(template.eos_token_ids)
    quiet = dict(eos_token_ids=eos, suppress_token_ids=[*template.suppress_token_ids, *eos])  # all 32 tokens
    engines = {
        "lean": SharedPrefixRollout(model, template, lean=True, **quiet),
        "transformers_step": SharedPrefixRollout(model, template, lean=False, **quiet),
        "hf_generate": HFRollout(model, template, **quiet),
    }
    assert engines["lean"].lean is not None, "the lean step does not apply"
    params = SamplingParams(num_generations=1, max_new_tokens=32, greedy=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results, outputs = {}, {}
    for name, engine in engines.items():
        with torch.no_grad(), autocast(True, device):
            engine.generate(prompts, params)  # warm-up
            sync()
            started = time.perf_counter()
            for _ in range(3):
                rollout = engine.generate(prompts, params)
            sync()
        seconds = (time.perf_counter() - started) / 3
        outputs[name] = rollout
        results[name] = {"tokens_per_s": int(rollout.completion_mask.sum()) / seconds, "seconds": seconds}
    lean, step = outputs["lean"], outputs["transformers_step"]
    for name in ("transformers_step", "hf_generate"):
        other = outputs[name]
        results[name]["same_tokens_as_lean"] = float((other.completion_ids == lean.completion_ids).all(-1).float().mean())
    gap = (lean.logps - step.logps).abs()[lean.completion_mask.bool()]
    results["lean_vs_transformers_step_logp_gap_max"] = float(gap.max())
    results["gpu"] = torch.cuda.get_device_name() if device.type == "cuda" else "none (a dry run on the CPU)"
    results["torch"], results["transformers"] = torch.__version__, __import__("transformers").__version__
    return results


def check_defaults(out: Path) -> dict:
    """Part 4: what a run and an eval pick on this machine when the user names no precision or device."""
    import yaml

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    run = out / "defaults_train"
    shutil.rmtree(run, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "mmgrpo", "train", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
                           "--num_generations", "4", "--max_steps", "1", "--max_completion_length", "8",
                           "--report_to", "none", "--save_strategy", "no", "--output_dir", str(run)],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"mmgrpo train (defaults) failed:\n{done.stderr[-4000:]}")
    summary = next((line for line in done.stderr.splitlines() if line.startswith("device ")), "")
    result = {"train_bf16": yaml.safe_load((run / "config.yaml").read_text())["bf16"], "train_device_line": summary.strip()}
    for name, extra in (("eval_default", ()), ("eval_cpu_fp32", ("--device", "cpu", "--torch_dtype", "float32"))):
        folder = out / name
        shutil.rmtree(folder, ignore_errors=True)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "mmgrpo", "eval", "--model", "tiny:qwen2-vl", "--dataset",
                               "shapes-color:test", "--limit", "64", "--max_completion_length", "16", "--output_dir",
                               str(folder), *extra], env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"mmgrpo eval {' '.join(extra)} failed:\n{done.stderr[-4000:]}")
        result[f"{name}_s"] = round(time.perf_counter() - started, 2)
        result[f"{name}_line"] = next((line.strip() for line in (done.stdout + done.stderr).splitlines()
                                       if line.startswith("evaluating ")), "")
    return result


def check_fp16(out: Path) -> dict:
    """Part 5: --fp16 in one process and under DeepSpeed ZeRO-3 (one rank): the loss scale per step."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    reward = out / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    result = {}
    for name, launch in (("fp16_single", [sys.executable, "-m", "mmgrpo", "train"]),
                         ("fp16_zero3", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                                         "-m", "mmgrpo", "train", "--deepspeed", "zero3"])):
        run = out / name
        shutil.rmtree(run, ignore_errors=True)
        done = subprocess.run([*launch, "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--fp16",
                               "--num_generations", "8", "--per_device_train_batch_size", "32", "--max_steps", "4",
                               "--max_completion_length", "16", "--reward_funcs", f"{reward}:length",
                               "--learning_rate", "1e-3", "--report_to", "none", "--save_strategy", "no",
                               "--output_dir", str(run)], env=env, capture_output=True, text=True)
        if done.returncode:
            result[name] = {"error": done.stderr[-1500:]}
            continue
        lines = rows(run)
        result[name] = {"loss_scale": [line.get("fp16/loss_scale") for line in lines],
                        "overflow": [line.get("fp16/overflow") for line in lines],
                        "skipped": sum(line["skipped"] for line in lines),
                        "finite_loss": all(line["loss"] == line["loss"] for line in lines),
                        "grad_norm": [round(line["grad_norm"], 4) for line in lines]}
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/cuda_check", help="Folder for the runs and cuda_check.json.")
    parser.add_argument("--skip_training", action="store_true", help="Only the rollout engines (part 3).")
    parser.add_argument("--dry_run_on_cpu", action="store_true", help="Run it all on the CPU (to check the script).")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.dry_run_on_cpu:
        raise SystemExit("benchmarks/cuda_check.py needs a CUDA GPU (or --dry_run_on_cpu).")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"engines": check_engines("cpu" if args.dry_run_on_cpu else "cuda")}
    print(json.dumps(result["engines"], indent=1), flush=True)
    if not args.skip_training:
        for name, extra in (("training", ()), ("training_full_determinism", ("--full_determinism", "true"))):
            result[name] = check_training(out / name, *extra)
            print(name, json.dumps(result[name], indent=1), flush=True)
    result["defaults"] = check_defaults(out)
    print("defaults", json.dumps(result["defaults"], indent=1), flush=True)
    result["fp16"] = check_fp16(out)
    print("fp16", json.dumps(result["fp16"], indent=1), flush=True)
    (out / "cuda_check.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
