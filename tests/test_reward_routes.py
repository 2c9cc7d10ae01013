"""--reward_funcs DATASET:REWARD: a reward scoped to one dataset of a mixture scores only that
dataset's rows (None elsewhere); unscoped entries and plugins score every row."""

import json

import pytest

from mmgrpo.cli import main as cli_main
from mmgrpo.config import TrainConfig
from mmgrpo.data.catalog import mix_datasets
from mmgrpo.errors import ConfigError
from mmgrpo.rewards.reward_set import build_rewards, scoped_entries

MIXTURE = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-ground", "shapes-color", "--num_generations", "2",
           "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--dataloader_num_workers", "0"]

BREVITY = '''
def brevity(completions, **columns):
    return [1.0 / (1 + len(c)) for c in completions]
'''


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_entries_split_on_a_dataset_name_only():
    datasets = ["shapes-ground", "shapes-color"]
    assert scoped_entries(["shapes-ground:iou", "iou@0.5", "my_rewards.py:brevity", "shapes-color:my.py:fn"],
                          datasets) == [("shapes-ground", "iou"), (None, "iou@0.5"), (None, "my_rewards.py:brevity"),
                                        ("shapes-color", "my.py:fn")]


def test_scoped_rewards_score_only_their_datasets_rows(tmp_path):
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(BREVITY)
    out = tmp_path / "run"
    cli_main(["train", *MIXTURE, "--reward_funcs", "shapes-ground:iou", "shapes-color:vqa_accuracy",
              f"{plugin}:brevity", "--reward_weights", "1", "1", "0.5", "--max_steps", "2",
              "--log_completions", "8", "--output_dir", str(out)])
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward/iou", "reward/vqa_accuracy", "reward/brevity"):
        assert key in metrics[-1], key
    records = read_jsonl(out / "completions.jsonl")
    seen = set()
    for record in records:
        dataset = record["sample_id"].rsplit("/", 2)[0]
        seen.add(dataset)
        rewards = record["rewards"]
        assert all(v is not None for v in rewards["brevity"])
        assert all((v is not None) == (dataset == "shapes-ground") for v in rewards["iou"]), record["sample_id"]
        assert all((v is not None) == (dataset == "shapes-color") for v in rewards["vqa_accuracy"]), record["sample_id"]
    assert seen == {"shapes-ground", "shapes-color"}


def test_a_scope_outside_the_mixture_is_one_config_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", *MIXTURE, "--reward_funcs", "shapes-count:vqa_accuracy", "answer_format",
                  "--max_steps", "1", "--output_dir", str(tmp_path / "run")])
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "'shapes-count' is not a dataset of this run" in message
    assert "shapes-ground" in message and "shapes-color" in message


def test_a_dataset_left_without_rewards_is_named(tmp_path):
    cfg = TrainConfig.from_args([*MIXTURE, "--reward_funcs", "shapes-ground:iou", "--output_dir", str(tmp_path)])
    dataset = mix_datasets(cfg.data.dataset, split=cfg.data.split, seed=cfg.seed)
    with pytest.raises(ConfigError, match="shapes-color.*shapes-color:answer_format shapes-color:vqa_accuracy"):
        build_rewards(cfg.algo, dataset, cfg.rollout.max_completion_length)


def test_one_unscoped_list_runs_each_reward_only_where_it_can_score(tmp_path, capsys):
    """`--reward_funcs iou vqa_accuracy answer_format` on grounding + VQA: iou skips the VQA rows (their
    references hold no box) and vqa_accuracy the grounding rows, each said in one line; format scores every row."""
    cfg = TrainConfig.from_args([*MIXTURE, "--reward_funcs", "iou", "vqa_accuracy", "answer_format",
                                 "--output_dir", str(tmp_path)])
    dataset = mix_datasets(cfg.data.dataset, split=cfg.data.split, seed=cfg.seed)
    rewards = build_rewards(cfg.algo, dataset, cfg.rollout.max_completion_length)
    assert rewards.routes == {"shapes-ground": ["iou", "answer_format"], "shapes-color": ["vqa_accuracy", "answer_format"]}
    err = capsys.readouterr().err
    assert "vqa_accuracy not run on shapes-ground's rows (its references are boxes)" in err
    assert "iou not run on shapes-color's rows (its references are not boxes)" in err
    boxes_only = TrainConfig.from_args([*MIXTURE, "--reward_funcs", "giou", "--output_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="none of them can score shapes-color's rows .*shapes-color:vqa_accuracy"):
        build_rewards(boxes_only.algo, dataset, boxes_only.rollout.max_completion_length)
    single = mix_datasets(["shapes-color"], split="train")  # one dataset: the list is what the user asked, as given
    assert build_rewards(cfg.algo, single, cfg.rollout.max_completion_length).routes is None
