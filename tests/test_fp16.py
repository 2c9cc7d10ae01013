"""fp16 training: the precision flags, the loss scaler's overflow rule, and a GRPO run in float16.

FSDP2 with fp16 runs in 2 processes in tests/test_distributed.py (its LoRA phase); DeepSpeed has no
float16 on the CPU, so its fp16 config is checked as a config (mmgrpo/parallel/zero3.py's doctest).
"""

from __future__ import annotations

import json

import pytest
import torch

from mmgrpo.config import TrainConfig
from mmgrpo.errors import ConfigError
from mmgrpo.parallel.single import SingleProcess
from mmgrpo.training.startup_checks import fill_precision


@pytest.mark.parametrize("flags, precision", [
    ([], "fp32"),  # no GPU here: float32
    (["--fp16"], "fp16"),
    (["--bf16"], "bf16"),
    (["--torch_dtype", "float16"], "fp16"),
    (["--torch_dtype", "bfloat16"], "bf16"),
    (["--torch_dtype", "float32"], "fp32"),
    (["--torch_dtype", "auto"], "fp32"),
    (["--torch_dtype", "float16", "--fp16"], "fp16"),  # saying it twice is fine
    (["--torch_dtype", "bfloat16", "--bf16", "true"], "bf16"),
])
def test_the_precision_flags_become_one_precision(flags, precision):
    cfg = TrainConfig.from_args(["--model", "tiny:qwen2-vl", *flags])
    fill_precision(cfg)
    assert cfg.precision == precision
    assert (cfg.bf16, cfg.fp16) == (precision == "bf16", precision == "fp16")  # what config.yaml records


@pytest.mark.parametrize("flags, match", [
    (["--bf16", "--fp16"], "--bf16 and --fp16 together: choose one"),
    (["--torch_dtype", "float16", "--bf16"], "--torch_dtype float16 and --bf16 true disagree"),
    (["--torch_dtype", "bfloat16", "--fp16"], "--torch_dtype bfloat16 and --fp16 disagree"),
    (["--torch_dtype", "float32", "--fp16"], "--torch_dtype float32 and --fp16 disagree"),
    (["--torch_dtype", "bfloat16", "--bf16", "false"], "--torch_dtype bfloat16 and --bf16 false disagree"),
])
def test_contradicting_precision_flags_are_one_line(flags, match):
    cfg = TrainConfig.from_args(["--model", "tiny:qwen2-vl", *flags])
    with pytest.raises(ConfigError, match=match):
        fill_precision(cfg)


def test_deepspeed_float16_on_the_cpu_is_refused_before_any_model_loads():
    from mmgrpo.config import DistConfig, OptimConfig
    from mmgrpo.parallel.zero3 import ZeRO3

    with pytest.raises(ConfigError, match="DeepSpeed has no float16 on the CPU; use --parallel fsdp2 here"):
        ZeRO3(DistConfig(), OptimConfig(), rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
              owns_group=False, precision="fp16")


def test_an_estimate_in_float16_counts_half_precision_activations(capsys):
    from mmgrpo.estimate import main as estimate_main

    estimate_main(["--model", "random:qwen2.5-vl-3b", "--fp16", "--parallel", "zero3", "--world_size", "8"])
    half = capsys.readouterr().out
    estimate_main(["--model", "random:qwen2.5-vl-3b", "--bf16", "false", "--parallel", "zero3", "--world_size", "8"])
    full = capsys.readouterr().out
    assert ", fp16" in half.splitlines()[0] and ", fp32" in full.splitlines()[0]
    needed = [float(next(line for line in out.splitlines() if line.startswith("needed")).split()[1]) for out in (half, full)]
    assert needed[0] < 0.8 * needed[1]


def test_a_misspelt_torch_dtype_names_its_values():
    with pytest.raises(ConfigError, match=r"--torch_dtype 'fp16'.*auto, bfloat16, float16, float32"):
        TrainConfig.from_args(["--model", "tiny:qwen2-vl", "--torch_dtype", "fp16"]).validate()


def fp16_strategy(model: torch.nn.Module):
    strategy = SingleProcess(None, rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False,
                             precision="fp16")
    prepared = strategy.prepare(model, None, lambda params: torch.optim.AdamW(params, lr=1e-2))
    return strategy, prepared.optimizer


def step(strategy, optimizer, model, loss_factor: float) -> float:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(2, 4)).float().mean() * loss_factor
    strategy.backward(loss)
    return strategy.optimizer_step(optimizer, max_grad_norm=1.0)


def test_an_overflow_halves_the_scale_and_is_not_a_fault_until_the_scale_is_spent():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    strategy, optimizer = fp16_strategy(model)
    before = model.weight.detach().clone()

    norm = step(strategy, optimizer, model, 1.0)  # a normal step: taken, scale kept
    assert torch.isfinite(torch.tensor(norm)) and not strategy.overflowed and strategy.loss_scale == 2.0**16
    assert not torch.equal(model.weight, before)

    taken = model.weight.detach().clone()
    norm = step(strategy, optimizer, model, 1e30)  # float16 gradients overflow: skipped, scale halved
    assert norm == float("inf") and strategy.overflowed and strategy.loss_scale == 2.0**15
    assert torch.equal(model.weight, taken) and all(p.grad is None for p in model.parameters())

    # the scale survives a checkpoint (training_state.json holds it as JSON)
    state = json.loads(json.dumps(strategy.loss_scale_state()))
    resumed, _ = fp16_strategy(torch.nn.Linear(4, 4))
    resumed.load_loss_scale_state(state)
    assert resumed.loss_scale == 2.0**15

    # once the scale is at 1, an overflow cannot be the scale's doing: a non-finite step like any other
    strategy.load_loss_scale_state({**state, "scale": 1.0})
    norm = step(strategy, optimizer, model, 1e30)
    assert norm == float("inf") and not strategy.overflowed


def test_an_fp16_run_trains_and_checkpoints_its_loss_scale(tmp_path):
    from mmgrpo.engine import train

    out = tmp_path / "run"
    cfg = TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--fp16", "--max_steps", "2", "--save_steps", "1",
        "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
        "--reward_funcs", "tests/dist_worker.py:length_reward", "--learning_rate", "1e-2", "--report_to", "none",
        "--output_dir", str(out),
    ])
    train(cfg)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(line["fp16/loss_scale"] == 2.0**16 and line["skipped"] == 0 for line in lines)
    assert all(0 < line["grad_norm"] < float("inf") for line in lines)  # rewards vary: the policy learned
    state = json.loads((out / "checkpoint-1" / "training_state.json").read_text())
    assert state["loss_scale"]["scale"] == 2.0**16 and state["flags"]["fp16"] is True
