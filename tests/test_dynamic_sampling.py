"""Dynamic sampling: all-equal groups are dropped and refilled, the number of extra rounds is
bounded, and ranks agree (two real processes, gloo)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmgrpo.rollout import dynamic_sample as informative
from mmgrpo.rollout.base import Rollout
from mmgrpo.rollout.dynamic_sample import Round, fill_informative, informative_groups

G = 2


def make_round(tag: str, group_rewards: list[list[float]], width: int) -> Round:
    """A round of len(group_rewards) prompts named tag0, tag1 ...; completion j of prompt p has
    ids [p*10 + j] * width (so the rows can be traced) and the given rewards."""
    ids = torch.tensor([[p * 10 + j] * width for p in range(len(group_rewards)) for j in range(G)])
    rewards = torch.tensor([r for group in group_rewards for r in group])
    return Round(
        prompts=[f"{tag}{p}" for p in range(len(group_rewards))],
        rollout=Rollout(completion_ids=ids, completion_mask=torch.ones_like(ids), truncated=torch.zeros(len(ids), dtype=torch.bool),
                        logps=-torch.ones(ids.shape),
                        texts=[f"{tag}{p}/{j}" for p in range(len(group_rewards)) for j in range(G)],
                        reward_per_func=rewards[None, :].clone(), rewards=rewards),
    )


@pytest.fixture(autouse=True)
def fresh_notice(monkeypatch):
    monkeypatch.setattr(informative, "NOTICE", informative._Notice())


def test_informative_groups_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 0.0, 0.3, 0.3 + 1e-12])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]  # NaN counts as 0


def test_all_equal_groups_are_dropped_and_refilled():
    first = make_round("a", [[1, 1], [0, 1], [0, 0], [1, 0]], width=3)  # a0 and a2 all equal
    later = iter([make_round("b", [[0, 0], [1, 0]], width=5), make_round("c", [[0, 1], [1, 0]], width=2)])
    batch, stats = fill_informative(first, lambda: next(later), num_prompts=4, num_generations=G,
                                    max_resample_times=5, pad_token_id=-1)
    assert batch.prompts == ["a1", "a3", "b1", "c0"]  # informative groups in the order drawn
    assert stats.rounds == 3 and stats.resampled_prompts == 4 and stats.kept_groups == 4
    assert stats.frac_reward_zero_std == 0.0 and stats.frac_reward_zero_std_drawn == [0.5, 0.5, 0.0]
    assert batch.rollout.rewards.tolist() == [0, 1, 1, 0, 1, 0, 0, 1]
    assert batch.rollout.texts == ["a1/0", "a1/1", "a3/0", "a3/1", "b1/0", "b1/1", "c0/0", "c0/1"]
    # every per-completion tensor follows its rows; widths padded to the longest round (5)
    ids = batch.rollout.completion_ids
    assert ids.shape == (8, 5)
    assert ids[:, 0].tolist() == [10, 11, 30, 31, 10, 11, 0, 1]
    assert ids[0].tolist() == [10, 10, 10, -1, -1] and ids[4].tolist() == [10] * 5 and ids[6].tolist() == [0, 0, -1, -1, -1]
    assert batch.rollout.completion_mask.sum(1).tolist() == [3, 3, 3, 3, 5, 5, 2, 2]
    assert batch.rollout.logps.sum(1).tolist() == [-3, -3, -3, -3, -5, -5, -2, -2]
    assert batch.rollout.reward_per_func.tolist() == [batch.rollout.rewards.tolist()]
    assert stats.metrics()["dynamic/resampled_prompts"] == 4.0


def test_no_resampling_when_the_first_round_is_informative():
    first = make_round("a", [[0, 1], [1, 0]], width=3)

    def draw():
        raise AssertionError("no extra round is needed")

    batch, stats = fill_informative(first, draw, num_prompts=2, num_generations=G, max_resample_times=3)
    assert batch.prompts == ["a0", "a1"] and stats.rounds == 1 and stats.resampled_prompts == 0


def test_the_bound_holds_and_the_step_goes_on_saying_so_once():
    draws = []

    def draw():  # a dataset too easy: every group all correct, forever
        draws.append(1)
        return make_round(f"r{len(draws)}", [[1, 1], [1, 1]], width=2)

    first = make_round("a", [[1, 1], [0, 1]], width=2)
    with pytest.warns(UserWarning, match=r"after 3 extra rollout rounds .* only 1 of 2 prompt groups"):
        batch, stats = fill_informative(first, draw, num_prompts=2, num_generations=G, max_resample_times=3)
    assert len(draws) == 3 and stats.rounds == 4 and stats.resampled_prompts == 6
    # the informative group, topped up with the earliest all-equal one: the batch keeps its shape
    assert batch.prompts == ["a0", "a1"] and stats.kept_groups == 1 and stats.frac_reward_zero_std == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second short step is only logged
        fill_informative(make_round("x", [[1, 1], [1, 1]], width=2), draw, num_prompts=2, num_generations=G,
                         max_resample_times=1)
    with pytest.raises(ValueError, match="max_resample_times"):
        fill_informative(first, draw, num_prompts=2, num_generations=G, max_resample_times=-1)


def test_real_rollouts_of_an_untrained_model_are_refilled_up_to_the_bound(tmp_path):
    """Real tiny Qwen2-VL rollouts scored by the real `answer_format` reward: a random model never
    writes <answer>...</answer>, so every group is all-equal and the bound stops the step."""
    from mmgrpo.config import TrainConfig
    from mmgrpo.rollout.base import SamplingParams
    from mmgrpo.rollout.rounds import score
    from mmgrpo.training.build import build_run

    run = build_run(TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", "answer_format",
        "--num_generations", str(G), "--per_device_train_batch_size", "4", "--dataloader_num_workers", "0",
        "--beta", "0", "--report_to", "none", "--output_dir", str(tmp_path / "run"),
    ]))  # fmt: skip
    dataset, template = run.dataset, run.template
    drawn = iter(range(0, 40, 2))
    torch.manual_seed(0)

    def draw() -> Round:
        start = next(drawn)
        prompts = [(dataset[i], template.encode_prompt(dataset[i].load_media())) for i in (start, start + 1)]
        rollout = run.rollout.generate([enc for _, enc in prompts], SamplingParams(num_generations=G, max_new_tokens=4 + start))
        return Round(prompts, score(run.rewards, run.template, prompts, rollout))  # widths differ per round

    with pytest.warns(UserWarning, match="only 0 of 2"):
        batch, stats = fill_informative(draw(), draw, num_prompts=2, num_generations=G, max_resample_times=2,
                                        pad_token_id=template.completion_pad_id)
    assert stats.rounds == 3 and stats.frac_reward_zero_std_drawn == [1.0, 1.0, 1.0]
    assert [s.id for s, _ in batch.prompts] == ["shapes-color/train/0", "shapes-color/train/1"]
    assert batch.rollout.completion_ids.shape[0] == 4 and batch.rollout.completion_ids.shape[1] <= 4  # round 0's


def _rank_worker(rank: int, world_size: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    def any_rank(flag: bool) -> bool:
        value = torch.tensor([float(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value[0])

    def min_across_ranks(count: int) -> int:
        value = torch.tensor([count])
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value[0])

    draws = []

    def draw():
        draws.append(1)
        dist.barrier()  # a rollout may run collectives: every rank must be in it
        # rank 0 finds informative groups at once; rank 1 only all-equal ones
        return make_round(f"r{len(draws)}", [[0, 1], [1, 0]] if rank == 0 else [[1, 1], [1, 1]], width=2)

    first = make_round("a", [[1, 1], [1, 1]] if rank == 0 else [[0, 1], [1, 1]], width=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch, stats = fill_informative(first, draw, num_prompts=2, num_generations=G, max_resample_times=2,
                                        any_rank=any_rank, min_across_ranks=min_across_ranks)
    results[rank] = (len(draws), len(batch.prompts), stats.kept_groups)
    dist.destroy_process_group()


def test_ranks_run_the_same_rounds_and_keep_the_same_number_of_groups():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.start_processes(_rank_worker, args=(2, port, results), nprocs=2, join=True, start_method="spawn")
    # rank 0 is full after one extra round, but rank 1 is not: both roll out twice (the bound)
    assert dict(results) == {0: (2, 2, 2), 1: (2, 2, 1)}
