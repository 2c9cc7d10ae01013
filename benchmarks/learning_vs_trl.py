"""Time to accuracy: mmgrpo and TRL's GRPOTrainer train the same SFT checkpoint, side by side.

    python benchmarks/learning_vs_trl.py                        # colour and count, 3 seeds (about 80 minutes on 2 cores)
    python benchmarks/learning_vs_trl.py --tasks shapes-color --seeds 0 --steps 10 --eval_limit 40   # a smoke run
    python benchmarks/learning_vs_trl.py --sft_model mmgrpo/demo/start --work_dir /tmp/lvt

Results and how to read them: docs/benchmarks.md, "Time to accuracy against TRL".

1. One SFT checkpoint per task (`mmgrpo sft` with configs/learning_vs_trl_sft.yaml for colour and
   configs/learning_vs_trl_count_sft.yaml for count, or --sft_config, or --sft_model): the start of every
   run of the task, so both systems begin from the same weights and the same held-out accuracy.
2. For each task, seed and system (alternating mmgrpo, TRL, mmgrpo, ...; each run a fresh
   subprocess with one torch thread): GRPO for --steps steps with the same rewards (the registry's
   `answer_format` + `vqa_accuracy`, TRL calls them through a wrapper), G, prompts per step (one
   optimizer update per rollout batch), learning rate (constant), AdamW (0.9, 0.99, fused), beta
   (k3 KL to the reference), loss (dapo), clipping (0.2 / 0.28), group-scaled advantages,
   temperature 1, completion cap, the same prompt token ids (system turn, image first, checked),
   the same suppressed placeholder tokens, and data loading in the training process. A checkpoint
   is saved every --save_every steps; the training seconds at each (wall clock since the first
   step began, the seconds spent saving removed) and the CPU seconds are recorded: mmgrpo's from
   the per-step metrics it logs (time/step, time/save, cpu/step_s; the milliseconds between two
   steps spent writing the log line are not counted), TRL's by a clock around its trainer.
3. Every checkpoint of both systems is evaluated afterwards by the same code (`mmgrpo eval`'s:
   greedy, --eval_limit held-out test samples), so evaluation time never counts as training.
4. Per task, the medians over seeds of: the training seconds to reach --target (linear between
   the two checkpoints around the first crossing), the accuracy each system has when the faster
   one finishes its run (equal time), and the mean accuracy over the common step checkpoints
   (learning per step: the same algorithm should learn the same per sample). A PNG per task
   draws accuracy against training seconds and against steps for both.
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
from vs_trl import peak_rss_mb, trl_reward  # noqa: E402  (the speed benchmark's helpers)

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("mmgrpo", "trl")
REWARDS = ("answer_format", "vqa_accuracy")
TARGETS = {"shapes-color": 0.80, "shapes-count": 0.45}  # held-out accuracy to reach (--target overrides)
# The SFT start of each task when neither --sft_model nor --sft_config is given: one from which GRPO
# can lift the task (docs/benchmarks.md, "Time to accuracy against TRL").
SFT_STARTS = {"shapes-color": ["learning_vs_trl_sft.yaml"], "shapes-count": ["learning_vs_trl_count_sft.yaml"]}
METRIC = "vqa_accuracy"


# ---------------------------------------------------------------------------------------------
# Shared inputs
# ---------------------------------------------------------------------------------------------


def sft_configs(args, task: str) -> list[str]:
    """The SFT stages of a task's start: --sft_config, else the task's SFT_STARTS entry.

    >>> from argparse import Namespace
    >>> [Path(c).name for c in sft_configs(Namespace(sft_config=None), "shapes-count")]
    ['learning_vs_trl_count_sft.yaml']
    >>> sft_configs(Namespace(sft_config=["a.yaml", "b.yaml"]), "shapes-count")
    ['a.yaml', 'b.yaml']
    """
    if args.sft_config:
        return args.sft_config
    if task not in SFT_STARTS:
        raise SystemExit(f"{task}: no default SFT start; give --sft_model or --sft_config")
    return [str(ROOT / "configs" / name) for name in SFT_STARTS[task]]


def prepare_sft(work: Path, args, task: str) -> Path:
    """The SFT checkpoint every run of a task starts from: --sft_model, or `mmgrpo sft` with each
    of the task's configs in turn (`sft_configs`), each stage from the model the one before wrote.
    A stage already in --work_dir (the same configs, in the same order) is reused."""
    if args.sft_model:  # a folder, or a tiny:/random: spec built into one (TRL loads folders)
        from mmgrpo.models.tiny import resolve_model_path

        return Path(resolve_model_path(args.sft_model))
    final, chain = None, []
    for config in sft_configs(args, task):
        chain.append(Path(config).stem)
        folder = work / ("sft-" + "+".join(chain))
        if not (folder / "final" / "config.json").exists():
            command = [sys.executable, "-m", "mmgrpo", "sft", "--config", config, "--output_dir", str(folder),
                       "--seed", "0", "--torch_threads", "1", "--overwrite_output_dir"]
            command += ["--model", str(final)] if final is not None else []
            print("SFT start: " + " ".join(command[2:]), flush=True)
            subprocess.run(command, check=True, env=worker_env(), stdout=subprocess.DEVNULL)
        final = folder / "final"
    return final


def trl_rows(task: str) -> list[dict]:
    """The task's training split as TRL rows: the same chat messages mmgrpo renders (the registry's
    system turn included), text without the <image> tag (TRL puts the image first, as mmgrpo's
    `<image>Question` does), the image path and the reward columns."""
    from mmgrpo.data.catalog import resolve_dataset

    dataset = resolve_dataset(task, "train")
    rows = []
    for sample in dataset:
        messages = [{"role": m["role"], "content": m["content"].replace("<image>", "")}
                    for m in sample.messages if m["role"] != "assistant"]
        rows.append({"prompt": messages, "image": str(Path(sample.media_root) / sample.images[0]),
                     "solution": sample.columns["solution"]})
    return rows


def placeholder_ids(model: Path) -> list[int]:
    """Image/video placeholder ids, never sampled in mmgrpo; TRL gets them as suppress_tokens."""
    from mmgrpo.models.loading import load_processor
    from mmgrpo.templates import get_template

    return sorted(get_template("qwen2-vl", load_processor(str(model))).suppress_token_ids)


def worker_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


# ---------------------------------------------------------------------------------------------
# TRL's training clock (mmgrpo's comes from its metrics.jsonl)
# ---------------------------------------------------------------------------------------------


class TrainingClock:
    """Training seconds at each step end: wall (and CPU) time since the first step began, minus
    the seconds spent saving checkpoints, which are not training."""

    def __init__(self):
        self.start_wall = self.start_cpu = 0.0
        self.save_wall = self.save_cpu = 0.0
        self.points: list[dict] = []

    def start(self) -> None:
        self.start_wall, self.start_cpu = time.perf_counter(), time.process_time()

    def step_end(self, step: int, **facts) -> None:
        self.points.append({
            "step": step,
            "train_s": time.perf_counter() - self.start_wall - self.save_wall,
            "train_cpu_s": time.process_time() - self.start_cpu - self.save_cpu,
            **facts,
        })

    def timed_save(self, save):
        def wrapper(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return save(*args, **kwargs)
            finally:
                self.save_wall += time.perf_counter() - wall
                self.save_cpu += time.process_time() - cpu
        return wrapper


def common_settings(spec: dict) -> dict:
    return {"batch": spec["prompts_per_step"] * spec["num_generations"]}


# ---------------------------------------------------------------------------------------------
# Worker: mmgrpo
# ---------------------------------------------------------------------------------------------


def run_mmgrpo(spec: dict) -> dict:
    """`mmgrpo train` as a user runs it; its clock is read from the per-step metrics it logs
    (time/step, time/save and cpu/step_s of each line of metrics.jsonl)."""
    import torch

    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    torch.set_num_threads(1)
    cfg = TrainConfig.from_args([
        "--model", spec["model"], "--model_type", "qwen2-vl", "--dataset", spec["task"],
        "--reward_funcs", *REWARDS, "--num_generations", str(spec["num_generations"]),
        "--max_completion_length", str(spec["max_completion_length"]), "--temperature", "1.0",
        "--per_device_train_batch_size", str(common_settings(spec)["batch"]), "--gradient_accumulation_steps", "1",
        "--learning_rate", str(spec["learning_rate"]), "--lr_scheduler_type", "constant", "--warmup_ratio", "0",
        "--optim", "adamw_torch_fused", "--adam_beta1", "0.9", "--adam_beta2", "0.99", "--weight_decay", "0",
        "--max_grad_norm", "1.0", "--beta", str(spec["beta"]), "--loss_type", spec["loss_type"],
        "--epsilon", "0.2", "--epsilon_high", "0.28", "--scale_rewards", "group",
        "--max_steps", str(spec["steps"]), "--save_steps", str(spec["save_every"]),
        "--output_dir", spec["out"], "--dataloader_num_workers", "0", "--torch_threads", "1",
        "--log_completions", "0", "--report_to", "none", "--seed", str(spec["seed"]),
    ])
    out = train(cfg)
    points, train_s, train_cpu_s = [], 0.0, 0.0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        metrics = json.loads(line)
        # a step's seconds from its start to its end, the seconds spent saving removed (as TRL's clock,
        # which starts when trainer.train() begins: models loaded)
        train_s += metrics["time/step"] - metrics["time/save"]
        train_cpu_s += metrics["cpu/step_s"] - metrics["time/save"]  # a save is mostly the main thread's writing
        points.append({"step": metrics["step"], "train_s": train_s, "train_cpu_s": train_cpu_s,
                       "reward": metrics["reward"], "frac_reward_zero_std": metrics["frac_reward_zero_std"],
                       "completion_length": metrics["completion_length"]})
    checkpoints = {int(p.name.split("-")[1]): str(p) for p in out.glob("checkpoint-*")}
    return {"points": points, "checkpoints": checkpoints, "peak_rss_mb": peak_rss_mb()}


# ---------------------------------------------------------------------------------------------
# Worker: TRL
# ---------------------------------------------------------------------------------------------


def run_trl(spec: dict) -> dict:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmgrpo.rewards import get_reward

    torch.set_num_threads(1)
    dataset = datasets.Dataset.from_list(trl_rows(spec["task"])).cast_column("image", datasets.Image())
    args = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, fp16=False, seed=spec["seed"], data_seed=spec["seed"],
        per_device_train_batch_size=common_settings(spec)["batch"], gradient_accumulation_steps=1,
        num_generations=spec["num_generations"], max_completion_length=spec["max_completion_length"],
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
        beta=spec["beta"], loss_type=spec["loss_type"], epsilon=0.2, epsilon_high=0.28, scale_rewards="group",
        temperature=1.0, top_p=1.0, top_k=0,
        gradient_checkpointing=False,  # TRL's default is True (about 20% slower); mmgrpo's is off
        max_steps=spec["steps"], save_strategy="steps", save_steps=spec["save_every"], save_only_model=True,
        logging_steps=1, report_to="none", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        generation_kwargs={"suppress_tokens": spec["suppress_ids"]},
        model_init_kwargs={"dtype": "float32"},
    )
    trainer = GRPOTrainer(
        model=spec["model"], reward_funcs=[trl_reward(get_reward(name)) for name in REWARDS], args=args,
        train_dataset=dataset,
    )
    clock = TrainingClock()
    trainer._save_checkpoint = clock.timed_save(trainer._save_checkpoint)
    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):  # after on_step_end, with the step's figures
            logs = logs or {}
            if clock.points and "reward" in logs:
                clock.points[-1].update(reward=float(logs["reward"]), frac_reward_zero_std=float(logs["frac_reward_zero_std"]),
                                        completion_length=float(logs["completions/mean_length"]))

    trainer.add_callback(Clock())
    clock.start()
    trainer.train()
    checkpoints = {int(p.name.split("-")[1]): str(p) for p in Path(spec["out"]).glob("checkpoint-*")}
    for path in checkpoints.values():  # TRL saves the processor's tokenizer; keep the SFT folder's files too
        for name in os.listdir(spec["model"]):
            if not (Path(path) / name).exists() and name.endswith((".json", ".jinja", ".txt")):
                shutil.copy(Path(spec["model"]) / name, Path(path) / name)
    return {"points": clock.points, "checkpoints": checkpoints, "peak_rss_mb": peak_rss_mb()}


# ---------------------------------------------------------------------------------------------
# Prompt equality, evaluation, summary
# ---------------------------------------------------------------------------------------------


def check_same_prompts(model: Path, task: str) -> int:
    """The prompt token ids of both systems for a task's first row, asserted equal; returns the length."""
    from transformers import AutoProcessor
    from trl.data_utils import prepare_multimodal_messages

    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.models.loading import load_processor
    from mmgrpo.templates import get_template

    sample = resolve_dataset(task, "train")[0]
    ours = get_template("qwen2-vl", load_processor(str(model))).encode_prompt(sample.load_media()).prompt_ids
    ours = ours.reshape(-1).tolist()
    row = trl_rows(task)[0]
    import PIL.Image

    image = PIL.Image.open(row["image"]).convert("RGB")
    processor = AutoProcessor.from_pretrained(model)
    messages = prepare_multimodal_messages(row["prompt"], images=[image])
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    theirs = processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    if ours != theirs:
        raise SystemExit(f"{task}: the two systems' prompts differ:\n  mmgrpo {ours}\n  TRL    {theirs}")
    return len(ours)


