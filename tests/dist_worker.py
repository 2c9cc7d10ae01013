"""What tests/test_distributed.py runs in each rank, under torchrun (gloo on CPU):

    torchrun --nproc_per_node 2 tests/dist_worker.py {fsdp2|zero3} OUT_DIR

One launch per strategy runs every check, to pay the start-up (imports, DeepSpeed) once:

    parity    one GRPO step on fixed completions (no sampling noise), fp32: loss and the step-1
              gradients (gathered in full) go to OUT_DIR/parity.pt for comparison with one
              process on the same global batch (`parity_step(None, ...)` here, run by the test)
    mixed     rank 0 gets text-only prompts, rank 1 image prompts; real sampling with HF
              generate, rank 0 stopping after one token: the step must complete (blank images
              keep the vision-tower calls equal, synced_gpus the decoding steps)
    save      the sharded model saved as one HF folder (rank 0 writes) plus log-probs of a batch
              under the sharded model, for the test to compare after from_pretrained
    lora      `train()` with LoRA adapters (vision frozen), bf16 (FSDP2: fp16, loss scaled), a sharded teacher, beta > 0 (reference = adapters
              off), from the data loader: adapters only change; metrics.jsonl has memory/peak_gb

Rewards used here are plain functions in this file (`--reward_funcs tests/dist_worker.py:fn`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from mmgrpo.rollout.base import RolloutEngine

WORKER = str(Path(__file__).resolve())
PER_RANK_PROMPTS, G = 2, 2  # 2 prompts x 2 completions per rank, in 2 micro-batches of 2


def length_reward(completions, **columns) -> list[float]:
    """Varies with the completion, so advantages (and gradients) are not zero."""
    return [(len(c) % 7) / 6 for c in completions]


def hang_on_rank_1(completions, **columns) -> list[float]:
    """Rank 1 never returns: the other rank must give up after --ddp_timeout."""
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return [0.0 for _ in completions]


class FixedRollout(RolloutEngine):
    """A rollout engine whose completions depend only on the prompt's tokens: runs compare
    without sampling noise."""

    def __init__(self, template, max_new_tokens: int):
        self.eos, self.pad, self.max_new_tokens = template.eos_token_ids[0], template.completion_pad_id, max_new_tokens

    def generate(self, prompts, params):
        from mmgrpo.rollout.base import Rollout, completion_mask_from_ids

        rows = []
        for prompt in prompts:
            seed = sum((i + 1) * int(t) for i, t in enumerate(prompt.prompt_ids.tolist())) % 2**31
            generator = torch.Generator().manual_seed(seed)
            for _ in range(params.num_generations):
                length = int(torch.randint(2, self.max_new_tokens + 1, (1,), generator=generator))
                row = torch.full((self.max_new_tokens,), self.pad)
                row[:length] = torch.randint(100, 1400, (length,), generator=generator)  # plain BPE tokens
                if length < self.max_new_tokens:
                    row[length - 1] = self.eos
                rows.append(row)
        completion_ids = torch.stack(rows)  # [B * G, T]
        completion_mask, truncated = completion_mask_from_ids(completion_ids, [self.eos])
        return Rollout(completion_ids=completion_ids, completion_mask=completion_mask, truncated=truncated)

    def update_weights(self, named_tensors, version: int) -> None:
        pass


def rollout_hooks(run) -> dict:
    """How the run's strategy executes a rollout (an engine built by hand takes the same)."""
    hooks = {"prepare": lambda batch: run.strategy.align_media(batch, run.template)}
    if run.strategy.name == "fsdp2":
        hooks.update(call=run.strategy.wrapper, scope=run.strategy.blocks_gathered)
    elif run.strategy.name == "zero3":
        hooks.update(scope=run.strategy.all_gathered)
    return hooks


def config(parallel: str, world_size: int, out: Path, *extra: str):
    from mmgrpo.config import TrainConfig

    accumulation = PER_RANK_PROMPTS * G * 2 // world_size // 2  # the same micro-batch size at any world size
    strategy = ["--parallel", parallel]
    if parallel == "zero3":  # a DeepSpeed JSON as ms-swift users write one; every weight partitioned
        ds_json = out.parent / f"{out.name}-ds_zero3.json"  # beside the run: train() wants an empty output_dir
        ds_json.parent.mkdir(parents=True, exist_ok=True)
        ds_json.write_text(json.dumps({
            "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # DeepSpeed keeps small weights whole by default
        }))
        strategy = ["--deepspeed", str(ds_json)]
    return TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", f"{WORKER}:length_reward",
        *strategy, "--num_generations", str(G), "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", str(accumulation), "--max_completion_length", "6",
        "--beta", "0.04", "--learning_rate", "1e-3", "--dataloader_num_workers", "0", "--torch_threads", "1",
        "--ddp_timeout", "60", "--output_dir", str(out), "--max_steps", "1", *extra,
    ])


