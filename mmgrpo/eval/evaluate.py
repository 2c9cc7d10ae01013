"""`mmgrpo eval` and `mmgrpo compare`: run a model over a dataset split and score it.

    mmgrpo eval --model runs/x/checkpoint-50 --model_type qwen2-vl --dataset shapes-color:test \\
        --metrics vqa_accuracy --output_dir runs/x/eval
    mmgrpo compare runs/sft/eval runs/grpo/eval --output runs/compare.json

Generation is batched through the same policy and template as training (greedy by default;
`--num_samples k --temperature t` for pass@k / mean@k). Per-sample results are flushed as
they come, so an interrupted eval resumes with `--resume`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from mmgrpo.runstate.runlog import console, progress_bar

# torch, the rollout engines and the metrics load inside the functions: `mmgrpo eval --help` answers at once

PROBE_FILE = "fusion_probe.json"  # --fusion_probe's means, beside eval.json


class EngineGenerator:
    """generate_fn for `run_eval`: a batch of Samples -> k completions each (+ box mappers), through
    a rollout engine (mmgrpo/rollout/)."""

    def __init__(self, engine, template, *, max_new_tokens: int, temperature: float = 1.0, media_kwargs=None, bar=None,
                 fusion_probe: bool = False):
        self.engine, self.template = engine, template
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.media_kwargs = media_kwargs or {}
        self.bar = bar
        # --fusion_probe: modality reliance on each sample's first completion (mmgrpo/eval/reliance.py)
        self.probe_sums: dict[str, float] | None = {} if fusion_probe else None
        self.probe_counts: dict[str, int] = {}

    def __call__(self, samples: list, num_samples: int):
        import torch

        with torch.no_grad():
            return self._generate(samples, num_samples)

    def _generate(self, samples: list, num_samples: int):
        from mmgrpo.rollout.base import SamplingParams

        started = time.perf_counter()
        encoded = [self.template.encode_prompt(sample.load_media(**self.media_kwargs)) for sample in samples]
        params = SamplingParams(
            num_generations=num_samples, max_new_tokens=self.max_new_tokens,
            temperature=self.temperature, greedy=num_samples == 1,
        )
        rollout = self.engine.generate(encoded, params)
        if self.probe_sums is not None:
            self._probe(encoded, rollout, num_samples)
        texts = self.template.decode(rollout.completion_ids, rollout.completion_mask)
        completions = [texts[i * num_samples : (i + 1) * num_samples] for i in range(len(samples))]
        if self.bar is not None:
            self.bar.advance({"time/step": (time.perf_counter() - started) / len(samples)}, amount=len(samples))
        return completions, {"to_image_box": [self.template.box_mapper(enc) for enc in encoded]}

    def _probe(self, encoded, rollout, num_samples: int) -> None:
        import torch

        from mmgrpo.eval.reliance import measure_reliance
        from mmgrpo.forward.policy import Policy

        rows = torch.arange(0, len(encoded) * num_samples, num_samples)
        policy = Policy(self.engine.model, self.template, shared_prefix=False)
        measured = measure_reliance(policy, encoded, rollout.completion_ids[rows], rollout.completion_mask[rows],
                                    temperature=1.0 if num_samples == 1 else self.temperature)
        for key, value in measured.items():  # a mean over the batch: summed weighted by its samples
            if value == value:  # not NaN
                self.probe_sums[key] = self.probe_sums.get(key, 0.0) + value * len(encoded)
                self.probe_counts[key] = self.probe_counts.get(key, 0) + len(encoded)

    def probe_result(self) -> dict[str, float]:
        """The probe's means over the samples generated (fusion/reliance/<m>, fusion/attention/<m>/<band>)."""
        return {key: total / self.probe_counts[key] for key, total in sorted((self.probe_sums or {}).items())}


