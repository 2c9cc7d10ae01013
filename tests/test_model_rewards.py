"""Reward models (a tiny sequence classifier) and the generative judge (the tiny Qwen2-VL): real models, real steps."""

import json
import logging
import math
import shutil

import pytest
from PIL import Image

from mmgrpo.config import TrainConfig
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError
from mmgrpo.models.tiny_reward import build_tiny_reward_model
from mmgrpo.rewards.judge import JudgeReward, parse_reply
from mmgrpo.rewards.reward_model import RewardModelReward
from mmgrpo.rewards.reward_set import build_rewards

FAST = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "2",
        "--per_device_train_batch_size", "4", "--max_completion_length", "6", "--dataloader_num_workers", "0",
        "--report_to", "none"]
PROMPT = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]


@pytest.fixture(scope="module")
def reward_model():
    return RewardModelReward("tiny:reward-qwen2", batch_size=2)


def test_a_reward_model_scores_prompt_and_completion_in_batches(reward_model):
    completions = ["<answer>red</answer>", "blue", "a much longer answer that pads the others"]
    batched = reward_model(completions, prompts=[PROMPT] * 3)
    alone = [reward_model([c], prompts=[PROMPT])[0] for c in completions]
    assert batched == pytest.approx(alone, abs=1e-5)  # padding does not change a score
    assert len(set(round(v, 6) for v in batched)) == 3
    # the prompt matters too: the model reads the conversation, rendered with its own chat template
    other = reward_model(completions[:1], prompts=[[{"role": "user", "content": "Count the dots."}]])
    assert other[0] != pytest.approx(batched[0], abs=1e-6)
    assert reward_model.reward_name == "reward_model:reward-qwen2"


def test_a_classifier_with_several_labels_is_a_start_up_error():
    path = build_tiny_reward_model(num_labels=3)
    with pytest.raises(ConfigError, match="has 3 labels; a reward model has one"):
        RewardModelReward(str(path))


def test_a_tokenizer_that_does_not_fit_is_a_start_up_error(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    folder = tmp_path / "rm"
    shutil.copytree(build_tiny_reward_model(), folder)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    tokenizer = AutoTokenizer.from_pretrained(folder)  # another model's, bigger tokenizer in its place
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(vocab)])
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError, match=rf"its tokenizer has \d+ tokens but the model embeds {vocab}"):
        RewardModelReward(str(folder))


def test_judge_replies_parse_by_the_documented_template():
    assert parse_reply("Looks right.\nScore: 10", "score", 10) == 1.0
    assert parse_reply("score = 3", "score", 5) == pytest.approx(0.6)
    assert parse_reply("Score: 4/8", "score", 10) == 0.5  # an explicit scale wins
    assert parse_reply("Score: -2", "score", 10) == 0.0  # clipped to [0, 1]
    assert parse_reply("Verdict: wrong", "verdict", 10) == 0.0 and parse_reply("verdict: Yes", "verdict", 10) == 1.0
    assert parse_reply("I think it is correct", "verdict", 10) is None  # no "Verdict:" line
    assert parse_reply("", "score", 10) is None


@pytest.fixture(scope="module")
def judge():
    return JudgeReward("tiny:qwen2-vl", max_new_tokens=8, batch_size=3)


def test_the_judge_sees_the_images_and_its_unparsable_replies_are_none_and_counted(judge, caplog):
    images = [Image.new("RGB", (56, 56), "red")]
    encoded = judge.judge_prompts(["<answer>red</answer>"], [PROMPT], [images], ["red"], ["s/0"])
    assert "pixel_values" in encoded[0].mm and encoded[0].images == images  # the image reaches the judge's model
    assert "Question: What colour is the shape?" in encoded[0].prompt_text and "Reference answer: red" in encoded[0].prompt_text
    with caplog.at_level(logging.WARNING, logger="mmgrpo.rewards"):
        scores = judge(["<answer>red</answer>", "blue", "green", "red"], prompts=[PROMPT] * 4, images=[images] * 4,
                       solution=["red"] * 4, sample_id=["s/0", "s/0", "s/1", "s/1"])
    assert len(scores) == 4 and all(s is None or 0.0 <= s <= 1.0 for s in scores)
    # a random tiny model writes no "Score: N": those replies are None, counted and logged, not a crash
    assert judge.last_unparsed == sum(s is None for s in scores)
    if judge.last_unparsed:
        assert "replies did not parse" in caplog.text
    assert judge.score_replies(["Score: 6", "gibberish"], ["a", "b"]) == [0.6, None] and judge.last_unparsed == 1


def test_a_bad_judge_prompt_is_a_start_up_error(tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_text("Grade {answer} against {reference}")
    with pytest.raises(ConfigError, match=r"\{question\}, \{reference\} and \{completion\}"):
        JudgeReward("tiny:qwen2-vl", prompt_file=str(bad))


def test_a_training_step_with_a_reward_model_and_a_judge(tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig.from_args([
        *FAST, "--reward_funcs", "answer_format", "--reward_model", "tiny:reward-qwen2", "--judge_model", "tiny:qwen2-vl",
        "--judge_max_new_tokens", "6", "--reward_weights", "0.5", "1.0", "2.0", "--max_steps", "1", "--output_dir", str(out),
    ])
    cfg.validate()
    train(cfg)
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert math.isfinite(metrics["reward/reward_model:reward-qwen2"]) and "reward/judge" in metrics
    assert "judge/unparsed" in metrics
    record = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    assert set(record["rewards"]) == {"answer_format", "reward_model:reward-qwen2", "judge"}
    # the total is the weighted sum over the rewards that scored (the judge's None counts as absent)
    for i, total in enumerate(record["reward"]):
        parts = [(w, record["rewards"][name][i]) for w, name in
                 zip([0.5, 1.0, 2.0], ["answer_format", "reward_model:reward-qwen2", "judge"])]
        assert total == pytest.approx(sum(w * v for w, v in parts if v is not None), abs=1e-5)


def test_reward_weights_must_cover_the_reward_models_too():
    cfg = TrainConfig.from_args([*FAST, "--reward_funcs", "format", "--reward_model", "tiny:reward-qwen2",
                                 "--reward_weights", "1.0"])
    cfg.validate()  # the count is checked where the rewards are built, once, before any reward model loads
    with pytest.raises(ConfigError, match=r"1 values for 2 rewards \(1 functions: format; 1 --reward_model\)"):
        build_rewards(cfg.algo, None, cfg.rollout.max_completion_length)