def image_prompts(template, count: int, offset: int = 0) -> list:
    """(Sample, PromptInputs) pairs with small images of different sizes and colours."""
    import PIL.Image

    from mmgrpo.data.prompt_batches import PromptEncoder
    from mmgrpo.data.sample import normalize_row

    encoder = PromptEncoder(template, 2048)
    prompts = []
    for i in range(offset, offset + count):
        image = PIL.Image.new("RGB", (56 + 28 * (i % 3), 56), ((60 * i) % 255, 90, 200))
        sample = normalize_row({"query": "<image>What colour is it?", "images": [image], "solution": "blue"},
                               dataset="pictures", index=i)
        prompts.append((sample, encoder(sample.load_media())))
    return prompts


def text_prompts(template, count: int) -> list:
    from mmgrpo.data.prompt_batches import PromptEncoder
    from mmgrpo.data.sample import normalize_row

    encoder = PromptEncoder(template, 2048)
    prompts = []
    for i in range(count):
        sample = normalize_row({"query": f"What is {i} plus {i}?", "solution": str(2 * i)}, dataset="sums", index=i)
        prompts.append((sample, encoder(sample.load_media())))
    return prompts


def prepared_run(cfg, fixed_completions: bool):
    """build_run as engine.train does (with fixed completions if asked), without its loop."""
    import dataclasses

    from mmgrpo.runstate.state import seed_everything
    from mmgrpo.training.build import build_run
    from mmgrpo.training.startup_checks import check_train_flags

    check_train_flags(cfg)
    run = build_run(cfg)
    seed_everything(cfg.seed)
    if fixed_completions:
        run = dataclasses.replace(run, rollout=FixedRollout(run.template, cfg.rollout.max_completion_length))
    return run


def full_gradients(strategy, policy) -> dict[str, torch.Tensor]:
    """Every trainable weight's full gradient (HF names); a collective under FSDP2 / ZeRO-3."""
    if strategy.name == "none":
        return {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    if strategy.name == "fsdp2":
        return {n.removeprefix("model."): p.grad.full_tensor() for n, p in strategy.wrapper.named_parameters()
                if p.grad is not None}
    from deepspeed.utils import safe_get_full_grad

    return {n.removeprefix("model."): safe_get_full_grad(p).clone() for n, p in strategy.engine.module.named_parameters()
            if p.requires_grad}


def local_fraction(strategy) -> float:
    """The share of the policy's weights this rank holds: 1 / world size when truly sharded."""
    if strategy.name == "fsdp2":
        params = list(strategy.wrapper.parameters())
        return sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params)
    if strategy.name == "zero3":
        params = list(strategy.engine.module.parameters())
        return sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)
    return 1.0