def evaluate_checkpoints(paths: dict[int, str], task: str, limit: int, cache: dict, out: Path) -> dict[int, float]:
    """Held-out accuracy of each checkpoint (greedy, the first `limit` test samples); the eval
    files go under `out`, one folder per evaluation."""
    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.eval.evaluate import evaluate, load_for_eval

    dataset = resolve_dataset(task, "test")
    scores = {}
    for step, path in sorted(paths.items()):
        if (path, task) not in cache:
            engine, template = load_for_eval(path, "qwen2-vl")
            folder = out / f"eval-{len(cache):04d}"
            shutil.rmtree(folder, ignore_errors=True)
            result = evaluate(engine, template, dataset, folder, metrics=[METRIC], model_name=path,
                              max_new_tokens=40, limit=limit, show_progress=False)
            cache[path, task] = result["metrics"][METRIC]
        scores[step] = cache[path, task]
    return scores


def curve(result: dict, scores: dict[int, float], start_accuracy: float) -> list[dict]:
    """(step, training seconds, accuracy) at step 0 (the SFT start) and at each checkpoint."""
    by_step = {p["step"]: p for p in result["points"]}
    points = [{"step": 0, "train_s": 0.0, "train_cpu_s": 0.0, "accuracy": start_accuracy}]
    for step in sorted(scores):
        points.append({"step": step, "train_s": by_step[step]["train_s"], "train_cpu_s": by_step[step]["train_cpu_s"],
                       "accuracy": scores[step]})
    return points