def evaluate(engine, template, dataset, output_dir, *, metrics: list[str], model_name: str, num_samples: int = 1,
             max_new_tokens: int = 64, temperature: float = 1.0, batch_size: int = 32, resume: bool = False,
             limit: int | None = None, media_kwargs=None, show_progress: bool = True, fusion_probe: bool = False) -> dict:
    """Score the rollout engine's model on every sample of `dataset` (a DatasetView); writes eval.json and returns it.

    fusion_probe: also measure modality reliance on each sample's first completion (mmgrpo/eval/reliance.py),
    written to fusion_probe.json and returned under "fusion_probe" (samples an earlier --resume run finished
    are not probed again)."""
    from mmgrpo.eval.results import run_eval

    count = len(dataset) if limit is None else min(limit, len(dataset))
    samples = (dataset[i] for i in range(count))
    with progress_bar(count, f"eval {getattr(dataset, 'name', '')}", show=show_progress, shown=None, unit="sample") as bar:
        generate = EngineGenerator(engine, template, max_new_tokens=max_new_tokens, temperature=temperature,
                                   media_kwargs=media_kwargs, bar=bar, fusion_probe=fusion_probe)
        result = run_eval(
            samples, generate, output_dir, model=model_name, dataset=getattr(dataset, "name", str(dataset)),
            split=getattr(dataset, "split", ""), metrics=metrics, num_samples=num_samples, batch_size=batch_size,
            resume=resume, config={"max_new_tokens": max_new_tokens, "temperature": temperature, "limit": limit},
        )
    if fusion_probe:
        result["fusion_probe"] = generate.probe_result()
        (Path(output_dir) / PROBE_FILE).write_text(json.dumps(result["fusion_probe"], indent=1) + "\n")
    return result


DTYPES = ("bfloat16", "float16", "float32")  # --torch_dtype's values besides auto


def eval_device_and_dtype(device: str = "auto", torch_dtype: str = "auto") -> tuple:
    """Where and in what precision a model is evaluated: `auto` is the first GPU, in bfloat16 where it has
    it (float16 where not), else the CPU in float32. ConfigError for a device this machine has not.

    >>> eval_device_and_dtype("cpu", "auto")
    (device(type='cpu'), torch.float32)
    """
    import torch

    from mmgrpo.errors import ConfigError

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        where = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r}: give auto, cpu, cuda or cuda:N.") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: this machine has no CUDA GPU; use --device cpu (or auto).")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1}.")
    if torch_dtype == "auto":
        if where.type != "cuda":
            return where, torch.float32
        return where, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if torch_dtype not in DTYPES:
        raise ConfigError(f"--torch_dtype {torch_dtype!r}: give auto, {', '.join(DTYPES)}.")
    if torch_dtype == "bfloat16" and where.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"--torch_dtype bfloat16: {torch.cuda.get_device_name(where)} has no bfloat16; use float16 or auto.")
    return where, getattr(torch, torch_dtype)


