"""cosine, repetition and soft_overlong: hand-computed values, --reward_kwargs, and a real training step."""

import json
import math

import pytest

from mmgrpo.config import TrainConfig
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError
from mmgrpo.rewards import get_reward
from mmgrpo.rewards.length import cosine, cosine_schedule, soft_overlong
from mmgrpo.rewards.options import bind_options, parse_reward_kwargs
from mmgrpo.rewards.repetition import repetition

FAST = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--dataloader_num_workers", "0",
        "--report_to", "none"]


def test_cosine_follows_the_half_cosine_between_its_end_values():
    # length 25 of 100: cos(pi/4) = 0.7071 -> 0.5 + 0.5 * 0.5 * 1.7071 = 0.92678
    assert cosine_schedule(25, 100, 1.0, 0.5) == pytest.approx(0.5 + 0.25 * (1 + math.cos(math.pi / 4)))
    values = cosine(["<answer>4</answer>", "<answer>5</answer>", "<answer>4</answer>"], solution=["4", "4", "4"],
                    completion_ids=[[0] * 25, [0] * 25, [0] * 400], cosine_max_len=100, cosine_accuracy="exact_match")
    assert values[0] == pytest.approx(0.926777, abs=1e-6)
    assert values[1] == pytest.approx(-0.5 * 0.5 * (1 - math.cos(math.pi / 4)), abs=1e-9)  # wrong: 0 -> -0.5
    assert values[2] == 0.5  # past cosine_max_len: the end value


def test_cosine_defaults_to_the_runs_max_completion_length_and_math_accuracy():
    values = cosine(["<answer>1/2</answer>"], solution=["0.5"], completion_ids=[[0] * 8], max_completion_length=8)
    assert values == [0.5]  # math_verify: 1/2 == 0.5, at full length
    with pytest.raises(ValueError, match="completion_ids"):
        cosine(["x"], solution=["x"], cosine_max_len=8)


def test_repetition_penalises_repeated_ngrams_only():
    assert repetition(["one two three four five six"]) == [0.0]
    assert repetition(["la la la la la"]) == [pytest.approx(-2 / 3)]  # 3 trigrams, 1 distinct
    assert repetition(["short"], repetition_n_grams=3) == [0.0]
    with pytest.raises(ValueError, match="repetition_max_penalty"):
        repetition(["a"], repetition_max_penalty=0.5)


def test_soft_overlong_by_tokens():
    assert soft_overlong(["", "", ""], completion_ids=[[0] * 4, [0] * 7, [0] * 9], soft_max_length=8,
                         soft_cache_length=2) == [0.0, -0.5, -1.0]


def test_reward_kwargs_bind_options_and_reject_unknown_ones():
    assert parse_reward_kwargs('{"repetition": {"repetition_n_grams": 2}}') == {"repetition": {"repetition_n_grams": 2}}
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_reward_kwargs("{repetition: 2}")
    with pytest.raises(ConfigError, match="It takes: repetition_max_penalty, repetition_n_grams"):
        bind_options(get_reward("repetition"), "repetition", {"ngram": 2})
    bound = bind_options(get_reward("soft_overlong"), "soft_overlong", {"soft_cache_length": 2}, {"max_completion_length": 4})
    assert bound([""], completion_ids=[[0] * 3]) == [-0.5]


def test_a_training_step_passes_completion_ids_to_the_length_rewards(tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig.from_args([
        *FAST, "--reward_funcs", "soft_overlong", "cosine", "repetition", "--max_steps", "1", "--output_dir", str(out),
        "--reward_kwargs", json.dumps({"soft_overlong": {"soft_cache_length": 4}, "cosine": {"cosine_accuracy": "exact_match"}}),
    ])
    train(cfg)
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    soft = [v for r in records for v in r["rewards"]["soft_overlong"]]
    assert all(-1.0 <= v <= 0.0 for v in soft) and not math.isnan(metrics["reward/soft_overlong"])
    # a random policy at --max_completion_length 8 mostly runs to the limit: -1 there
    assert min(soft) == -1.0
    assert all(-0.5 <= v <= 1.0 for r in records for v in r["rewards"]["cosine"])
    assert "reward/repetition" in metrics


def test_reward_kwargs_for_a_reward_not_in_the_run_is_a_start_up_error(tmp_path):
    from mmgrpo.rewards.reward_set import bound_rewards

    cfg = TrainConfig.from_args([*FAST, "--reward_funcs", "format", "--reward_kwargs", '{"cosine": {}}'])
    with pytest.raises(ConfigError, match="--reward_kwargs names cosine"):
        bound_rewards(cfg.algo, cfg.algo.reward_funcs, cfg.rollout.max_completion_length)