def seconds_to(points: list[dict], target: float, key: str = "train_s") -> float | None:
    """Training seconds at the first crossing of `target`, linear between the checkpoints around it.

    >>> round(seconds_to([{"train_s": 0, "accuracy": 0.4}, {"train_s": 10, "accuracy": 0.6}, {"train_s": 20, "accuracy": 0.9}], 0.8), 3)
    16.667
    >>> seconds_to([{"train_s": 0, "accuracy": 0.4}], 0.8) is None
    True
    """
    for before, after in zip(points, points[1:]):
        if after["accuracy"] >= target > before["accuracy"]:
            share = (target - before["accuracy"]) / (after["accuracy"] - before["accuracy"])
            return before[key] + share * (after[key] - before[key])
    return 0.0 if points and points[0]["accuracy"] >= target else None


def accuracy_at(points: list[dict], seconds: float) -> float:
    """The accuracy of the last checkpoint saved at or before `seconds` of training.

    >>> accuracy_at([{"train_s": 0, "accuracy": 0.4}, {"train_s": 10, "accuracy": 0.6}], 9.9)
    0.4
    """
    return [p["accuracy"] for p in points if p["train_s"] <= seconds + 1e-9][-1]


def summarize(task: str, runs: dict[str, list[list[dict]]], target: float) -> dict:
    """Medians over seeds: seconds to target, accuracy at equal time, mean accuracy per step."""
    out = {"task": task, "target": target, "systems": {}}
    seeds = range(len(runs["mmgrpo"]))
    equal_time = [min(runs[s][i][-1]["train_s"] for s in SYSTEMS) for i in seeds]
    for system in SYSTEMS:
        to_target = [seconds_to(points, target) for points in runs[system]]
        reached = [t for t in to_target if t is not None]
        common_steps = [{p["step"] for p in runs[s][i][1:]} for s in SYSTEMS for i in seeds]
        common = set.intersection(*common_steps)
        per_step = [statistics.mean(p["accuracy"] for p in points if p["step"] in common) for points in runs[system]]
        cpu_to_target = [seconds_to(points, target, key="train_cpu_s") for points in runs[system]]
        cpu_reached = [t for t in cpu_to_target if t is not None]
        out["systems"][system] = {
            "seconds_to_target": to_target,
            "median_seconds_to_target": statistics.median(reached) if len(reached) == len(to_target) else None,
            # CPU seconds of the training process: what the load of a shared machine does not change
            "cpu_seconds_to_target": cpu_to_target,
            "median_cpu_seconds_to_target": statistics.median(cpu_reached) if len(cpu_reached) == len(cpu_to_target) else None,
            "accuracy_at_equal_time": [accuracy_at(points, t) for points, t in zip(runs[system], equal_time)],
            "final_accuracy": [points[-1]["accuracy"] for points in runs[system]],
            "mean_accuracy_over_steps": per_step,
            "seconds_per_step": [points[-1]["train_s"] / points[-1]["step"] for points in runs[system]],
            "cpu_seconds_per_step": [points[-1]["train_cpu_s"] / points[-1]["step"] for points in runs[system]],
        }
    out["equal_time_s"] = equal_time
    return out


