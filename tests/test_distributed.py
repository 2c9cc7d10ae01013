"""Beyond one process: FSDP2 and ZeRO-3 against one process, with real ranks (torchrun, gloo).

Each strategy gets one torchrun launch of tests/dist_worker.py (2 ranks) that runs all its checks;
the one-process reference runs here. Checks that need no second process (flag errors, the blank
image that keeps vision-tower calls equal) run first and fast.

    .venv/bin/python -m pytest tests/test_distributed.py -m distributed -v
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmgrpo.config import TrainConfig
from mmgrpo.errors import ConfigError
from mmgrpo.training.startup_checks import check_train_flags

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def launch(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """torchrun with 2 ranks on a free port; DeepSpeed's compiled op cached inside .venv."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---- flags: ConfigErrors before any model loads ------------------------------------------------


def test_world_size_must_keep_groups_whole(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = TrainConfig.from_args(["--parallel", "fsdp2", "--per_device_train_batch_size", "4", "--num_generations", "8"])
    with pytest.raises(ConfigError, match="2 ranks.*not a multiple of --num_generations 8"):
        check_train_flags(cfg)


def test_launched_ranks_need_a_parallel_strategy(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = TrainConfig.from_args(["--num_generations", "4", "--per_device_train_batch_size", "4"])
    with pytest.raises(ConfigError, match="--parallel fsdp2 or --parallel zero3"):
        check_train_flags(cfg)


@pytest.mark.parametrize(
    "json_config, match",
    [
        ({"train_micro_batch_size_per_gpu": 16}, "train_micro_batch_size_per_gpu 16 but --per_device_train_batch_size gives 4"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
        ({"bf16": {"enabled": True}}, "bf16.enabled True but --bf16 is False"),
        ({"zero_optimization": {"stage": 2}}, "ZeRO stage 2"),
        ({"optimizer": {"type": "AdamW"}}, "optimizer"),
    ],
)
def test_deepspeed_json_contradicting_the_flags(tmp_path, json_config, match):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(json_config))
    cfg = TrainConfig.from_args(["--deepspeed", str(path), "--per_device_train_batch_size", "4", "--num_generations", "4"])
    with pytest.raises(ConfigError, match=match):
        check_train_flags(cfg)


def test_deepspeed_json_autos_are_filled(tmp_path):
    from mmgrpo.parallel.zero3 import deepspeed_config

    path = tmp_path / "zero3.json"  # the shape of ms-swift's zero3.json
    path.write_text(json.dumps({
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "reduce_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
    }))
    cfg = TrainConfig.from_args(["--deepspeed", str(path), "--per_device_train_batch_size", "4", "--num_generations", "4",
                                 "--gradient_accumulation_steps", "2", "--bf16", "--offload_optimizer"])
    check_train_flags(cfg)
    assert cfg.dist.strategy == "zero3"
    config = deepspeed_config(cfg.dist, cfg.optim, world_size=2, hidden_size=128, precision=cfg.precision)
    assert config["train_batch_size"] == 16 and config["gradient_accumulation_steps"] == 2
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 128 * 128 and zero["stage3_param_persistence_threshold"] == 1280
    assert zero["offload_optimizer"]["device"] == "cpu"


# ---- the blank image: equal vision-tower calls, nothing else changes ------------------------


def test_blank_image_changes_no_logprob_and_no_completion(tiny_qwen2_vl_path):
    from mmgrpo.forward.policy import ForwardBatch, Policy
    from mmgrpo.models.loading import load_model, load_processor
    from mmgrpo.parallel.media import add_dummy_medium
    from mmgrpo.rollout import HFRollout, SamplingParams
    from mmgrpo.templates import get_template

    sys.path.insert(0, str(WORKER.parent))
    import dist_worker

    template = get_template("qwen2-vl", load_processor(tiny_qwen2_vl_path))
    policy = Policy(load_model(tiny_qwen2_vl_path), template, shared_prefix=False)
    prompts = [enc for _, enc in dist_worker.text_prompts(template, 2)]
    batch = template.collate(prompts)
    with_blank = add_dummy_medium(batch, template, "image")
    assert with_blank["pixel_values"].shape[0] > 0 and with_blank["input_ids"].shape[1] > batch["input_ids"].shape[1]

    calls = []
    handle = policy.model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    params = SamplingParams(num_generations=2, max_new_tokens=6, greedy=True)
    plain = HFRollout(policy.model, template).generate(prompts, params)
    blank = HFRollout(policy.model, template, prepare=lambda b: add_dummy_medium(b, template, "image")).generate(prompts, params)
    assert torch.equal(plain.completion_ids, blank.completion_ids)
    assert len(calls) == 1  # the tower ran for the blank image only

    handle.remove()
    # a micro-batch of the training forward (one row per completion), with and without the blank image
    rows = template.collate([enc for _, enc in dist_worker.text_prompts(template, 2) for _ in range(2)])
    ids, mask = plain.completion_ids, plain.completion_mask
    with torch.no_grad():
        expected, _ = policy.completion_logprobs(ForwardBatch(rows, [1] * 4, False), ids, mask)
        got, _ = policy.completion_logprobs(ForwardBatch(add_dummy_medium(rows, template, "image"), [1] * 4, False), ids, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# ---- real ranks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The step of one process on the global batch (both ranks' prompts), each prompt repeated
    per completion (no shared prefix): the sharded runs share it, so both paths are compared."""
    sys.path.insert(0, str(WORKER.parent))
    import dist_worker

    result = dist_worker.parity_step(None, tmp_path_factory.mktemp("single"), "--shared_prefix", "false")
    assert not result["shared_prefix"]
    result.pop("run")
    return result


@pytest.fixture(scope="module")
def one_process_batch_scaled(tmp_path_factory):
    """As `one_process`, with --scale_rewards batch: advantages divided by the std of all rewards."""
    sys.path.insert(0, str(WORKER.parent))
    import dist_worker

    result = dist_worker.parity_step(None, tmp_path_factory.mktemp("single_batch"), "--shared_prefix", "false",
                                     "--scale_rewards", "batch")
    result.pop("run")
    return result


@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("parallel", ["fsdp2", "zero3"])
def test_two_ranks_match_one_process(parallel, one_process, one_process_batch_scaled, tmp_path):
    start = time.perf_counter()
    done = launch([str(WORKER), parallel, str(tmp_path)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    seconds = time.perf_counter() - start

    # one GRPO step: same loss, same step-1 gradients as one process on the global batch (fp32)
    ranks = torch.load(tmp_path / "parity.pt", weights_only=False)
    assert ranks["local_fraction"] == pytest.approx(0.5, abs=0.01)  # each rank really holds half the weights
    assert ranks["shared_prefix"]  # the sharded log-prob forwards run each prompt once per group
    assert ranks["loss"] == pytest.approx(one_process["loss"], abs=1e-5)
    assert ranks["reward"] == pytest.approx(one_process["reward"], abs=1e-6)
    assert ranks["grads"].keys() == one_process["grads"].keys()
    for name, grad in one_process["grads"].items():
        torch.testing.assert_close(ranks["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert sum(float(g.abs().sum()) for g in one_process["grads"].values()) > 0

    # --scale_rewards batch: each rank divides by the std of both ranks' rewards, as one process does
    batch = torch.load(tmp_path / "parity_batch.pt", weights_only=False)
    assert batch["loss"] == pytest.approx(one_process_batch_scaled["loss"], abs=1e-5)
    assert any(not torch.allclose(grad, one_process["grads"][name], atol=1e-6, rtol=1e-3)  # the scaling really differs
               for name, grad in one_process_batch_scaled["grads"].items())
    for name, grad in one_process_batch_scaled["grads"].items():
        torch.testing.assert_close(batch["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)

    # text-only prompts on one rank, images on the other: completes
    mixed = json.loads((tmp_path / "mixed.json").read_text())
    assert mixed["loss"] is not None and mixed["reward/text"] is not None and mixed["reward/image"] is not None
    assert mixed["completion_length_max"] > 1  # rank 1 went on sampling after rank 0 stopped

    # the shared-prefix rollout on the sharded model (lean steps on weights gathered once): rank 0
    # stopped after one token while rank 1 went on; its log-probs equal the sharded forward's
    shared = [json.loads((tmp_path / f"shared_rollout_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["lean"] for r in shared) and shared[0]["length"] == 1 and shared[1]["length"] > 1
    assert max(r["max_diff"] for r in shared) < 1e-5, shared

    # the consolidated checkpoint loads with from_pretrained and gives the sharded model's log-probs
    from mmgrpo.forward.policy import Policy
    from mmgrpo.models.loading import load_model, load_processor
    from mmgrpo.templates import get_template

    saved = torch.load(tmp_path / "logps.pt", weights_only=False)
    template = get_template("qwen2-vl", load_processor(str(tmp_path / "checkpoint")))
    policy = Policy(load_model(str(tmp_path / "checkpoint")), template, shared_prefix=False)
    with torch.no_grad():
        logps, _ = policy.completion_logprobs(saved["batch"], saved["completion_ids"], saved["completion_mask"])
    torch.testing.assert_close(logps, saved["logps"], atol=1e-5, rtol=0)

    # the weights a vLLM engine is sent (gathered tensor by tensor) equal the strategy's full state dict
    sent = json.loads((tmp_path / "rollout_weights.json").read_text())
    assert sent["sent"] == sent["trainable"] > 0 and sent["max_gap"] == 0.0, sent

    # LoRA + bf16 (FSDP2: fp16 with loss scaling) through train(): only adapters saved (none in the frozen vision tower), and they trained
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "lora" / "checkpoint-1" / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)
    assert not any(".visual.blocks." in key for key in adapter)  # --freeze_vit: no adapters in the tower
    assert any(".visual.merger." in key for key in adapter)  # the aligner is not frozen
    assert any(float(value.abs().max()) > 0 for key, value in adapter.items() if "lora_B" in key)
    metrics = json.loads((tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["memory/peak_gb"] > 0 and metrics["loss"] is not None
    # the sharded teacher is the starting model, which LoRA's zero-initialised adapters leave unchanged at step 1
    # (up to half-precision rounding: the student runs through its adapters, the teacher has none)
    assert metrics["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-3) and metrics["time/teacher"] > 0
    if parallel == "fsdp2":  # the sharded scaler agreed on every rank; no overflow at this scale
        assert metrics["fp16/loss_scale"] == 2.0**16 and metrics["fp16/overflow"] == 0 and metrics["skipped"] == 0
    print(f"{parallel}: {seconds:.0f} s, {(tmp_path / 'timings.json').read_text()}")


@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
def test_a_hung_rank_stops_the_others(tmp_path):
    """Rank 1 never returns from its reward; rank 0 gives up after --ddp_timeout, naming itself."""
    start = time.perf_counter()
    done = launch([
        "-m", "mmgrpo", "train", "--parallel", "fsdp2", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
        "--reward_funcs", f"{WORKER}:hang_on_rank_1", "--num_generations", "2", "--per_device_train_batch_size", "2",
        "--max_completion_length", "4", "--max_steps", "1", "--dataloader_num_workers", "0", "--ddp_timeout", "15",
        "--output_dir", str(tmp_path / "run"),
    ], timeout=240)
    assert done.returncode != 0
    assert "rank 0 of 2 failed" in done.stderr and "timed out" in done.stderr.lower(), done.stderr[-4000:]
    assert time.perf_counter() - start < 200


SKEWED_REWARD = '''
import os

def skewed(completions, sample_id, **columns):
    # rank 0: every other prompt's group is all-equal; rank 1: three prompts in four
    rank = int(os.environ.get("RANK", "0"))
    rewards = []
    for text, sample in zip(completions, sample_id):
        row = int(sample.rsplit("/", 1)[1])
        settled = row % 2 == 0 if rank == 0 else row % 4 != 0
        rewards.append(1.0 if settled else float(len(text) % 2))
    return rewards
'''


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
def test_dynamic_sampling_keeps_ranks_in_step(tmp_path):
    """--dynamic_sample on 2 real ranks whose batches need different refills: every rank runs the
    same rounds and trains the same number of micro-batches (else FSDP2's collectives would
    mismatch and the run would hang until --ddp_timeout), and each step logs its rounds. (Async
    rollouts under FSDP2 / ZeRO-3 need vLLM: tests/test_vllm_distributed.py.)"""
    (tmp_path / "reward.py").write_text(SKEWED_REWARD)
    done = launch([
        "-m", "mmgrpo", "train", "--parallel", "fsdp2", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
        "--reward_funcs", f"{tmp_path / 'reward.py'}:skewed", "--num_generations", "4",
        "--per_device_train_batch_size", "16", "--max_completion_length", "8", "--max_steps", "3",
        "--dynamic_sample", "--max_resample_times", "4", "--dataloader_num_workers", "0", "--ddp_timeout", "60",
        "--output_dir", str(tmp_path / "run"),
    ], timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert 1 <= row["dynamic/rounds"] <= 5 and row["dynamic/rounds"] == int(row["dynamic/rounds"])
        assert row["micro_batches"] == int(row["micro_batches"])  # the same count on both ranks
    # rank 1 starts with about 3 of 4 groups all-equal: some step refills
    assert max(row["dynamic/rounds"] for row in rows) > 1
    assert sum(row["dynamic/resampled_prompts"] for row in rows) > 0


@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
def test_accelerate_launch_starts_the_ranks_as_torchrun_does(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m mmgrpo train ...` (how accelerate users start
    runs; on a machine without GPUs it falls back to CPU ranks over gloo): two ranks, one FSDP2 step."""
    from mmgrpo.parallel.launch import free_port

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", "mmgrpo", "train", "--parallel", "fsdp2",
               "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "2",
               "--per_device_train_batch_size", "2", "--max_steps", "1", "--max_completion_length", "8",
               "--report_to", "none", "--output_dir", str(tmp_path / "run")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "device  2 x cpu (fsdp2)" in done.stderr
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]
