"""What tests/test_vllm_servers.py runs in each rank: FSDP2 on 2 processes, every rank a client of
2 `mmgrpo rollout-server`s (rank r -> server r), weights over the gloo weight group.

    torchrun --nproc_per_node 2 tests/vllm_server_dist_worker.py OUT_DIR PORT_A PORT_B PORT_C PID_C

1. Three real GRPO steps, each after a sync (versions 0, 1, 2; buckets of 1 MB, so the sync is
   many buckets): after each sync every rank measures its server's greedy log-probs against the
   sharded trainer's. After the third step, with no sync, the gap shows (a skipped sync is seen).
2. The same seeded prompts sampled through both servers and through server A alone (a second
   client, over HTTP): the same completions.
3. A checkpoint is saved, then a sync to servers A and C over a new group, in which rank 0 kills
   server C (SIGKILL) half-way through the tensors: every rank must raise the one line naming C
   and the checkpoint, within the timeout.
Results go to OUT_DIR/rank{R}.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import image_prompts  # noqa: E402
from vllm_dist_worker import counted, max_logp_gap  # noqa: E402


def killing(named_tensors, pid: int, after: int):
    """The pairs as they are; after `after` of them, server `pid` is killed (rank 0: mid-sync)."""
    for index, pair in enumerate(named_tensors):
        if index == after:
            os.kill(pid, signal.SIGKILL)
            time.sleep(1.0)  # gone, its sockets closed
        yield pair


def main() -> None:
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import grpo_step, rollout_pipeline
    from mmgrpo.models.tiny import resolve_model_path
    from mmgrpo.rollout import SamplingParams
    from mmgrpo.rollout.vllm_client import RolloutServerError, VLLMServerRollout
    from mmgrpo.rollout.weight_sync import rollout_weights
    from mmgrpo.runstate.state import TrainState, seed_everything
    from mmgrpo.training.build import build_run
    from mmgrpo.training.resume import save_run

    out, port_a, port_b, port_c, pid_c = Path(sys.argv[1]), *map(int, sys.argv[2:6])
    rank = int(os.environ["RANK"])
    cfg = TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs",
        f"{Path(__file__).resolve().parent / 'dist_worker.py'}:length_reward", "--parallel", "fsdp2",
        "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "6",
        "--beta", "0", "--learning_rate", "5e-2", "--dataloader_num_workers", "0", "--torch_threads", "1",
        "--ddp_timeout", "120", "--output_dir", str(out / "run"), "--max_steps", "3", "--report_to", "none",
        "--use_vllm", "--vllm_mode", "server", "--vllm_server_port", str(port_a), str(port_b),
        "--vllm_weight_bucket_mb", "1", "--vllm_server_timeout", "60", "--vllm_max_model_len", "1024",
    ])
    run = build_run(cfg)
    model_path = resolve_model_path(cfg.model.model)
    seed_everything(cfg.seed)
    engine = run.rollout
    engine.suppress_placeholders = False  # the trainer's log-probs are over the whole vocabulary
    record: dict = {"engine": type(engine).__name__, "servers": [s.url for s in engine.mine], "gaps": []}
    prompts = image_prompts(run.template, 2, offset=2 * rank)  # each rank its own prompts

    def weights():
        return rollout_weights(run.model, run.peft_model, run.strategy)

    # 1. three steps, each after a sync
    for step in (1, 2, 3):
        sent: dict = {}
        engine.update_weights(counted(weights(), sent), step - 1)
        record["gaps"].append(max_logp_gap(run, engine, prompts))
        metrics, _ = grpo_step(run, image_prompts(run.template, 2, offset=10 * step + 2 * rank), step=step)
        record.setdefault("losses", []).append(metrics["loss"])
        record.setdefault("sent", []).append(sent)
    record["stale_gap"] = max_logp_gap(run, engine, prompts)  # step 3 trained, no sync followed

    # 2. seeded samples: rank r's server against server A alone
    engine.update_weights(weights(), 3)
    seeded = SamplingParams(num_generations=2, max_new_tokens=6, temperature=1.0, seed=1234 + rank)
    encoded = [enc for _, enc in prompts]
    spread = engine.generate(encoded, seeded)
    alone = VLLMServerRollout([("127.0.0.1", port_a)], model_path, run.template, rank=rank, world_size=2,
                              transfer="http", timeout=60, suppress_placeholders=False)
    alone.update_weights(weights(), 3)
    single = alone.generate(encoded, seeded)
    record["same_ids"] = torch.equal(spread.completion_ids, single.completion_ids)
    record["seeded_logp_gap"] = float((spread.logps - single.logps).abs().max())
    alone.close()

    # 3. a checkpoint, then server C killed mid-sync
    state = TrainState(model=cfg.model.model)
    state.step = 3
    batches = run.prompt_batches()
    save_run(run, out / "run" / "checkpoint-3", state, batches, rollout_pipeline(run, batches)).wait()
    doomed = VLLMServerRollout([("127.0.0.1", port_a), ("127.0.0.1", port_c)], model_path, run.template,
                               rank=rank, world_size=2, timeout=20, bucket_bytes=1 << 20,
                               checkpoint_dir=str(out / "run"))
    started = time.monotonic()
    try:
        tensors = weights() if rank else killing(weights(), pid_c, after=20)
        doomed.update_weights(tensors, 4)
        record["killed_mid_sync"] = "no error"
    except RolloutServerError as error:
        record["killed_mid_sync"] = str(error)
    record["stopped_after_s"] = time.monotonic() - started
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    run.strategy.close()


if __name__ == "__main__":
    main()