def plot(task: str, runs: dict[str, list[list[dict]]], target: float, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    by_seconds, by_step = figure.subplots(1, 2, sharey=True)
    colours = {"mmgrpo": "tab:blue", "trl": "tab:orange"}
    for system in SYSTEMS:
        for index, points in enumerate(runs[system]):
            label = f"{'mmgrpo' if system == 'mmgrpo' else 'TRL'}" if index == 0 else None
            by_seconds.plot([p["train_s"] for p in points], [p["accuracy"] for p in points], marker="o",
                            markersize=3, color=colours[system], alpha=0.8, label=label)
            by_step.plot([p["step"] for p in points], [p["accuracy"] for p in points], marker="o",
                         markersize=3, color=colours[system], alpha=0.8, label=label)
    for axes in (by_seconds, by_step):
        axes.axhline(target, color="grey", linestyle="--", linewidth=1)
        axes.grid(alpha=0.3)
    by_seconds.set_xlabel("training seconds (evaluation and checkpoint saving excluded)")
    by_seconds.set_ylabel(f"held-out {METRIC}")
    by_step.set_xlabel("GRPO step")
    by_seconds.set_title(f"{task}: accuracy against training time")
    by_step.set_title("against steps (one line per seed)")
    by_seconds.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)


def print_summary(summary: dict) -> None:
    m, t = summary["systems"]["mmgrpo"], summary["systems"]["trl"]

    def fmt(values, digits=3):
        return "[" + ", ".join("-" if v is None else f"{v:.{digits}f}" for v in values) + "]"

    print(f"\n{summary['task']} (target {summary['target']:.2f}; per seed, then the median)")
    for label, key, digits in (("seconds to target", "seconds_to_target", 1),
                               ("CPU seconds to target", "cpu_seconds_to_target", 1),
                               ("accuracy at equal time", "accuracy_at_equal_time", 3),
                               ("final accuracy", "final_accuracy", 3),
                               ("mean accuracy over the common steps", "mean_accuracy_over_steps", 3),
                               ("training s/step", "seconds_per_step", 3),
                               ("training CPU s/step", "cpu_seconds_per_step", 3)):
        for name, result in (("mmgrpo", m), ("TRL", t)):
            values = result[key]
            known = [v for v in values if v is not None]
            median = statistics.median(known) if len(known) == len(values) else None
            print(f"  {label:<38}{name:<8}{fmt(values, digits):<28} median {'-' if median is None else f'{median:.{digits}f}'}")
    print(f"  equal time (s, the faster system's run length per seed): {fmt(summary['equal_time_s'], 1)}")
    ms, ts = m["median_seconds_to_target"], t["median_seconds_to_target"]
    if ms and ts:
        print(f"  TRL / mmgrpo seconds to target: {ts / ms:.2f}x (goal >= 3x: {'met' if ts / ms >= 3 else 'NOT met'})")
        pairs = [b / a for a, b in zip(m["seconds_to_target"], t["seconds_to_target"]) if a and b]
        if pairs:
            print(f"  per seed: {fmt(pairs, 2)}")
    else:
        print("  the target was not reached in every run of both systems: no time ratio "
              f"(mmgrpo median {ms}, TRL median {ts})")
    mc, tc = m["median_cpu_seconds_to_target"], t["median_cpu_seconds_to_target"]
    if mc and tc:
        print(f"  TRL / mmgrpo CPU seconds to target: {tc / mc:.2f}x")


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def summarize_work_dir(args) -> None:
    """Summary and plots of the runs whose curves a --work_dir holds (seeds where both systems finished)."""
    if not args.work_dir:
        raise SystemExit("--summarize needs --work_dir (the folder of an earlier run)")
    work, output = Path(args.work_dir), Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    summaries = []
    for task in args.tasks:
        seeds = [seed for seed in args.seeds if all((work / f"curve-{s}-{task}-seed{seed}.json").exists() for s in SYSTEMS)]
        if not seeds:
            print(f"{task}: no seed with both systems' runs in {work}")
            continue
        runs = {s: [json.loads((work / f"curve-{s}-{task}-seed{seed}.json").read_text())["curve"] for seed in seeds]
                for s in SYSTEMS}
        target = args.target if args.target is not None else TARGETS.get(task, 0.8)
        summary = summarize(task, runs, target)
        summary["runs"], summary["seeds"] = runs, seeds
        summaries.append(summary)
        plot(task, runs, target, output / f"{task}.png")
        print_summary(summary)
    (output / "summary.json").write_text(json.dumps({"tasks": summaries}, indent=1))
    print(f"\nplots and summary.json in {output}")