def load_for_eval(model_path: str, model_type: str | None, *, max_pixels=None, min_pixels=None, template_plugin=(),
                  device: str = "auto", torch_dtype: str = "auto", attn_implementation: str = "sdpa",
                  vllm: dict | None = None, **template_options):
    """(rollout engine, template) of a model folder (or tiny:<family>), for evaluation: the same
    load sequence as training (`load_template`), the model on `device` in `torch_dtype`
    (`eval_device_and_dtype`: a GPU in bfloat16 when there is one), the engine `build_rollout_engine` picks.
    vllm: generate with a colocated vLLM engine instead ({"max_model_len": ..., "gpu_memory_utilization": ...,
    "kv_cache_memory_bytes": ...}); it loads the checkpoint itself, in `torch_dtype`.
    template_options: family options such as Qwen2.5-Omni's use_audio_in_video, video_fps, video_nframes."""
    from mmgrpo.forward.policy import Policy
    from mmgrpo.models.loading import check_attention, load_model, load_template
    from mmgrpo.rollout import build_rollout_engine

    where, dtype = eval_device_and_dtype(device, torch_dtype)
    check_attention(attn_implementation)
    path, _, template = load_template(model_path, model_type, template_plugin=template_plugin,
                                      min_pixels=min_pixels, max_pixels=max_pixels, **template_options)
    if vllm is not None:
        from mmgrpo.rollout.vllm_colocate import VLLMColocateRollout

        if vllm.get("max_model_len") is None:  # the model's positions, at most 8192 tokens of prompt + completion
            from transformers import AutoConfig

            text = AutoConfig.from_pretrained(path).get_text_config()
            vllm = {**vllm, "max_model_len": min(getattr(text, "max_position_embeddings", None) or 8192, 8192)}

        console.print(f"evaluating {model_path} ({template.name}) with vLLM in {str(dtype).removeprefix('torch.')}")
        return VLLMColocateRollout(path, template, dtype=str(dtype).removeprefix("torch."), **vllm), template
    model = load_model(path, dtype, template=template, attn_implementation=attn_implementation).to(where).eval()
    console.print(f"evaluating {model_path} ({template.name}) on {where} in {str(dtype).removeprefix('torch.')}, "
                  f"{attn_implementation} attention")
    return build_rollout_engine(Policy(model, template)), template


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """eval's (and compare's) generation through vLLM."""
    p.add_argument("--use_vllm", action="store_true",
                   help="Generate with vLLM (colocated, its own copy of the checkpoint) instead of transformers; the "
                   "same prompts, greedy answers as transformers' up to ties (docs/evaluation.md).")
    p.add_argument("--vllm_max_model_len", type=int, default=None,
                   help="--use_vllm: longest prompt + completion (default: the model's positions, at most 8192).")
    p.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.9,
                   help="--use_vllm on a GPU: the share of its memory vLLM takes (default 0.9: eval has the GPU alone).")
    p.add_argument("--vllm_kv_cache_memory_bytes", type=int, default=None,
                   help="--use_vllm: vLLM's KV cache in bytes (vLLM on CPU: default 256 MiB).")


def vllm_flags(args) -> list[str]:
    """The vLLM flags of parsed `args`, as eval's command line takes them (compare passes them on)."""
    flags = ["--use_vllm"] if args.use_vllm else []
    flags += ["--vllm_gpu_memory_utilization", str(args.vllm_gpu_memory_utilization)]
    for name in ("vllm_max_model_len", "vllm_kv_cache_memory_bytes"):
        if getattr(args, name) is not None:
            flags += [f"--{name}", str(getattr(args, name))]
    return flags


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmgrpo eval", description="Evaluate a model on a dataset split: eval.json + eval.md.")
    p.add_argument("--model", required=True, help="Model folder (e.g. runs/x/checkpoint-50) or tiny:<family>.")
    p.add_argument("--model_type", help="Template name (qwen2-vl, qwen2.5-vl, ...); inferred when not given, from "
                   "tiny:<family>, a checkpoint mmgrpo saved, or the checkpoint's config.json model_type.")
    p.add_argument("--template_plugin", nargs="*", default=[],
                   help="Python files or modules that register templates (docs/custom_template.md).")
    p.add_argument("--dataset", required=True, help="NAME[:split] (default split: test) or a data file.")
    p.add_argument("--metrics", nargs="*", default=None, help="Metrics (default: the dataset's reward functions).")
    p.add_argument("--num_samples", type=int, default=1, help="Completions per sample (1 = greedy; k for pass@k/mean@k).")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature when --num_samples > 1.")
    p.add_argument("--max_completion_length", type=int, default=None,
                   help="Longest completion in tokens (default: the dataset's registry max_completion_length, else 64).")
    p.add_argument("--batch_size", type=int, default=32, help="Samples per generate call.")
    p.add_argument("--limit", type=int, default=None, help="Evaluate only the first N samples.")
    p.add_argument("--max_pixels", type=int, default=None, help="Image pixel limit after resizing.")
    p.add_argument("--min_pixels", type=int, default=None, help="Image pixel floor after resizing.")
    p.add_argument("--video_fps", type=float, default=None, help="Frames per second sampled from a video (as in training).")
    p.add_argument("--video_nframes", type=int, default=None, help="Frames sampled from a video (as in training).")
    p.add_argument("--use_audio_in_video", action="store_true",
                   help="Qwen2.5-Omni: feed each video's sound track with its frames (as in training).")
    p.add_argument("--system", default=None, help="A system prompt for rows without one, in place of the dataset's "
                   "(as in training; \"\": none).")
    p.add_argument("--media_root", default=None, help="Where a bare data file's relative media paths point (default: its folder).")
    p.add_argument("--device", default="auto", help="auto (the first GPU, else the CPU), cpu, cuda or cuda:N.")
    p.add_argument("--torch_dtype", default="auto",
                   help="The model's precision: auto (bfloat16 on a GPU that has it, float16 on one that has not, float32 "
                   "on the CPU), bfloat16, float16 or float32.")
    add_vllm_flags(p)
    p.add_argument("--attn_implementation", default="sdpa",
                   help="sdpa (default), eager, flash_attention_2 (flash-attn, CUDA), flash_attention_3, flex_attention.")
    p.add_argument("--dataset_registry", nargs="*", default=[], help="Extra registry YAML files.")
    p.add_argument("--output_dir", required=True, help="Where eval.json, eval.md and samples.jsonl go.")
    p.add_argument("--resume", action="store_true", help="Continue an interrupted eval in --output_dir.")
    p.add_argument("--fusion_probe", action="store_true",
                   help="Also measure how much each answer relies on each modality (log-prob with vs without the medium, "
                   "attention shares per layer band; docs/fusion.md): fusion_probe.json.")
    return p


