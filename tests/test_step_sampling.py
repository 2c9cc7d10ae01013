"""The training loop's sampling options on the tiny Qwen2-VL, with real rollouts and rewards:

- --dynamic_sample: a batch of all-equal groups is refilled from new prompts; on data that never
  gives a differing group the step stops after --max_resample_times rounds and says so once;
- --first_stage_generations K: settled prompts get no more completions, the others complete their
  group of G (their K first completions kept, in place);
- --dynamic_modality_weights: the rule of mmgrpo/grpo/dynamic_weights.py, and its weights in the log;
- the new flags off, a step's metrics hold none of their keys.
"""

import json
import warnings

import pytest
import torch

from mmgrpo.config import TrainConfig
from mmgrpo.engine import rollout_setup, train
from mmgrpo.errors import ConfigError
from mmgrpo.grpo.dynamic_weights import DynamicWeights
from mmgrpo.rollout import dynamic_sample as informative
from mmgrpo.rollout.base import sampling_params
from mmgrpo.rollout.rounds import complete_batch, score, settled_prompts
from mmgrpo.training.build import build_run

REWARDS = '''
def always_one(completions, **columns):
    return [1.0 for _ in completions]

def first_of_group(completions, sample_id, **columns):
    # 1 for prompts of even row id, for every completion (all-equal groups), else the text's parity
    return [1.0 if int(i.rsplit("/", 1)[1]) % 2 == 0 else float(len(c) % 2) for c, i in zip(completions, sample_id)]
'''


@pytest.fixture(autouse=True)
def fresh_notice(monkeypatch):
    monkeypatch.setattr(informative, "NOTICE", informative._Notice())


def config(tmp_path, reward: str, *extra) -> TrainConfig:
    plugin = tmp_path / "rewards.py"
    plugin.write_text(REWARDS)
    return TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", f"{plugin}:{reward}",
        "--num_generations", "4", "--per_device_train_batch_size", "16",  # B = 4 prompts
        "--max_completion_length", "6",
        "--dataloader_num_workers", "0", "--beta", "0", "--max_steps", "2", "--report_to", "none",
        "--output_dir", str(tmp_path / "run"), *extra,
    ])  # fmt: skip


def metrics_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_too_easy_data_ends_after_max_resample_times_and_says_so_once(tmp_path):
    with pytest.warns(UserWarning, match="dynamic sampling: after 2 extra rollout rounds") as caught:
        out = train(config(tmp_path, "always_one", "--dynamic_sample", "--max_resample_times", "2"))
    assert sum("dynamic sampling" in str(w.message) for w in caught) == 1  # two short steps, one notice
    for m in metrics_of(out):
        assert m["dynamic/rounds"] == 3 and m["dynamic/resampled_prompts"] == 8  # 2 extra rounds of B=4
        assert m["dynamic/kept_groups"] == 0 and m["frac_reward_zero_std"] == 1.0
        assert m["micro_batches"] == 1 and m["reward"] == 1.0  # topped up to B groups of G (16 rows): the usual shape


def test_all_equal_groups_are_refilled_from_new_prompts(tmp_path):
    cfg = config(tmp_path, "first_of_group", "--dynamic_sample", "--max_resample_times", "6")
    run = build_run(cfg)
    batches = run.prompt_batches()
    prompts = next(batches)
    rollout = run.rollout.generate([e for _, e in prompts], sampling_params(cfg.rollout, seed=0))
    kept, rollout, stats = complete_batch(rollout_setup(run), prompts, score(run.rewards, run.template, prompts, rollout),
                                          batches, step=1)
    per_func, rewards = rollout.reward_per_func, rollout.rewards
    assert stats["dynamic/frac_reward_zero_std_first_round"] >= 0.5  # the even rows: all-equal groups
    assert len(kept) == 4 and rollout.completion_ids.shape[0] == 16
    groups = rewards.view(4, 4)
    informative = groups.std(dim=1) > 0
    assert informative.sum() == stats["dynamic/kept_groups"]
    if stats["dynamic/kept_groups"] == 4:  # the usual case: every all-equal group was replaced
        assert all(int(s.id.rsplit("/", 1)[1]) % 2 == 1 for s, _ in kept)
        assert stats["dynamic/rounds"] > 1 and stats["dynamic/resampled_prompts"] >= 4
    assert stats["dynamic/rounds"] <= 7
    texts = run.template.decode(rollout.completion_ids, rollout.completion_mask)  # rows follow their rewards
    expected = [1.0 if int(s.id.rsplit("/", 1)[1]) % 2 == 0 else float(len(t) % 2) for (s, _), t in
                zip([p for p in kept for _ in range(4)], texts)]
    assert rewards.tolist() == expected and per_func[0].tolist() == expected