def run_worker(system: str, spec: dict, work: Path) -> dict:
    tag = f"{system}-{spec['task']}-seed{spec['seed']}"
    spec = {**spec, "out": str(work / f"out-{tag}")}
    shutil.rmtree(spec["out"], ignore_errors=True)
    spec_file, result_file, log_file = work / f"spec-{tag}.json", work / f"result-{tag}.json", work / f"log-{tag}.txt"
    spec_file.write_text(json.dumps(spec))
    result_file.unlink(missing_ok=True)
    with open(log_file, "w") as log:
        code = subprocess.call(
            [sys.executable, __file__, "--_worker", system, "--_spec", str(spec_file), "--_result", str(result_file)],
            stdout=log, stderr=subprocess.STDOUT, env=worker_env(),
        )
    if code or not result_file.exists():
        raise SystemExit(f"{tag} failed (exit {code}); log {log_file}:\n{log_file.read_text()[-3000:]}")
    return json.loads(result_file.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="*", default=["shapes-color", "shapes-count"], help="registry datasets")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2], help="one run per system and seed")
    parser.add_argument("--steps", type=int, nargs="*", default=[80, 200],
                        help="GRPO steps per run: one value for every task, or one per task in --tasks order")
    parser.add_argument("--save_every", type=int, nargs="*", default=[5, 10],
                        help="checkpoint (and evaluation) every N steps: one value, or one per task")
    parser.add_argument("--eval_limit", type=int, default=200, help="held-out test samples per evaluation")
    parser.add_argument("--target", type=float, default=None,
                        help=f"accuracy to reach (default per task: {', '.join(f'{k} {v}' for k, v in TARGETS.items())})")
    parser.add_argument("--num_generations", type=int, default=8, help="G")
    parser.add_argument("--prompts_per_step", type=int, default=16, help="prompts per step (one optimizer update)")
    parser.add_argument("--learning_rate", type=float, default=3e-4, help="constant learning rate of both")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient of both")
    parser.add_argument("--loss_type", default="dapo", help="loss of both (dapo, grpo, dr_grpo, bnpo)")
    parser.add_argument("--max_completion_length", type=int, default=40, help="completion cap of both")
    parser.add_argument("--sft_model", default=None, help="start checkpoint of every task (default: SFT with --sft_config)")
    parser.add_argument("--sft_config", nargs="+", default=None,
                        help="SFT configs, run in turn, when no --sft_model; the start of every task (default: per task, "
                        "configs/learning_vs_trl_sft.yaml for colour, configs/learning_vs_trl_count_sft.yaml for count; "
                        "the demo's start is shipped: --sft_model mmgrpo/demo/start)")
    parser.add_argument("--work_dir", default=None, help="checkpoints, logs and results (default: a temporary folder)")
    parser.add_argument("--output_dir", default="runs/learning_vs_trl", help="summary.json and the PNG plots")
    parser.add_argument("--summarize", action="store_true",
                        help="train nothing: summarize and plot the runs already in --work_dir (e.g. an interrupted run)")
    parser.add_argument("--_worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._worker:
        spec = json.loads(Path(args._spec).read_text())
        result = (run_mmgrpo if args._worker == "mmgrpo" else run_trl)(spec)
        Path(args._result).write_text(json.dumps(result))
        return

    from mmgrpo.runstate.runlog import console, progress_bar

    if args.summarize:
        summarize_work_dir(args)
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mmgrpo-learning-vs-trl-"))
    if not args.work_dir:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    models = {task: prepare_sft(work, args, task) for task in args.tasks}
    def per_task(values: list[int], flag: str) -> dict[str, int]:
        if len(values) not in (1, len(args.tasks)):
            raise SystemExit(f"--{flag}: give one value or one per task ({len(args.tasks)})")
        return dict(zip(args.tasks, values * len(args.tasks) if len(values) == 1 else values))

    steps, save_every = per_task(args.steps, "steps"), per_task(args.save_every, "save_every")
    base = {"num_generations": args.num_generations, "prompts_per_step": args.prompts_per_step,
            "learning_rate": args.learning_rate, "beta": args.beta, "loss_type": args.loss_type,
            "max_completion_length": args.max_completion_length}
    summaries, cache = [], {}
    runs_total = len(args.tasks) * len(args.seeds) * len(SYSTEMS)
    with progress_bar(runs_total, "runs (train, then evaluate every checkpoint)") as bar:
        for task in args.tasks:
            model = models[task]
            suppress_ids = placeholder_ids(model)
            length = check_same_prompts(model, task)
            start_accuracy = evaluate_checkpoints({0: str(model)}, task, args.eval_limit, cache, work)[0]
            target = args.target if args.target is not None else TARGETS.get(task, 0.8)
            console.print(f"{task}: prompts equal in both systems ({length} tokens); SFT start {start_accuracy:.3f}, "
                          f"target {target:.2f}")
            runs: dict[str, list[list[dict]]] = {s: [] for s in SYSTEMS}
            for seed in args.seeds:
                for system in SYSTEMS:
                    spec = {**base, "model": str(model), "suppress_ids": suppress_ids, "task": task, "seed": seed,
                            "steps": steps[task], "save_every": save_every[task]}
                    result = run_worker(system, spec, work)
                    scores = evaluate_checkpoints({int(k): v for k, v in result["checkpoints"].items()}, task,
                                                  args.eval_limit, cache, work)
                    points = curve(result, scores, start_accuracy)
                    runs[system].append(points)
                    (work / f"curve-{system}-{task}-seed{seed}.json").write_text(json.dumps({**result, "curve": points}))
                    accuracies = " ".join(f"{p['accuracy']:.2f}" for p in points)
                    console.print(f"  seed {seed} {system:<6} {points[-1]['train_s'] / steps[task]:.3f} s/step, "
                                  f"accuracy {accuracies}")
                    bar.advance({"reward": points[-1]["accuracy"], "time/step": points[-1]["train_s"] / steps[task]})
            summary = summarize(task, runs, target)
            summary["runs"] = runs
            summaries.append(summary)
            plot(task, runs, target, output / f"{task}.png")
    for summary in summaries:
        print_summary(summary)
    settings = {**base, "models": {task: str(path) for task, path in models.items()}, "seeds": args.seeds,
                "steps": steps, "save_every": save_every}
    (output / "summary.json").write_text(json.dumps({"settings": settings, "tasks": summaries},
                                                    indent=1))
    print(f"\nplots and summary.json in {output}; total {time.perf_counter() - started:.0f} s")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
