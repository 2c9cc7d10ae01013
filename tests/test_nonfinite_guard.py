"""A step whose loss is finite but whose gradient is not is skipped like a NaN-loss step (counted,
logged, stopping after --max_nonfinite_steps), and the weights stay finite: a real GRPO step of the
tiny Qwen2-VL with one gradient made infinite in backward."""

import math
import warnings

import torch

from mmgrpo.config import TrainConfig
from mmgrpo.engine import grpo_step
from mmgrpo.training.build import build_run

FLAGS = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "2", "--per_device_train_batch_size", "4",
         "--max_completion_length", "4", "--dataloader_num_workers", "0", "--beta", "0", "--learning_rate", "1e-3",
         "--max_steps", "3"]
LENGTHS = "def length(completions, **columns):\n    return [len(c) % 5 / 4 for c in completions]\n"


def built_run(tmp_path):
    (tmp_path / "lengths.py").write_text(LENGTHS)  # differs within a group: the step has gradients
    cfg = TrainConfig.from_args([*FLAGS, "--reward_funcs", f"{tmp_path / 'lengths.py'}:length", "--output_dir", str(tmp_path / "run")])
    cfg.validate()
    return cfg, build_run(cfg)


def test_an_infinite_gradient_skips_the_step_and_keeps_the_weights(tmp_path):
    cfg, run = built_run(tmp_path)
    batches = run.prompt_batches()
    embedding = run.model.get_input_embeddings().weight
    hook = embedding.register_hook(lambda grad: torch.full_like(grad, math.inf))  # an overflow in backward
    before = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics, _ = grpo_step(run, next(batches), 1)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] == math.inf
    assert metrics["skipped"] == 1  # the loop counts it toward --max_nonfinite_steps
    assert any("non-finite gradient norm (inf): update skipped" in str(w.message) for w in caught)
    for name, p in run.model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed in a skipped step"
    assert all(p.grad is None for p in run.model.parameters())  # nothing carried into the next step

    hook.remove()  # the next step is a normal one again
    metrics, _ = grpo_step(run, next(batches), 2)
    assert math.isfinite(metrics["grad_norm"]) and metrics["skipped"] == 0
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert any(not torch.equal(p, before[name]) for name, p in run.model.named_parameters())
