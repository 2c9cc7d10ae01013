"""Real size on one GPU in one short visit: Qwen2.5-VL-3B at its published configuration (random
weights, `random:qwen2.5-vl-3b`), issue 48's three items in turn, each against its peer.

    python benchmarks/gpu_suite.py --out runs/gpu_suite                  # one H100/H200: under 10 minutes
    python benchmarks/gpu_suite.py --parts media,eval --out runs/gpu_b    # the later parts alone (a rerun)
    python benchmarks/gpu_suite.py --dry_run_on_cpu --out /tmp/gpu_dry   # the same code at reduced depth, CPU (a test)

The parts share --budget_s (default 560 s, setting-up included): step 60%, media 25%, eval 15%; a
part starts no run that would end after its share, so the visit ends within the device's 10-minute
command limit with what it measured (docs/benchmarks.md, "Real size").

step (item 1: the rollout and the step). Full training in bf16 autocast with fp32 master weights
and AdamW, the vision tower frozen (--freeze_vit: its merger trains), gradient checkpointing, no
KL term (beta 0, TRL's default: a reference would add TRL's fp32 copy of the model), 448 x 448
images (256 image tokens), one prompt and G=8 completions of exactly 512 tokens a step (EOS never
sampled), loss dapo, lr 1e-6. `mmgrpo estimate` put this at 57 GB of an 80 GB H100. Three systems,
each in its own process, in the order mmgrpo, TRL, mmgrpo --shared_prefix false, then again while
the part's time lasts (alternating):

  mmgrpo      the shared prefix (each prompt and image once per group) and the lean decode step
  mmgrpo-hf   mmgrpo with --shared_prefix false: HF generate for the rollout, prompts repeated G
              times in the log-prob forwards
  trl         TRL's GRPOTrainer with the same settings (the vision tower frozen on the model it is given)

Per system: seconds per step by phase (rollout, reward, reference, training, other), rollout tokens/s
(completion tokens / rollout seconds), training tokens/s (prompt + completion tokens of the G rows /
the log-prob and update seconds), tokens/s of the whole step (EasyR1's per-GPU throughput figure),
MFU (benchmarks/vs_trl.py's analytic model FLOPs over the step, against the bf16 matmul peak measured
here on an 8192^3 product) and the peak GPU memory (max allocated), with `mmgrpo estimate`'s
prediction beside mmgrpo's. --with_7b adds Qwen2.5-VL-7B with LoRA (mmgrpo only) if time is left.

media (item 2: media preparation off the critical path). benchmarks/media_prep.py's runs on the same
model and training settings: 4 images of 1280 x 720 a prompt (about 4,800 prompt tokens) with
Qwen2.5-VL's published pixel budget, G=8, 16 completion tokens (a short step: the share of media is
largest), one warm-up and one timed step each: mmgrpo with 2 DataLoader workers, TRL, mmgrpo
preparing in-process. The 8-frame clips too where PyAV is installed (carry its wheel, below).

eval (item 3: evaluation at generation speed). benchmarks/eval_speed.py in bf16 on the GPU: 16
shapes-color samples, 32 new tokens, greedy and pass@4, a batch-1 HF generate loop against
`mmgrpo eval` (vLLM's column needs vLLM, which the GPU machine has not).

Everything goes to OUT/gpu_suite.json (eval's rows also to OUT/eval_speed.json), the tables to stdout.

The GPU machine (Python 3.12, torch 2.11, transformers 5.17, peft, accelerate, pandas, pyarrow; no
trl, datasets, av or network) needs these wheels (15 MB; at most 64 MiB travel with the tree), fetched
here once into .whl/ (ignored by git, carried by the device tool):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \\
        transformers==5.23.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19

(datasets 5.2 wants pyarrow >= 24: if the first line below prints an older one, add pyarrow==24.0.0,
42 MB; otherwise av==19.0.2, 35 MB, adds the clips to the media part). The command, run with carry
[".whl"] and timeout_s 600:

    python3 -c "import pyarrow, torch; print(pyarrow.__version__, torch.__version__)"; \\
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 || exit; \\
    python3 benchmarks/gpu_suite.py --out $OUT 2>&1 | tee $OUT/log.txt

Set-up (wheels, building the 7.5 GB random checkpoint on the GPU, the matmul peak) takes about a
minute; each process loads the model (about 20 s) and runs its steps.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402  (the workers, model and data preparation, model FLOPs)

GPU = dict(
    model="random:qwen2.5-vl-3b", image_size=448, num_generations=8, prompts_per_step=1, max_completion_length=512,
    warmup=1, steps=1, device="cuda", bf16=True, gradient_checkpointing=True, freeze_vit=True, beta=0.0, lora=False,
    rounds=2,  # mmgrpo, TRL, mmgrpo-hf, then again while the budget lasts
)
# The same code on the CPU: the 3B width at one decoder layer and vision blocks [window, full], tiny
# batches, fp32; LoRA, since full training at this width holds 7 GB of fp32 AdamW state.
DRY_RUN = dict(
    GPU, model="random:qwen2.5-vl-3b?num_hidden_layers=1&vision_depth=2", image_size=112, num_generations=2,
    max_completion_length=8, warmup=0, device="cpu", bf16=False, lora=True, rounds=1,
)
SEVEN_B = dict(model="random:qwen2.5-vl-7b", lora=True, freeze_vit=False)
# Issue 48's other two items at the same size. Media: benchmarks/media_prep.py's real-size media (4 images
# of 1280 x 720 a prompt, Qwen2.5-VL's published pixel budget, G=8, 16 completion tokens: the short
# step that makes the share of media the largest), the training settings of the step part; the clips
# only where PyAV is installed (not on the GPU machine unless its wheel is carried). Eval:
# benchmarks/eval_speed.py (a batch-1 HF generate loop against `mmgrpo eval`, greedy and pass@4).
MEDIA_TRAINING = ("device", "bf16", "gradient_checkpointing", "freeze_vit", "beta", "lora")
# (the dry run: mmgrpo's workers alone; TRL's media clock runs in benchmarks/media_prep.py's smoke test)
MEDIA_RUNS = {"gpu": ("mmgrpo, 2 workers", "TRL 1.16", "mmgrpo, in-process"), "dry": ("mmgrpo, 2 workers",)}
EVAL = {"gpu": ["--limit", "16", "--num_samples", "1,4", "--max_new_tokens", "32", "--torch_dtype", "bfloat16"],
        "dry": ["--limit", "2", "--num_samples", "1", "--max_new_tokens", "4", "--torch_dtype", "float32"]}
# The parts in order, each with its share of --budget_s (the step comparison first: it matters most).
PARTS = {"step": 0.6, "media": 0.25, "eval": 0.15}
SYSTEMS = (("mmgrpo", "mmgrpo", {}), ("trl", "trl", {}), ("mmgrpo-hf", "mmgrpo", {"shared_prefix": False}))


def matmul_peak(device: str) -> float:
    """FLOP/s of the best of 5 bf16 8192^3 products on the GPU (fp32 1024^3 on one CPU thread)."""
    import torch

    if device == "cpu":
        return vs_trl.matmul_flops_per_s()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(8):
        torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del a, b
    torch.cuda.empty_cache()  # the workers are other processes: leave them the memory
    return 2 * 8192**3 / best


def figures(result: dict, spec: dict, peak: float) -> dict:
    """The per-system figures of the module docstring from a worker's result."""
    rows = spec["prompts_per_step"] * spec["num_generations"]
    completion = rows * spec["max_completion_length"]
    tokens = rows * (spec["prompt_tokens"] + spec["max_completion_length"])
    phases = result["phases"]
    return {
        "s_per_step": result["s_per_step"], "cpu_s_per_step": result["cpu_s_per_step"], "phases": phases,
        "rollout_tokens_per_s": completion / max(phases["rollout"], 1e-9),
        "training_tokens_per_s": tokens / max(phases["reference"] + phases["training"], 1e-9),
        "tokens_per_s": tokens / result["s_per_step"],
        "mfu": vs_trl.model_flops(spec) / result["s_per_step"] / peak,
        "peak_memory_gb": result["peak_rss_mb"] * 2**20 / 1e9,
    }  # fmt: skip


