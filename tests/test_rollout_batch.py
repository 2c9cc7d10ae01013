"""`Rollout` is the one batch type of the step: `select` and `concat` keep every per-completion
field (multi-turn loss masks, the images inside completions, texts, reward columns, rewards, and
the step's log-probs, importance weights and advantages), so dynamic sampling and two-stage
generation never drop one, and `rows` gives a micro-batch every field of its rows in one call."""

from dataclasses import fields

import pytest
import torch

from mmgrpo.grpo.batching import fixed_micro_batches
from mmgrpo.rollout.base import Rollout


def episode_rollout(tag: str, rows: int, width: int, version: int) -> Rollout:
    """A rollout with every field set, each row traceable by its tag and index."""
    ids = torch.arange(rows * width).view(rows, width) + 100
    mask = torch.ones(rows, width, dtype=torch.long)
    return Rollout(
        completion_ids=ids, completion_mask=mask, truncated=torch.arange(rows) % 2 == 0, logps=-ids.float() / 1000,
        weight_version=version, row_versions=torch.full((rows,), version), loss_mask=(ids % 3 != 0).long(),
        token_versions=torch.full((rows, width), version) + (torch.arange(width) >= 2),  # --partial_rollouts
        completion_media=[{"pixel_values": torch.full((1, 2), float(r))} for r in range(rows)],
        texts=[f"{tag}{r}" for r in range(rows)], columns={"turns": [r + 1 for r in range(rows)]},
        metrics={"tools/turns": float(rows)}, totals={"tools/errors": 1.0},
        rewards=torch.arange(rows, dtype=torch.float), reward_per_func=torch.arange(2 * rows, dtype=torch.float).view(2, rows),
        old_logps=-ids.float() / 100, ref_logps=-ids.float() / 10, teacher_logps=-ids.float() / 20, importance_weights=torch.ones(rows, width) / (ids % 5 + 1),
        advantages=torch.arange(rows, dtype=torch.float) - 1,
        routed_experts=[torch.full((width + 2, 2, 2), r, dtype=torch.int16) for r in range(rows)],  # MoE routes
    )


def test_select_keeps_every_field_row_for_row():
    rollout = episode_rollout("a", 4, 3, version=5)
    picked = rollout.select([3, 1])
    assert picked.completion_ids.tolist() == rollout.completion_ids[[3, 1]].tolist()
    assert torch.equal(picked.loss_mask, rollout.loss_mask[[3, 1]]) and torch.equal(picked.logps, rollout.logps[[3, 1]])
    assert picked.truncated.tolist() == [False, False] and picked.rewards.tolist() == [3.0, 1.0]
    assert picked.reward_per_func.tolist() == [[3.0, 1.0], [7.0, 5.0]]
    assert [m["pixel_values"][0, 0].item() for m in picked.completion_media] == [3.0, 1.0]
    assert picked.texts == ["a3", "a1"] and picked.columns == {"turns": [4, 2]}
    assert [int(r[0, 0, 0]) for r in picked.routed_experts] == [3, 1]
    assert picked.weight_version == 5 and picked.metrics == rollout.metrics and picked.totals == rollout.totals
    assert torch.equal(picked.old_logps, rollout.old_logps[[3, 1]]) and picked.advantages.tolist() == [2.0, 0.0]
    unset = [f.name for f in fields(Rollout) if getattr(picked, f.name) is None]
    assert not unset, f"select dropped {unset}"


def test_concat_pads_to_the_longest_and_keeps_every_field():
    a, b = episode_rollout("a", 2, 3, version=4), episode_rollout("b", 1, 5, version=3)
    both = Rollout.concat([a, b], pad_token_id=7)
    assert both.completion_ids.shape == (3, 5) and both.completion_ids[0, 3:].tolist() == [7, 7]
    assert both.completion_mask.sum(1).tolist() == [3, 3, 5] and both.loss_mask[0, 3:].tolist() == [0, 0]
    assert both.logps[1, 3:].tolist() == [0.0, 0.0]
    assert both.texts == ["a0", "a1", "b0"] and both.columns == {"turns": [1, 2, 1]}
    assert both.rewards.tolist() == [0.0, 1.0, 0.0] and both.reward_per_func.shape == (2, 3)
    assert len(both.completion_media) == 3 and both.truncated.tolist() == [True, False, True]
    assert both.weight_version == 3  # the oldest weights among the rows
    assert both.versions().tolist() == [4, 4, 3]  # and each row's own
    assert both.select([2, 0]).versions().tolist() == [3, 4]
    assert both.token_versions.tolist() == [[4, 4, 5, 0, 0], [4, 4, 5, 0, 0], [3, 3, 4, 4, 4]]
    plain = Rollout(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.bool),
                    weight_version=3)
    assert Rollout.concat([plain, plain], pad_token_id=7).row_versions is None  # one version: no per-row tensor
    assert both.metrics["tools/turns"] == pytest.approx((2 * 2 + 1 * 1) / 3) and both.totals["tools/errors"] == 2.0


def test_concat_of_a_single_turn_part_and_an_episode_part_keeps_the_loss_mask():
    episode = episode_rollout("a", 2, 3, version=0)
    plain = Rollout(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long), torch.zeros(2, dtype=torch.bool))
    both = Rollout.concat([episode, plain], pad_token_id=0)
    assert both.loss_mask[2:].tolist() == [[1, 1, 0], [1, 1, 0]]  # all of its completion is the model's own
    assert both.texts is None and both.logps is None  # set in one part only: not known for every row


def test_rows_give_a_micro_batch_every_field_of_its_rows_cut_to_its_width():
    rollout = episode_rollout("a", 4, 5, version=2)
    rollout.completion_mask[:2, 3:] = 0  # rows 0 and 1: 3 tokens, so their micro-batch keeps 3 columns
    first, second = fixed_micro_batches(rollout.lengths.tolist(), num_generations=2, size=2)
    part = rollout.rows(first)
    assert (first.rows, first.width, second.width) == ([0, 1], 3, 5)
    for name in ("completion_ids", "completion_mask", "loss_mask", "logps", "old_logps", "ref_logps", "importance_weights"):
        assert torch.equal(getattr(part, name), getattr(rollout, name)[first.rows, : first.width]), name  # rows 0, 1; 3 columns
    assert part.advantages.tolist() == [-1.0, 0.0] and part.rewards.tolist() == [0.0, 1.0] and part.texts == ["a0", "a1"]
    assert rollout.rows(second).completion_ids.shape == (2, 5) and len(part) == 2
