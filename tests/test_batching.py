"""Token-budget micro-batches (mmgrpo/grpo/batching.py) and the engine's use of them.

    .venv/bin/python -m pytest tests/test_batching.py -v
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from mmgrpo.grpo.batching import (
    fixed_micro_batches,
    forward_tokens,
    pack_micro_batches,
    pad_fraction,
    scatter_rows,
)
from mmgrpo.rollout.base import RolloutEngine


def random_case(rng: random.Random):
    num_prompts, G = rng.randint(1, 6), rng.randint(1, 8)
    prompt_lengths = [rng.randint(5, 300) for _ in range(num_prompts)]
    completion_lengths = [rng.choice([rng.randint(1, 8), rng.randint(1, 128)]) for _ in range(num_prompts * G)]
    return prompt_lengths, completion_lengths, G, rng.randint(20, 1500), rng.random() < 0.7


def test_packing_respects_the_budget_keeps_groups_and_covers_every_row_once():
    rng = random.Random(0)
    for _ in range(500):
        prompt_lengths, completion_lengths, G, budget, shared = random_case(rng)
        plan = pack_micro_batches(prompt_lengths, completion_lengths, G, budget, shared_prefix=shared)
        rows = [r for mb in plan for r in mb.rows]
        assert sorted(rows) == list(range(len(completion_lengths)))  # every row, once
        for mb in plan:
            lengths = [completion_lengths[r] for r in mb.rows]
            assert mb.width == max(lengths)
            size = forward_tokens([prompt_lengths[p] for p in mb.prompts], lengths, shared_prefix=shared)
            assert size <= budget or len(mb) == 1, "only a row over the budget by itself may exceed it"
            # the rows of each prompt are contiguous, ascending, and match prompts / counts
            start = 0
            for prompt, count in zip(mb.prompts, mb.counts):
                part = mb.rows[start : start + count]
                assert all(r // G == prompt for r in part) and part == sorted(part)
                start += count
            assert start == len(mb) and len(set(mb.prompts)) == len(mb.prompts)
        for prompt in range(len(prompt_lengths)):
            group = list(range(prompt * G, (prompt + 1) * G))
            alone = forward_tokens([prompt_lengths[prompt]], [completion_lengths[r] for r in group], shared_prefix=shared)
            holders = [mb for mb in plan if prompt in mb.prompts]
            if alone <= budget:
                assert len(holders) == 1, "a group that fits is never split"


def test_packing_cuts_padding():
    # 8 prompts of 40 tokens, G = 4; every other prompt has long completions
    prompt_lengths = [40] * 8
    completion_lengths = [(200 if (r // 4) % 2 else 10) + r % 3 for r in range(32)]
    fixed = fixed_micro_batches(completion_lengths, 4, 8)  # two prompts per micro-batch: one short, one long
    packed = pack_micro_batches(prompt_lengths, completion_lengths, 4, 900)
    assert pad_fraction(fixed, prompt_lengths, completion_lengths) > 0.4
    assert pad_fraction(packed, prompt_lengths, completion_lengths) < 0.02
    assert max(forward_tokens([40] * len(mb.prompts), [completion_lengths[r] for r in mb.rows]) for mb in packed) <= 900


def test_micro_batch_rows_scatter_back():
    completion_lengths = [3, 1, 2, 2, 4, 1]
    plan = pack_micro_batches([5, 5, 5], completion_lengths, 2, 12)
    values = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    mask = (torch.arange(4)[None] < torch.tensor(completion_lengths)[:, None]).float()
    parts = [(values * mask)[mb.rows, : mb.width] for mb in plan]  # what Rollout.rows gives each forward
    assert [p.shape[1] for p in parts] == [mb.width for mb in plan]
    torch.testing.assert_close(scatter_rows(parts, plan, (6, 4)), values * mask)


# ---- the engine: a GRPO step with a budget equals one without --------------------------------

REWARD_PLUGIN = '''
def by_length(completions, **columns):
    return [float(len(text) % 5) for text in completions]
'''
# 3 prompts x G = 4, max_completion_length 12: prompt 0's completions are long, the others' short
LENGTHS = [12, 9, 11, 12, 2, 3, 1, 2, 3, 1, 2, 3]


class GradRecorder(torch.optim.SGD):
    """lr 0 (the weights never change); keeps a copy of the gradients of every step."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads: list[list[torch.Tensor | None]] = []

    def step(self, closure=None):
        self.grads.append([None if p.grad is None else p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


class FixedEngine(RolloutEngine):
    """A rollout engine that returns the same completions every time."""

    def __init__(self, rollout):
        self.rollout = rollout

    def generate(self, prompts, sampling):
        return copy.copy(self.rollout)  # a fresh one to score each time


def fixed_rollout(template, num_tokens: int = 12):
    """Completions of the lengths in LENGTHS: random ordinary tokens, EOS last unless full."""
    from mmgrpo.rollout.base import Rollout

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 600, (len(LENGTHS), num_tokens), generator=generator)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(num_tokens)[None] < lengths[:, None]).long()
    truncated = lengths == num_tokens
    for row, length in enumerate(LENGTHS):
        if length < num_tokens:
            ids[row, length - 1] = template.eos_token_ids[0]
    ids = ids.masked_fill(mask == 0, template.completion_pad_id)
    return Rollout(completion_ids=ids, completion_mask=mask, truncated=truncated)


