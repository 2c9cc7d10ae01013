"""What tests/test_vllm_distributed.py runs in each rank: FSDP2 on 2 processes with vLLM colocated.

    torchrun --nproc_per_node 2 tests/vllm_dist_worker.py OUT_DIR {full|lora}

Each rank trains with `--parallel fsdp2 --use_vllm` (its own vLLM engine, `external_launcher`),
takes a real GRPO step with vLLM's rollouts, then measures vLLM's greedy log-probs against the
sharded trainer's: before the sync (stale weights: they differ) and after it (equal, fp32). The
sync gathers one full tensor at a time from the shards; the worker records how many gathered
tensors were alive at once. With `lora` the adapters train and vLLM gets the merged weights.
Results go to OUT_DIR/rank{R}.json.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import image_prompts  # noqa: E402


def max_logp_gap(run, engine, prompts) -> float:
    """Max |vLLM's greedy log-prob - the sharded trainer's| over the completion tokens of `prompts`."""
    from mmgrpo.rollout import SamplingParams

    greedy = SamplingParams(num_generations=2, max_new_tokens=6, greedy=True)
    encoded = [enc for _, enc in prompts]
    ours = engine.generate(encoded, greedy)
    batch = run.strategy.align_media(run.policy.forward_batch(encoded, [greedy.num_generations] * len(encoded)),
                                     run.template)
    with torch.no_grad():  # a collective forward: every rank runs it
        trainer, _ = run.policy.completion_logprobs(batch, ours.completion_ids, ours.completion_mask)
    mask = ours.completion_mask.bool()
    return float((ours.logps[mask] - trainer[mask]).abs().max())


def counted(named_tensors, record: dict):
    """The (name, tensor) pairs as they are, recording the most gathered tensors alive at once."""
    alive: list[weakref.ref] = []
    for name, tensor in named_tensors:
        alive = [ref for ref in alive if ref() is not None]
        alive.append(weakref.ref(tensor))
        record["peak_alive"] = max(record.get("peak_alive", 0), len(alive))
        record["sent"] = record.get("sent", 0) + 1
        yield name, tensor


def main() -> None:
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import grpo_step
    from mmgrpo.rollout.weight_sync import rollout_weights
    from mmgrpo.runstate.state import seed_everything
    from mmgrpo.training.build import build_run

    out, train_type = Path(sys.argv[1]), sys.argv[2]
    lora = ["--train_type", "lora", "--lora_rank", "4", "--lora_dropout", "0", "--learning_rate", "2e-1"]
    rank = int(os.environ["RANK"])
    cfg = TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", f"{Path(__file__).resolve().parent / 'dist_worker.py'}:length_reward", "--parallel", "fsdp2",
        "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "6",
        "--beta", "0", "--learning_rate", "5e-2", "--dataloader_num_workers", "0", "--torch_threads", "1",
        "--ddp_timeout", "120", "--output_dir", str(out / "run"), "--max_steps", "1", "--report_to", "none",
        "--use_vllm", "--vllm_max_model_len", "1024", "--vllm_kv_cache_memory_bytes", str(64 << 20),
        *(lora if train_type == "lora" else []),
    ])
    run = build_run(cfg)
    seed_everything(cfg.seed)
    engine = run.rollout
    engine.suppress_placeholders = False  # the trainer's log-probs are over the whole vocabulary
    record: dict = {"engine": type(engine).__name__}
    prompts = image_prompts(run.template, 2, offset=2 * rank)  # each rank its own prompts

    def sync(version: int, into: dict) -> None:
        engine.update_weights(counted(rollout_weights(run.model, run.peft_model, run.strategy), into), version)

    sync(0, {})
    metrics, _ = grpo_step(run, image_prompts(run.template, 2, offset=10 + 2 * rank), step=1)  # vLLM rolls out
    record["loss"] = metrics["loss"]
    record["stale_gap"] = max_logp_gap(run, engine, prompts)  # the policy took a step, vLLM did not
    sent: dict = {}
    sync(1, sent)
    record["synced_gap"] = max_logp_gap(run, engine, prompts)
    record.update(sent, weight_version=engine.weight_version, syncs=engine.syncs,
                  trainable=sum(p.requires_grad for p in run.model.parameters()))
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    engine.close()  # before the process group goes down
    run.strategy.close()


if __name__ == "__main__":
    main()