def test_a_mixture_is_refilled_from_its_own_stream(tmp_path):
    cfg = config(tmp_path, "first_of_group", "--dynamic_sample", "--max_resample_times", "6",
                 "--dataset", "shapes-color:1", "shapes-count:1")
    run = build_run(cfg)
    batches = run.prompt_batches()
    prompts = next(batches)
    rollout = run.rollout.generate([e for _, e in prompts], sampling_params(cfg.rollout, seed=0))
    kept, rollout, stats = complete_batch(rollout_setup(run), prompts, score(run.rewards, run.template, prompts, rollout),
                                          batches, step=1)
    rewards = rollout.rewards
    assert stats["dynamic/kept_groups"] == 4 and stats["dynamic/resampled_prompts"] >= 4
    assert rewards.view(4, 4).std(dim=1).gt(0).all()  # every kept group differs
    assert all(int(s.id.rsplit("/", 1)[1]) % 2 == 1 for s, _ in kept)  # odd rows: the informative ones
    # the refills come from the run's mixture, both datasets (seeded: the same draw every run)
    assert {s.id.split("/")[0] for s, _ in kept} == {"shapes-color", "shapes-count"}


def test_two_stage_completes_only_the_open_groups(tmp_path):
    cfg = config(tmp_path, "first_of_group", "--first_stage_generations", "2")
    assert sampling_params(cfg.rollout).num_generations == 2
    run = build_run(cfg)
    batches = run.prompt_batches()
    prompts = next(batches)
    rollout = run.rollout.generate([e for _, e in prompts], sampling_params(cfg.rollout, seed=0))
    first_texts = run.template.decode(rollout.completion_ids, rollout.completion_mask)
    first_rewards = [1.0 if int(s.id.rsplit("/", 1)[1]) % 2 == 0 else float(len(t) % 2)
                     for (s, _), t in zip([p for p in prompts for _ in range(2)], first_texts)]
    settled = settled_prompts(torch.tensor(first_rewards), 2).tolist()
    kept, out, stats = complete_batch(rollout_setup(run), prompts, score(run.rewards, run.template, prompts, rollout),
                                      batches, step=1)
    open_ids = [s.id for (s, _), done in zip(prompts, settled) if not done] or [prompts[0][0].id]
    assert [s.id for s, _ in kept] == open_ids
    assert stats["two_stage/settled_prompts"] == sum(settled)
    assert stats["two_stage/saved_completions"] == (4 - len(open_ids)) * 2
    texts = run.template.decode(out.completion_ids, out.completion_mask)
    assert len(texts) == 4 * len(open_ids)  # complete groups of G
    for p, sample_id in enumerate(open_ids):  # the K first completions lead their group
        q = [s.id for s, _ in prompts].index(sample_id)
        assert texts[4 * p: 4 * p + 2] == first_texts[2 * q: 2 * q + 2]