def check_counts(args) -> None:
    """ConfigError for a count that would evaluate nothing (an eval of 0 samples is no result)."""
    from mmgrpo.errors import ConfigError

    for flag in ("limit", "num_samples", "batch_size", "max_completion_length"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} {value}: must be at least 1" + (" (leave it out to evaluate every sample)." if flag == "limit" else "."))
    if args.num_samples > 1 and not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ConfigError(f"--temperature {args.temperature}: --num_samples {args.num_samples} samples at a finite "
                          "temperature > 0 (greedy decoding is --num_samples 1).")
    if args.video_fps is not None and not (math.isfinite(args.video_fps) and args.video_fps > 0):
        raise ConfigError(f"--video_fps {args.video_fps}: give frames per second > 0.")
    for flag in ("vllm_max_model_len", "vllm_kv_cache_memory_bytes"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} {getattr(args, flag)}: must be at least 1.")
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization}: a share in (0, 1].")
    if args.use_vllm:
        import importlib.util

        from mmgrpo.rollout.vllm_requests import INSTALL_HINT

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"{INSTALL_HINT}; or leave --use_vllm out to generate with transformers.")
        if args.fusion_probe:
            raise ConfigError("--fusion_probe reads the policy's own forward: leave --use_vllm out to measure it.")


