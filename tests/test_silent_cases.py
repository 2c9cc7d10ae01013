"""Input that used to pass silently or end in a traceback: each is now one clear error (or, where
a choice is useful, a documented flag). A row without a reference answer follows one rule for every
reward (`--missing_solution`); a dataset given twice in a mixture, `mmgrpo eval --limit 0`, an eval of
a folder without weights and audio clips too short for the encoder are errors naming what to fix.
(`--top_p` / `--top_k` outside their ranges: tests/test_preflight.py.)"""

import json
import shutil

import numpy as np
import pytest
import soundfile
import torch

from mmgrpo.cli import main as cli_main
from mmgrpo.config import TrainConfig
from mmgrpo.data.catalog import mix_datasets, resolve_dataset
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.rewards.reward_set import build_rewards
from mmgrpo.rewards.solutions import needs_solution, rows_without_solution
from mmgrpo.training.startup_checks import check_train_flags

NEED_SOLUTION = ["vqa_accuracy", "exact_match", "iou", "math_accuracy"]  # four behaviours before: 0.0, 0.0, raise, skip


def cli(capsys, *argv) -> tuple[int, str]:
    """`mmgrpo ...` in this process: (exit status, stderr)."""
    try:
        cli_main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def rows_with_gaps(folder, count=8, gaps=(2, 5)):
    """A JSONL of shapes-color rows, `gaps` without a solution (one None, one absent)."""
    source = resolve_dataset("shapes-color")
    path = folder / "gaps.jsonl"
    with open(path, "w") as f:
        for i, row in enumerate(source.rows.select(range(count))):
            row["images"] = [f"{source.media_root}/{image}" for image in row["images"]]
            if i == gaps[0]:
                row["solution"] = None
            elif i in gaps:
                del row["solution"]
            f.write(json.dumps(row) + "\n")
    return path


def train_config(tmp_path, *flags):
    return TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--num_generations", "2", "--per_device_train_batch_size", "4",
        "--max_completion_length", "4", "--max_steps", "2", "--dataloader_num_workers", "0", "--report_to", "none",
        "--output_dir", str(tmp_path / "run"), *flags,
    ])


# ---- rows without a solution: one rule ------------------------------------------------------------


def test_the_rewards_that_grade_against_a_reference_are_known():
    from mmgrpo.rewards import get_reward

    assert all(needs_solution(get_reward(name)) for name in [*NEED_SOLUTION, "giou", "iou@0.5", "number_closeness", "cosine"])
    assert not any(needs_solution(get_reward(name)) for name in ["format", "answer_format", "repetition"])


def test_rows_without_a_solution_stop_the_run_at_start_up_naming_them(tmp_path):
    data = rows_with_gaps(tmp_path)
    assert rows_without_solution(resolve_dataset(str(data))) == [2, 5]
    cfg = train_config(tmp_path, "--dataset", str(data), "--reward_funcs", *NEED_SOLUTION, "format")
    check_train_flags(cfg)
    with pytest.raises(DataError) as raised:
        build_rewards(cfg.algo, resolve_dataset(str(data)), cfg.rollout.max_completion_length)  # what build_run does first, before any model loads
    message = str(raised.value)
    assert message.startswith("dataset gaps (split train): 2 of 8 rows have no solution (gaps/train/2, gaps/train/5)")
    assert "vqa_accuracy, exact_match, iou, math_accuracy need to grade" in message and "--missing_solution skip" in message
    # a run whose rewards need no solution takes the same rows
    cfg = train_config(tmp_path, "--dataset", str(data), "--reward_funcs", "format")
    build_rewards(cfg.algo, resolve_dataset(str(data)), cfg.rollout.max_completion_length)


def test_with_skip_every_reward_scores_a_missing_solution_none_and_the_step_counts_them(tmp_path):
    data = rows_with_gaps(tmp_path)
    cfg = train_config(tmp_path, "--dataset", str(data), "--reward_funcs", *NEED_SOLUTION, "answer_format",
                       "--missing_solution", "skip")
    rewards = build_rewards(cfg.algo, resolve_dataset(str(data)), cfg.rollout.max_completion_length)
    answers = ["<answer>[0, 0, 10, 10]</answer>", "<answer>[1, 2, 3, 4]</answer>", "<answer>[0, 0, 10, 5]</answer>"]
    columns = {"solution": [[0, 0, 10, 10], None, [0, 0, 10, 10]], "sample_id": ["gaps/train/0", "gaps/train/2", "gaps/train/3"]}
    per_func, total = rewards(answers, columns)  # [5, 3], [3]
    assert per_func[:4, 1].isnan().all()  # each of the four: skipped, neither 0.0 nor an error
    assert per_func[4, 1] == 1.0  # answer_format needs no solution: scored
    assert per_func[2, 0] == 1.0 and per_func[2, 2] == 0.5  # the rows with one are graded as always (IoU)
    assert rewards.stats() == {"reward/missing_solution": 1}
    assert total[1] == 1.0


