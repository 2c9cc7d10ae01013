"""Before any model loads: the output folder (refused when another run is there, unless resuming or
overwriting), and every flag whose value cannot work, each an error naming the flag (exit 2)."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmgrpo.config import TrainConfig
from mmgrpo.errors import CheckpointError, ConfigError
from mmgrpo.runstate.checkpoint import save_atomically
from mmgrpo.runstate.state import TrainState
from mmgrpo.training.output_dir import preflight
from mmgrpo.training.resume import STATE_FILE
from mmgrpo.training.startup_checks import check_train_flags

ROOT = Path(__file__).resolve().parents[1]


def config(out, *flags):
    return TrainConfig.from_args(["--output_dir", str(out), *flags])


def fake_checkpoint(out, step, complete=True):
    """A training checkpoint folder (the marker and training_state.json are what preflight reads)."""

    def write(folder):
        (folder / STATE_FILE).write_text(json.dumps({"step": step}))

    if complete:
        save_atomically(out / f"checkpoint-{step}", write)
    else:
        (out / f"checkpoint-{step}").mkdir(parents=True)


def fake_run(out, steps=6):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text("seed: 0\n")
    lines = [json.dumps({"step": s, "reward": s / 10}) for s in range(1, steps + 1)]
    (out / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 7, "rew')  # torn by a kill
    (out / "completions.jsonl").write_text("".join(json.dumps({"step": s, "completions": []}) + "\n" for s in range(1, steps + 1)))
    (out / "events.out.tfevents.1.host").write_bytes(b"tb")
    (out / "eval" / "step-2").mkdir(parents=True)


def test_a_new_run_gets_an_absent_or_empty_folder(tmp_path):
    plan = preflight(config(tmp_path / "a" / "b"))
    assert plan.mode == "new" and (tmp_path / "a" / "b").is_dir() and plan.resume_step == 0
    assert preflight(config(tmp_path / "a" / "b")).mode == "new"


def test_a_folder_with_another_run_is_refused(tmp_path):
    fake_run(tmp_path)
    with pytest.raises(ConfigError, match=(
        rf"^--output_dir {tmp_path} is not empty \(checkpoint|config.yaml.*\): a second run there would mix with the "
        r"first. Pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace it, or another --output_dir.$"
    )):
        preflight(config(tmp_path))


def test_overwrite_deletes_the_earlier_runs_files_only(tmp_path):
    fake_run(tmp_path)
    fake_checkpoint(tmp_path, 4)
    (tmp_path / "notes.txt").write_text("mine")
    plan = preflight(config(tmp_path, "--overwrite_output_dir"))
    assert (tmp_path / "metrics.jsonl").exists()  # nothing deleted before the run starts writing
    plan.apply()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mmgrpo-run.lock", "notes.txt"]  # this run's lock
    plan.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_resume_latest_picks_the_newest_complete_checkpoint_and_trims_the_logs(tmp_path, caplog):
    fake_run(tmp_path)
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6, complete=False)  # killed while saving
    with caplog.at_level(logging.WARNING, logger="mmgrpo.runstate.checkpoint"):
        plan = preflight(config(tmp_path, "--resume_from_checkpoint", "latest"))
    assert "checkpoint-6: incomplete" in caplog.text
    assert plan.mode == "resume" and plan.resume_from == tmp_path / "checkpoint-4" and plan.resume_step == 4
    assert isinstance(plan.state, TrainState)
    plan.apply()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert [json.loads(line)["step"] for line in (tmp_path / "completions.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert (tmp_path / "checkpoint-6").exists()  # left alone: the resumed run saves over it atomically


def test_resume_errors(tmp_path):
    fake_run(tmp_path)
    with pytest.raises(ConfigError, match=f"--resume_from_checkpoint latest: no complete checkpoint in {tmp_path}"):
        preflight(config(tmp_path, "--resume_from_checkpoint", "latest"))
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    with pytest.raises(ConfigError, match="holds checkpoint-4, saved later by the run being resumed; the resumed run would overwrite"):
        preflight(config(tmp_path, "--resume_from_checkpoint", str(tmp_path / "checkpoint-2")))
    fake_checkpoint(tmp_path, 8, complete=False)
    with pytest.raises(CheckpointError, match="checkpoint-8 is incomplete .*the newest complete one is .*checkpoint-4"):
        preflight(config(tmp_path, "--resume_from_checkpoint", str(tmp_path / "checkpoint-8")))
    with pytest.raises(ConfigError, match="pass one of them"):
        check_train_flags(config(tmp_path, "--resume_from_checkpoint", "latest", "--overwrite_output_dir"))


def test_output_folders_that_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=f"--output_dir {tmp_path / 'file'} is a file, not a folder"):
        preflight(config(tmp_path / "file"))
    with pytest.raises(ConfigError, match=f"{tmp_path / 'file'} is a file, so no folder can be made under it"):
        preflight(config(tmp_path / "file" / "run"))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    unwritable = locked / "run" if os.geteuid() != 0 else Path("/sys/mmgrpo-test-run")  # root writes anywhere else
    with pytest.raises(ConfigError, match=f"--output_dir {unwritable} is not writable \\(.*\\): pick a folder you can write to"):
        preflight(config(unwritable))


@pytest.mark.parametrize("flags, message", [
    (["--max_completion_length", "0"], "--max_completion_length 0: give an integer >= 1."),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: give an integer >= 1."),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0: give an integer >= 1."),
    (["--learning_rate", "nan"], r"--learning_rate nan: give a finite number >= 0 \(e.g. 1e-6\)."),
    (["--learning_rate", "inf"], r"--learning_rate inf: give a finite number >= 0"),
    (["--learning_rate", "-0.001"], r"--learning_rate -0.001: give a finite number >= 0"),
    (["--learning_rate", "0"], r"--learning_rate 0.0: give a finite number > 0 \(e.g. 1e-6\)."),  # GRPO's; SFT takes 0
    (["--min_pixels", "50000", "--max_pixels", "1000"], "--min_pixels 50000 is above --max_pixels 1000: no image size satisfies both."),
    (["--max_pixels", "0"], "--max_pixels 0: give a number of pixels >= 1."),
    (["--reward_timeout", "-1"], r"--reward_timeout -1.0: give seconds >= 0 \(0: no limit\)."),
    (["--save_total_limit", "0"], r"--save_total_limit 0: give a number of checkpoints >= 1 \(or leave it unset to keep all\)."),
    (["--max_nonfinite_steps", "0"], "--max_nonfinite_steps 0: give an integer >= 1."),
    (["--top_p", "2"], r"--top_p 2.0: give a probability in \(0, 1\]"),
    (["--top_p", "0"], r"--top_p 0.0: give a probability in \(0, 1\]"),
    (["--top_k", "-5"], r"--top_k -5: give a number of tokens >= 0 \(0: no top-k filter\)."),
])
def test_flags_that_cannot_work_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        check_train_flags(TrainConfig.from_args(["--num_generations", "2", "--per_device_train_batch_size", "4", *flags]))


def train_cli(*flags, model=("--model", "tiny:qwen2-vl")):
    return subprocess.run([sys.executable, "-m", "mmgrpo", "train", *model, *flags], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("flags, message", [
    (["--max_completion_length", "0"], "mmgrpo train: error: --max_completion_length 0: give an integer >= 1."),
    (["--learning_rate", "nan"], "mmgrpo train: error: --learning_rate nan: give a finite number >= 0 (e.g. 1e-6)."),
    (["--min_pixels", "50000", "--max_pixels", "1000"], "mmgrpo train: error: --min_pixels 50000 is above --max_pixels 1000"),
    (["--learning", "1e-3"], "mmgrpo train: error: unrecognized arguments: --learning 1e-3"),  # no prefix expansion
    (["--per_device", "4"], "mmgrpo train: error: unrecognized arguments: --per_device 4"),
    (["--attn_implementation", "flash_attention_2"], "mmgrpo train: error: --attn_implementation flash_attention_2 "),
    (["--attn_implementation", "flash"], "mmgrpo train: error: --attn_implementation 'flash': choose one of sdpa, eager, flash_attention_2"),
])
def test_the_cli_exits_2_with_one_line_before_any_model_loads(tmp_path, flags, message):
    completed = train_cli("--output_dir", str(tmp_path / "run"), *flags)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1].startswith(message), completed.stderr[-1500:]
    assert "Traceback" not in completed.stderr and not (tmp_path / "run").exists()


def test_train_and_sft_require_a_model(tmp_path):
    """No silent tiny default: a user's run names its model (a YAML's `model:` counts)."""
    completed = train_cli("--output_dir", str(tmp_path / "run"), model=())
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    assert completed.stderr.strip().splitlines()[-1].startswith("mmgrpo train: error: --model is required: ")
    assert "tiny:qwen2-vl" in completed.stderr and not (tmp_path / "run").exists()
    from mmgrpo.config import SFTConfig
    from mmgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="--model is required"):
        SFTConfig.from_args(["--output_dir", str(tmp_path / "sft")], required=("model.model",))
    (tmp_path / "run.yaml").write_text("model:\n  model: tiny:qwen2.5-vl\n")
    cfg = SFTConfig.from_args(["--config", str(tmp_path / "run.yaml")], required=("model.model",))
    assert cfg.model.model == "tiny:qwen2.5-vl"


def test_report_of_a_folder_two_runs_wrote_draws_the_latest(tmp_path):
    """A folder written by two runs before the --output_dir check existed: metrics steps 1,2,1,2,3."""
    import warnings as _warnings

    from mmgrpo.eval.report import latest_run

    rows = [{"step": s, "reward": r} for s, r in ((1, 0.1), (2, 0.2), (1, 0.5), (2, 0.6), (3, 0.7))]
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        kept = latest_run(rows, tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward"]) for r in kept] == [(1, 0.5), (2, 0.6), (3, 0.7)]
    assert "holds more than one run (step 1 logged again after 2)" in str(caught[0].message)
    resumed = [{"step": s} for s in (1, 2, 3, 4, 3, 4, 5)]  # continued from checkpoint-2 by an older mmgrpo
    assert [r["step"] for r in latest_run(resumed, tmp_path / "m.jsonl")] == [1, 2, 3, 4, 5]
    prompts = [{"step": s} for s in (1, 1, 2, 2, 1, 1)]  # completions.jsonl: two prompts per step
    assert [r["step"] for r in latest_run(prompts, tmp_path / "c.jsonl", rows_per_step=2)] == [1, 1]


def cli(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "mmgrpo", *args], env=env, capture_output=True, text=True, timeout=300)


def one_line_exit_2(completed, message):
    assert completed.returncode == 2, completed.stderr[-1500:]
    assert "Traceback" not in completed.stderr
    assert message in completed.stderr.strip().splitlines()[-1], completed.stderr[-1500:]


def test_the_cli_refuses_a_reused_folder_and_a_half_written_checkpoint_keeping_every_file(tmp_path):
    out = tmp_path / "run"
    fake_run(out)
    fake_checkpoint(out, 2)
    half = out / "checkpoint-4"
    half.mkdir()
    (half / "config.json").write_text("")  # a kill during the save, before the marker
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    base = ["train", "--model", "tiny:qwen2-vl", "--num_generations", "2", "--per_device_train_batch_size", "4", "--output_dir", str(out)]

    one_line_exit_2(cli(*base), f"--output_dir {out} is not empty")
    one_line_exit_2(cli(*base, "--resume_from_checkpoint", str(half)),
                    f"checkpoint {half} is incomplete (no checkpoint_complete.json: its save did not finish); "
                    f"the newest complete one is {out / 'checkpoint-2'}")
    one_line_exit_2(cli("eval", "--model", str(half), "--dataset", "shapes-color:test", "--limit", "2",
                        "--output_dir", str(tmp_path / "eval")),
                    f"model folder {half}: config.json is empty (0 bytes)")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing already written lost
    file_in_place = tmp_path / "a-file"
    file_in_place.write_text("x")
    one_line_exit_2(cli("train", "--model", "tiny:qwen2-vl", "--output_dir", str(file_in_place)),
                    f"--output_dir {file_in_place} is a file, not a folder")