def parity_step(parallel: str | None, out: Path, *extra: str) -> dict:
    """One GRPO step on this rank's share of a fixed global batch; loss and full gradients."""
    from mmgrpo.engine import grpo_step

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    run = prepared_run(config(parallel or "none", world_size, out, *extra), fixed_completions=True)
    every_prompt = image_prompts(run.template, PER_RANK_PROMPTS * 2)
    mine = every_prompt[rank * len(every_prompt) // world_size:(rank + 1) * len(every_prompt) // world_size]
    captured = {}
    real_step = run.strategy.optimizer_step

    def capture_then_step(optimizer, max_grad_norm):
        captured.update(full_gradients(run.strategy, run.policy))
        return real_step(optimizer, max_grad_norm)

    run.strategy.optimizer_step = capture_then_step
    metrics, _ = grpo_step(run, mine, step=1)
    return {"loss": metrics["loss"], "reward": metrics["reward"], "grads": captured, "run": run,
            "local_fraction": local_fraction(run.strategy), "shared_prefix": run.policy.shared_prefix}


def main() -> None:
    parallel, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    timings = {}

    start = time.perf_counter()
    result = parity_step(parallel, out / "parity_run")
    run = result.pop("run")
    if rank == 0:
        torch.save(result, out / "parity.pt")
    timings["parity"] = time.perf_counter() - start

    start = time.perf_counter()  # --scale_rewards batch: the std of both ranks' rewards together
    batch = parity_step(parallel, out / "parity_batch_run", "--scale_rewards", "batch")
    batch.pop("run").strategy.barrier()
    if rank == 0:
        torch.save({k: batch[k] for k in ("loss", "grads")}, out / "parity_batch.pt")
    timings["parity_batch"] = time.perf_counter() - start

    start = time.perf_counter()  # the sharded model after its step: log-probs, then one HF folder
    from mmgrpo.engine import grpo_step
    from mmgrpo.rollout.base import SamplingParams

    encoded = [enc for _, enc in image_prompts(run.template, 2, offset=7)]
    batch = run.policy.forward_batch(encoded, [1, 1])
    completion = FixedRollout(run.template, 6).generate(encoded, SamplingParams(num_generations=1, max_new_tokens=6))
    with torch.no_grad():
        logps, _ = run.policy.completion_logprobs(batch, completion.completion_ids, completion.completion_mask)
    run.save(out / "checkpoint")
    # what a rollout engine with its own weights (vLLM) is sent: gathered one tensor at a time on
    # every rank (a collective), compared with the strategy's own full state dict on rank 0
    from mmgrpo.rollout.weight_sync import rollout_weights

    sent = {name: tensor.clone() for name, tensor in rollout_weights(run.model, run.peft_model, run.strategy)}
    full = run.strategy.full_state_dict(run.model)
    if rank == 0:
        gaps = [float((tensor - full[name]).abs().max()) for name, tensor in sent.items()]
        trainable = sum(p.requires_grad for p in run.model.parameters())
        (out / "rollout_weights.json").write_text(json.dumps({"sent": len(sent), "trainable": trainable,
                                                              "max_gap": max(gaps)}))
    if rank == 0:
        torch.save({"batch": batch, "completion_ids": completion.completion_ids,
                    "completion_mask": completion.completion_mask, "logps": logps}, out / "logps.pt")
    timings["save"] = time.perf_counter() - start

    start = time.perf_counter()  # text-only prompts on rank 0, images on rank 1, real sampling
    import dataclasses

    from mmgrpo.rollout.hf import HFRollout

    # Rank 0 stops after one token (every token ends it), rank 1 samples 6: generate's forward
    # steps must stay in step across ranks while every block is gathered per step.
    eos = list(range(1500)) if rank == 0 else run.template.eos_token_ids
    engine = HFRollout(run.policy.model, run.template, synced=True, eos_token_ids=eos, **rollout_hooks(run))
    prompts = text_prompts(run.template, PER_RANK_PROMPTS) if rank == 0 else image_prompts(run.template, PER_RANK_PROMPTS)
    metrics, _ = grpo_step(dataclasses.replace(run, rollout=engine), prompts, step=2)
    if rank == 0:
        (out / "mixed.json").write_text(json.dumps({"loss": metrics["loss"], "reward/text": metrics.get("reward/text"),
                                                    "reward/image": metrics.get("reward/image"),
                                                    "completion_length_max": metrics["completion_length_max"]}))
    timings["mixed"] = time.perf_counter() - start

    start = time.perf_counter()  # the shared-prefix rollout on the sharded model, weights gathered once
    from mmgrpo.rollout.shared_prefix_engine import SharedPrefixRollout

    # Rank 0 stops after one token, rank 1 samples 8: its lean decode steps call no module, so
    # rank 0 may leave the loop early. Log-probs of the sampled tokens, as the decode loop computed
    # them from the gathered weights, must equal the sharded log-prob forward's.
    engine = SharedPrefixRollout(run.policy.model, run.template, eos_token_ids=eos, **rollout_hooks(run))
    encoded = [enc for _, enc in prompts]
    rollout = engine.generate(encoded, SamplingParams(num_generations=G, max_new_tokens=8))
    forward = run.strategy.align_media(run.policy.forward_batch(encoded, [G] * len(encoded)), run.template)
    with torch.no_grad():
        recomputed, _ = run.policy.completion_logprobs(forward, rollout.completion_ids, rollout.completion_mask)
    report = {"lean": engine.lean is not None, "length": int(rollout.completion_mask.sum(1).max()),
              "max_diff": float((recomputed - rollout.logps).abs().max())}
    (out / f"shared_rollout_rank{rank}.json").write_text(json.dumps(report))
    timings["shared_rollout"] = time.perf_counter() - start

    start = time.perf_counter()  # LoRA + bf16 (FSDP2: fp16 with its sharded loss scaler) through the real training loop
    from mmgrpo.engine import train

    precision = "--fp16" if parallel == "fsdp2" else "--bf16"  # DeepSpeed has no float16 on the CPU
    cfg = config(parallel, int(os.environ["WORLD_SIZE"]), out / "lora", "--train_type", "lora", "--lora_rank", "4",
                 "--freeze_vit", precision, "--lora_dropout", "0", "--learning_rate", "1e-2",
                 "--teacher_model", "tiny:qwen2-vl")  # on-policy distillation: the teacher sharded as the reference is
    train(cfg)
    timings["lora"] = time.perf_counter() - start
    if rank == 0:
        (out / "timings.json").write_text(json.dumps(timings))
    # The first build_run opened the process group (each train() closes only a group it opened):
    # close it before exit, or gloo's threads are still running when the process tears down.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # As `mmgrpo train` ends a launched rank: without the interpreter's teardown, in which a gloo
    # group that DeepSpeed or FSDP frees late aborted about one run in five (mmgrpo/cli.py).
    from mmgrpo.cli import _end_launched_rank

    _end_launched_rank(0)