def main(argv: list[str]) -> dict:
    args = eval_parser().parse_args(argv)  # before the heavy imports: --help stays instant
    from mmgrpo.data.catalog import resolve_dataset
    from mmgrpo.data.prompt_batches import media_options
    from mmgrpo.runstate.run_lock import refuse_live_run

    check_counts(args)
    refuse_live_run(args.output_dir)  # inside a live training run's folder (its lock): refused before any model loads
    dataset = resolve_dataset(args.dataset, split="test", extra_files=args.dataset_registry, media_root=args.media_root,
                              system_prompt=args.system)
    metrics = args.metrics or dataset.reward_funcs
    video = {"video_fps": args.video_fps, "video_nframes": args.video_nframes}
    max_new_tokens = args.max_completion_length or dataset.max_completion_length or 64
    vllm = None
    if args.use_vllm:
        vllm = {"max_model_len": args.vllm_max_model_len, "seed": 0,
                "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                "kv_cache_memory_bytes": args.vllm_kv_cache_memory_bytes}  # fmt: skip
    engine, template = load_for_eval(
        args.model, args.model_type, max_pixels=args.max_pixels, min_pixels=args.min_pixels,
        template_plugin=args.template_plugin, device=args.device, torch_dtype=args.torch_dtype,
        attn_implementation=args.attn_implementation, vllm=vllm, **video,
        **({"use_audio_in_video": True} if args.use_audio_in_video else {}),
    )
    media_kwargs = media_options(template, args)
    result = evaluate(
        engine, template, dataset, args.output_dir, metrics=metrics, model_name=args.model,
        num_samples=args.num_samples, max_new_tokens=max_new_tokens, temperature=args.temperature,
        batch_size=args.batch_size, resume=args.resume, limit=args.limit, media_kwargs=media_kwargs,
        fusion_probe=args.fusion_probe,
    )
    for name, value in {**result["metrics"], **result.get("fusion_probe", {})}.items():
        console.print(f"{name}: {value}")
    console.print(f"eval written to {Path(args.output_dir) / 'eval.json'}")
    return result


def compare_main(argv: list[str]) -> dict:
    from mmgrpo.eval.compare import compare, print_compare, write_compare

    p = argparse.ArgumentParser(
        prog="mmgrpo compare",
        description="A/B comparison of two evals (eval.json files or their folders; A is the baseline): "
        "per metric the difference with a 95%% paired bootstrap interval and a p-value.",
    )
    p.add_argument("a", help="Baseline: an eval.json or its folder; or a model when --dataset is given.")
    p.add_argument("b", help="Candidate: as A.")
    p.add_argument("--dataset", help="Evaluate A and B (models) on this NAME[:split] first.")
    p.add_argument("--model_type", help="Template name when A and B are models.")
    p.add_argument("--metrics", nargs="*", default=None, help="Metrics when evaluating models.")
    p.add_argument("--dataset_registry", nargs="*", default=[], help="Extra registry YAML files (when evaluating models).")
    p.add_argument("--limit", type=int, default=None, help="Evaluate only the first N samples (when evaluating models).")
    p.add_argument("--batch_size", type=int, default=32, help="Samples per generate call (when evaluating models).")
    p.add_argument("--max_pixels", type=int, default=None, help="Image pixel limit (when evaluating models).")
    p.add_argument("--device", default="auto", help="As `mmgrpo eval --device` (when evaluating models).")
    p.add_argument("--torch_dtype", default="auto", help="As `mmgrpo eval --torch_dtype` (when evaluating models).")
    add_vllm_flags(p)
    p.add_argument("--attn_implementation", default="sdpa", help="As `mmgrpo eval` (when evaluating models).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the bootstrap and permutation draws.")
    p.add_argument("--n_boot", type=int, default=10_000, help="Bootstrap resamples / permutations.")
    p.add_argument("--output", default=None, help="Write the comparison (JSON + Markdown) to this file or folder.")
    args = p.parse_args(argv)
    a, b = args.a, args.b
    if args.dataset:
        out = Path(args.output or "runs/compare")
        for name, model in (("a", args.a), ("b", args.b)):
            main(["--model", model, "--dataset", args.dataset, "--output_dir", str(out / f"eval_{name}"),
                  "--batch_size", str(args.batch_size), "--device", args.device, "--torch_dtype", args.torch_dtype,
                  "--attn_implementation", args.attn_implementation]
                 + (["--model_type", args.model_type] if args.model_type else [])
                 + (["--metrics", *args.metrics] if args.metrics else [])
                 + (["--dataset_registry", *args.dataset_registry] if args.dataset_registry else [])
                 + (["--limit", str(args.limit)] if args.limit else [])
                 + (["--max_pixels", str(args.max_pixels)] if args.max_pixels else []) + vllm_flags(args))
        a, b = out / "eval_a", out / "eval_b"
    result = compare(a, b, seed=args.seed, n_boot=args.n_boot)
    print_compare(result)
    if args.output:
        paths = write_compare(result, args.output)
        console.print(f"comparison written to {paths[0]}")
    return result