def image_prompts(template, count: int) -> list:
    import PIL.Image

    from mmgrpo.data.prompt_batches import PromptEncoder
    from mmgrpo.data.sample import normalize_row

    encoder = PromptEncoder(template, 2048)
    prompts = []
    for i in range(count):  # images of two sizes: prompts of different lengths
        image = PIL.Image.new("RGB", (56 + 56 * (i % 2), 56), ((70 * i) % 255, 90, 200))
        sample = normalize_row({"query": "<image>What colour is it?", "images": [image], "solution": "blue"},
                               dataset="pictures", index=i)
        prompts.append((sample, encoder(sample.load_media())))
    return prompts


@pytest.mark.parametrize(
    "shared_prefix,loss_type,num_iterations,budget",
    [(True, "dapo", 1, 60), (True, "grpo", 2, 100), (False, "dapo", 2, 60), (False, "dr_grpo", 1, 200)],
)
def test_step_with_a_budget_matches_fixed_micro_batches(
    tiny_qwen2_vl_path, tmp_path, shared_prefix, loss_type, num_iterations, budget
):
    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import grpo_step
    from mmgrpo.training.build import build_run

    plugin = tmp_path / "length_reward.py"
    plugin.write_text(REWARD_PLUGIN)
    cfg = TrainConfig.from_args([
        "--model", tiny_qwen2_vl_path, "--model_type", "qwen2-vl", "--reward_funcs", f"{plugin}:by_length",
        "--num_generations", "4", "--per_device_train_batch_size", "6", "--gradient_accumulation_steps", "2",
        "--max_completion_length", "12", "--beta", "0.04", "--loss_type", loss_type,
        "--num_iterations", str(num_iterations), "--max_grad_norm", "0", "--dataloader_num_workers", "0",
        "--shared_prefix", str(shared_prefix).lower(), "--output_dir", str(tmp_path / "run"),
    ])
    run = build_run(cfg)
    optimizer = GradRecorder(run.policy.trainable_parameters())
    run = dataclasses.replace(
        run, rollout=FixedEngine(fixed_rollout(run.template)), optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    prompts = image_prompts(run.template, 3)
    assert run.policy.shared_prefix == shared_prefix

    fixed, _ = grpo_step(run, prompts, step=1)
    cfg.algo.max_tokens_per_microbatch = budget
    packed, _ = grpo_step(run, prompts, step=2)

    # fixed: rows 0-5 (prompt 0 and half of prompt 1, padded to 12) and rows 6-11
    assert fixed["micro_batches"] == 2
    assert packed["pad_fraction"] < fixed["pad_fraction"]
    assert fixed["reward_std"] > 0  # non-zero advantages: the gradients are not trivially equal
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert packed[key] == pytest.approx(fixed[key], rel=1e-5, abs=1e-6), key
    recorded = run.optimizer.grads
    assert len(recorded) == 2 * num_iterations  # one update per rollout batch and iteration, both ways
    for before, after in zip(recorded[:num_iterations], recorded[num_iterations:]):
        assert any(g is not None and g.abs().max() > 0 for g in before)
        for a, b in zip(before, after):
            if a is None:
                assert b is None
            else:
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