def test_two_stage_and_dynamic_sampling_train(tmp_path):
    out = train(config(tmp_path, "first_of_group", "--first_stage_generations", "2", "--dynamic_sample",
                       "--max_resample_times", "3", "--log_completions", "8"))
    metrics = metrics_of(out)
    assert len(metrics) == 2 and all(m["dynamic/rounds"] <= 4 and "time/resample" in m for m in metrics)
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert all(len(r["completions"]) == 4 for r in records)


def test_flags_off_leave_the_step_alone(tmp_path):
    out = train(config(tmp_path, "first_of_group", "--max_steps", "1"))
    (m,) = metrics_of(out)
    assert not [k for k in m if k.startswith(("dynamic/", "two_stage/", "weights/")) or k == "time/resample"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--max_resample_times", "-1"], "--max_resample_times -1: give an integer >= 0"),
    (["--first_stage_generations", "4"], "--first_stage_generations 4: give 0 .* from 1 to --num_generations - 1 \\(3\\)"),
    (["--dynamic_weights_by", "task"], "dynamic_weights_by"),
])  # fmt: skip
def test_bad_flags_are_config_errors(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, "always_one", *flags).validate()


def test_dynamic_weights_rule():
    rule = DynamicWeights()
    weights, logged = rule(["image"] * 2 + ["video"] * 2, torch.tensor([1.0, -1.0, 0.25, -0.25]))
    assert logged == {"weights/image": 0.625, "weights/video": 2.5}  # mean 0.625 / e_m
    # a moving average: one step of equal signal moves the weights only a tenth of the way
    _, logged = rule(["image"] * 2 + ["video"] * 2, torch.tensor([0.5, -0.5, 0.5, -0.5]))
    e_image, e_video = 0.9 * 1 + 0.1 * 0.5, 0.9 * 0.25 + 0.1 * 0.5
    assert logged["weights/image"] == pytest.approx((e_image + e_video) / 2 / e_image)
    # bounded: a modality without signal is not scaled past 4
    weights, logged = DynamicWeights()(["a", "a", "b", "b"], torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert logged == {"weights/a": 0.5, "weights/b": 4.0} and weights.tolist() == [0.5, 0.5, 4.0, 4.0]


def test_dynamic_weights_by_dataset_are_logged(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = train(config(tmp_path, "first_of_group", "--dataset", "shapes-color:1", "shapes-count:1",
                           "--dynamic_modality_weights", "--dynamic_weights_by", "dataset"))
    for m in metrics_of(out):
        named = {k: v for k, v in m.items() if k.startswith("weights/")}
        assert set(named) <= {"weights/shapes-color", "weights/shapes-count"} and named
        assert all(0.25 <= v <= 4 for v in named.values())


def test_dynamic_sampling_with_async_rollouts(tmp_path):
    """The refill rounds run after the rollout begun last step is collected and before the next begins."""
    out = train(config(tmp_path, "first_of_group", "--dynamic_sample", "--max_resample_times", "2", "--async_generate",
                       "--max_steps", "3"))
    metrics = metrics_of(out)
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]
    assert all(1 <= m["dynamic/rounds"] <= 3 for m in metrics)


def test_extra_rounds_respect_the_staleness_bound(tmp_path):
    """--max_staleness 2: the extra rounds (refills, second stages) run after the rollouts asked
    before them, on the newest weights, so a batch mixes completions 0 and 2 steps back, never more."""
    out = train(config(tmp_path, "first_of_group", "--dynamic_sample", "--max_resample_times", "2",
                       "--first_stage_generations", "2", "--max_staleness", "2", "--max_steps", "4"))
    metrics = metrics_of(out)
    assert [m["rollout/staleness"] for m in metrics][:2] == [0, 1]
    for m in metrics:
        shares = [m[f"staleness/share_{k}"] for k in range(3)]
        assert sum(shares) == pytest.approx(1.0) and m["rollout/staleness"] <= 2
    # the step's own rollout 2 steps back, refills and second stages on the newest weights beside it
    assert any(m["staleness/share_0"] > 0 and m["staleness/share_2"] > 0 for m in metrics[2:]), metrics