def predicted_gb(spec: dict, device_gb: float) -> float:
    """`mmgrpo estimate`'s peak for the mmgrpo run of `spec` (tensor bytes, as max allocated counts)."""
    from mmgrpo.config import TrainConfig
    from mmgrpo.estimate import EstimateOptions, estimate

    cfg = TrainConfig.from_args(vs_trl.mmgrpo_flags({**spec, "out": "unused"}, spec["warmup"] + spec["steps"]))
    side = -(-spec["image_size"] // 28) * 28
    image_tokens = side * side // 28**2
    options = EstimateOptions(image_pixels=side * side, prompt_text_tokens=round(spec["prompt_tokens"]) - image_tokens,
                              device_memory_gb=device_gb)  # fmt: skip
    return estimate(cfg, options).peak_bytes / 1e9


def step_part(settings: dict, work: Path, end_s: float, with_7b: bool, started: float) -> dict:
    """Item 1: the three systems in turn (module docstring) until `end_s` seconds after `started`."""
    import torch

    device = settings["device"]
    peak = matmul_peak(device)
    device_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if device == "cuda" else 24.0
    print(f"matmul peak {peak / 1e9:.0f} GFLOP/s ({'bf16 8192^3' if device == 'cuda' else 'fp32, 1 thread'})", flush=True)
    spec = base_spec(settings, work)
    print(f"set-up done at {time.perf_counter() - started:.0f} s: prompt {spec['prompt_tokens']:.0f} tokens, "
          f"{spec['shape']['n_total'] / 1e9:.2f}B parameters", flush=True)
    results: dict[str, list[dict]] = {name: [] for name, _, _ in SYSTEMS}
    failures: dict[str, str] = {}
    durations: dict[str, float] = {}
    index = 0
    while True:  # the systems in turn, as long as the next run fits the budget
        ran = False
        for name, kind, options in SYSTEMS:
            if name in failures:
                continue
            expected = durations.get(name, 60.0 if device == "cuda" else 20.0)
            if time.perf_counter() - started + expected > end_s:
                continue
            outcome = run_one(kind, {**spec, **options}, work, f"{name}-{index}")
            durations[name] = outcome.pop("run_s", expected)
            if "error" in outcome:
                failures[name] = outcome["error"]
                print(f"  {name}: failed ({outcome['error'].splitlines()[0]})", flush=True)
                continue
            results[name].append(figures(outcome, {**spec, **options}, peak))
            ran = True
            print(f"  {name} run {index + 1}: {outcome['s_per_step']:.2f} s/step, peak {results[name][-1]['peak_memory_gb']:.1f} GB",
                  flush=True)  # fmt: skip
        index += 1
        if not ran or index >= settings["rounds"]:
            break
    report = {"matmul_peak_flops": peak, "spec": spec, "results": results, "failures": failures}
    if results["mmgrpo"]:
        report["estimate_gb"] = predicted_gb(spec, device_gb)
    if with_7b:
        spec_7b = base_spec({**settings, **SEVEN_B}, work)
        if time.perf_counter() - started + 2 * durations.get("mmgrpo", 60.0) < end_s:
            outcome = run_one("mmgrpo", spec_7b, work, "mmgrpo-7b")
            if "error" not in outcome:
                report["qwen2.5-vl-7b-lora"] = figures(outcome, spec_7b, peak)
                report["qwen2.5-vl-7b-lora"]["estimate_gb"] = predicted_gb(spec_7b, device_gb)
        else:
            report["qwen2.5-vl-7b-lora"] = "skipped: not enough of the budget left"
    return report


def media_part(settings: dict, work: Path, end_s: float, started: float, kind: str) -> dict:
    """Item 2: benchmarks/media_prep.py's runs on this model and device until `end_s` seconds after `started`."""
    import importlib.util

    import media_prep

    wanted = MEDIA_RUNS[kind]
    runs = sorted((run for run in media_prep.RUNS if run[0] in wanted and run[3] == "images"), key=lambda run: wanted.index(run[0]))
    if kind == "gpu" and importlib.util.find_spec("av") is not None:  # PyAV writes and reads the clips
        runs += [run for run in media_prep.RUNS if run[3] == "video"]
    media = dict(media_prep.SETTINGS["smoke" if kind == "dry" else "full"], steps=1)  # after one warm-up step on the GPU
    flags = media_prep.media_flags(argparse.Namespace(video_nframes=None, max_pixels=None, min_pixels=None), media)
    try:
        results, prep, spec = media_prep.measure(work / "media", media, flags, runs, model=settings["model"],
                                                 training={key: settings[key] for key in MEDIA_TRAINING},
                                                 deadline=started + end_s)  # fmt: skip
    except SystemExit as exc:  # a run that failed: its log's tail
        print(f"  media: failed ({str(exc).splitlines()[0]})", flush=True)
        return {"error": str(exc)}
    media_prep.report(results, prep, media, spec)
    return {"settings": media, "prep": prep,
            "runs": [{"label": label, "system": system, "workers": workers, "rows": rows, **result}
                     for (label, system, workers, rows), result in results.items()]}  # fmt: skip


def eval_part(settings: dict, out: Path, end_s: float, started: float, kind: str) -> dict:
    """Item 3: benchmarks/eval_speed.py on this model and device, in its own process, stopped at `end_s`."""
    left = end_s - (time.perf_counter() - started)
    if left < (20 if kind == "dry" else 60):
        print("  eval: not started, the time budget would be passed", flush=True)
        return {"skipped": "not enough of the budget left"}
    result = out / "eval_speed.json"
    command = [sys.executable, str(Path(__file__).parent / "eval_speed.py"), "--model", settings["model"],
               "--device", settings["device"], "--json", str(result), *EVAL[kind]]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        print(f"  eval: stopped at the budget ({left:.0f} s)", flush=True)
        return {"error": f"stopped at the budget ({left:.0f} s)"}
    print("\n" + "\n".join(line for line in done.stdout.splitlines() if "samples/s" in line or line.startswith(("|", "random:"))),
          flush=True)  # fmt: skip
    if done.returncode or not result.exists():
        print(f"  eval: failed (exit {done.returncode})", flush=True)
        return {"error": (done.stdout + done.stderr)[-3000:]}
    return json.loads(result.read_text())


def base_spec(settings: dict, work: Path) -> dict:
    """vs_trl's worker spec for these settings: the model built, the data written, shapes and prompt length."""
    model, model_type = vs_trl.prepare_model(work, settings)
    data = vs_trl.prepare_data(work, settings["image_size"], 16)
    side = -(-settings["image_size"] // 28) * 28
    return {
        **{key: settings.get(key, default) for key, default in vs_trl.RUN_DEFAULTS.items()}, "model": str(model), "model_type": model_type,
        "data": str(data), "num_generations": settings["num_generations"], "prompts_per_step": settings["prompts_per_step"],
        "max_completion_length": settings["max_completion_length"], "warmup": settings["warmup"], "steps": settings["steps"],
        "suppress_ids": vs_trl.suppressed_ids(model, model_type), "patches_per_image": (side // 14) ** 2, "use_vllm": False,
        "shape": vs_trl.model_shape(str(model)), "prompt_tokens": vs_trl.mean_prompt_tokens(model, model_type, data),
        "count_flops": False, "image_size": settings["image_size"],
    }  # fmt: skip


def run_one(kind: str, spec: dict, work: Path, index: str) -> dict:
    """One worker process (vs_trl.run_worker); its error as text instead of an exit."""
    try:
        return vs_trl.run_worker(kind, spec, work, index)
    except SystemExit as exc:
        return {"error": str(exc)}


def print_table(report: dict) -> None:
    names = [name for name, runs in report["results"].items() if runs]
    if not names:
        print("step: no system ran")
        return

    def median(name, key, phase=None):
        runs = report["results"][name]
        return statistics.median(r["phases"][phase] if phase else r[key] for r in runs)

    print(f"\n{report['device']}; {len(report['results']['mmgrpo'])} mmgrpo run(s)")
    print(f"{'':<24}" + "".join(f"{name:>12}" for name in names))
    lines = [("s/step", "s_per_step", None, "{:.2f}")]
    lines += [(f"  {phase}", None, phase, "{:.2f}") for phase in vs_trl.PHASES]
    lines += [("rollout tokens/s", "rollout_tokens_per_s", None, "{:.0f}"),
              ("training tokens/s", "training_tokens_per_s", None, "{:.0f}"),
              ("step tokens/s", "tokens_per_s", None, "{:.0f}"), ("MFU", "mfu", None, "{:.1%}"),
              ("peak memory (GB)", "peak_memory_gb", None, "{:.1f}")]  # fmt: skip
    for label, key, phase, fmt in lines:
        print(f"{label:<24}" + "".join(f"{fmt.format(median(name, key, phase)):>12}" for name in names))
    if "estimate_gb" in report:
        print(f"mmgrpo estimate: {report['estimate_gb']:.1f} GB predicted, {median('mmgrpo', 'peak_memory_gb'):.1f} GB measured")
    for name in names[1:]:
        print(f"mmgrpo/{name} step time: {median('mmgrpo', 's_per_step') / median(name, 's_per_step'):.2f}")
    for name, error in report["failures"].items():
        print(f"{name} failed: {error.splitlines()[0]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_suite.json")
    parser.add_argument("--dry_run_on_cpu", action="store_true", help="the same code on the CPU at reduced depth (a test)")
    parser.add_argument("--budget_s", type=float, default=560.0,
                        help="start no run that would end after this many seconds (default 560), shared by the parts")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which, comma-separated (default {','.join(PARTS)})")
    parser.add_argument("--with_7b", action="store_true", help="then Qwen2.5-VL-7B with LoRA (mmgrpo), if time is left")
    parser.add_argument("--work_dir", default=None, help="model copies, data, logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts {args.parts!r}: give some of {', '.join(PARTS)}, comma-separated")
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if not args.dry_run_on_cpu and not torch.cuda.is_available():
        raise SystemExit("no GPU here: run with --dry_run_on_cpu, or on a GPU machine (see the module docstring)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mmgrpo-gpu-suite-"))
    if not args.work_dir:
        atexit.register(shutil.rmtree, work, ignore_errors=True)  # model copies: GBs on a GPU machine
    kind = "dry" if args.dry_run_on_cpu else "gpu"
    settings = DRY_RUN if args.dry_run_on_cpu else GPU
    device = torch.cuda.get_device_name() if kind == "gpu" else "CPU (dry run)"
    print(f"{device}: {', '.join(parts)} in {args.budget_s:.0f} s", flush=True)
    report = {"device": device, "settings": settings, "parts": parts}
    ends = part_ends(parts, args.budget_s)
    if "step" in parts:
        report.update(step_part(settings, work, ends["step"], args.with_7b, started))
        print_table(report)
    if "media" in parts:
        print(f"\nmedia preparation at real sizes, from {time.perf_counter() - started:.0f} s", flush=True)
        report["media"] = media_part(settings, work, ends["media"], started, kind)
    if "eval" in parts:
        print(f"\nevaluation speed, from {time.perf_counter() - started:.0f} s", flush=True)
        report["eval"] = eval_part(settings, out, ends["eval"], started, kind)
    report["total_s"] = time.perf_counter() - started
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\ntotal {report['total_s']:.0f} s; {out / 'gpu_suite.json'}")


def part_ends(parts: list[str], budget_s: float) -> dict[str, float]:
    """Seconds from the start by which each part is to end: the budget cut in the parts' shares.

    >>> part_ends(["step", "media", "eval"], 100)
    {'step': 60.0, 'media': 85.0, 'eval': 100.0}
    >>> part_ends(["media", "eval"], 100)
    {'media': 62.5, 'eval': 100.0}
    """
    total, ends, so_far = sum(PARTS[part] for part in parts), {}, 0.0
    for part in PARTS:
        if part in parts:
            so_far += PARTS[part]
            ends[part] = round(budget_s * so_far / total, 6)
    return ends


if __name__ == "__main__":
    main()