def test_a_run_with_skip_trains_and_logs_the_count(tmp_path):
    data = rows_with_gaps(tmp_path, gaps=(0, 1))  # half of the rows: every step draws some
    out = train(train_config(tmp_path, "--dataset", str(data), "--reward_funcs", "vqa_accuracy", "format",
                             "--missing_solution", "skip"))
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [1, 2]
    assert all("reward/missing_solution" in row for row in logged)


# ---- mixtures, eval counts, eval folders -----------------------------------------------------------


def test_a_dataset_given_twice_in_a_mixture_is_refused():
    with pytest.raises(ConfigError, match=r"--dataset gives shapes-color \(split train\) twice: 'shapes-color' and "
                                          r"'shapes-color:0.5'; .*\(e\.g\. shapes-color:2\)"):
        mix_datasets(["shapes-color", "shapes-color:0.5"])
    mixture = mix_datasets(["shapes-color:train", "shapes-color:test"])  # two splits are two datasets
    assert len(mixture.sources) == 2


def test_eval_of_zero_samples_is_an_error(capsys, tmp_path):
    code, err = cli(capsys, "eval", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--limit", "0",
                    "--output_dir", str(tmp_path / "eval"))
    assert code == 2 and err.strip() == "mmgrpo eval: error: --limit 0: must be at least 1 (leave it out to evaluate every sample)."
    assert not (tmp_path / "eval").exists()


def test_eval_of_a_folder_without_weights_is_one_line(capsys, tmp_path, tiny_qwen2_vl_path):
    folder = tmp_path / "checkpoint-4"  # a training checkpoint whose model.safetensors is gone; optimizer.pt stays
    shutil.copytree(tiny_qwen2_vl_path, folder)
    (folder / "model.safetensors").unlink()
    torch.save({}, folder / "optimizer.pt")
    code, err = cli(capsys, "eval", "--model", str(folder), "--dataset", "shapes-color", "--limit", "1",
                    "--output_dir", str(tmp_path / "eval"))
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (f"mmgrpo eval: error: model folder {folder}: config.json but no weights file (model.safetensors); "
                           "re-save or copy the folder again, or load an earlier checkpoint")


# ---- audio too short for the encoder ---------------------------------------------------------------


@pytest.mark.parametrize("seconds, message", [
    (0.0, r"field 'audios\[0\]': .*clip.wav has no samples \(0 s of audio\); replace the file or drop the row"),
    (0.01, r"audio clip 1 is 10 ms long, shorter than the 30 ms the audio encoder needs for one token; drop the row"),
])
def test_an_audio_clip_too_short_for_the_encoder_names_the_sample(tmp_path, seconds, message):
    soundfile.write(tmp_path / "clip.wav", np.zeros(int(16000 * seconds), np.float32), 16000)
    good = tmp_path / "good.wav"
    soundfile.write(good, np.random.default_rng(0).uniform(-0.1, 0.1, 16000).astype(np.float32), 16000)
    rows = [{"query": "<audio>What is it?", "audios": [str(good if i else tmp_path / "clip.wav")], "solution": "noise"}
            for i in range(4)]
    (tmp_path / "audio.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = train_config(tmp_path, "--model", "tiny:qwen2-audio", "--dataset", str(tmp_path / "audio.jsonl"),
                       "--reward_funcs", "format", "--seed", "1")
    with pytest.raises(DataError, match=r"^sample audio/train/0(:|, ).*" + message):
        train(cfg)


# ---- a run without any learning signal says so ------------------------------------------------------


def test_a_run_whose_groups_never_differ_says_why_once(tmp_path, capsys):
    """`format` wants <think>..</think><answer>..</answer>: a random tiny model never writes it, every
    reward is 0, the advantages and the loss are 0 for every step; the run says so after 5 steps (once)."""
    cfg = train_config(tmp_path, "--dataset", "shapes-color", "--reward_funcs", "format", "--max_steps", "6",
                       "--save_strategy", "no")
    train(cfg)
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["frac_reward_zero_std"] == 1.0 and row["loss"] == 0 for row in rows)
    assert err.count("no group had any reward variance") == 1
    assert "steps 1-5: no group had any reward variance" in " ".join(err.split()) and "format" in err
