"""Bad input of the kinds that used to slip through (issue "nothing slips through"), each kind walked:

- every numeric option of `mmgrpo train` and `mmgrpo sft` with NaN, infinities, -1, 0 and a huge value: the
  start-up checks accept it or give one line naming the flag, never a traceback from deeper down (the
  fields come from the dataclasses, so an option added later is walked too); eval's and estimate's numbers;
- a `--config` YAML read as the flags would read it;
- rows that say one thing twice, solutions that are NaN or blank;
- comparisons with nothing to compare, an eval resumed with other settings.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from mmgrpo.config import SFTConfig, TrainConfig
from mmgrpo.config.domains import NUMERIC_DEFAULTS
from mmgrpo.config.flags import _leaves, _scalar_type
from mmgrpo.errors import ConfigError
from mmgrpo.training.startup_checks import check_sft_flags, check_train_flags


def numeric_fields(cls) -> list[tuple[tuple[str, ...], dataclasses.Field]]:
    out = []
    for path, annotation, owner in _leaves(cls):
        field = {f.name: f for f in dataclasses.fields(owner)}[path[-1]]
        if _scalar_type(annotation)[0] in NUMERIC_DEFAULTS:
            out.append((path, field))
    return out


def with_value(cfg, path, field, value):
    cfg = copy.deepcopy(cfg)
    owner = cfg
    for part in path[:-1]:
        owner = getattr(owner, part)
    setattr(owner, path[-1], [value] if "list[" in str(field.type) else value)  # a list option: one bad element
    return cfg


BASES = {
    TrainConfig: (TrainConfig.from_args(["--model", "tiny:qwen2-vl", "--output_dir", "runs/numeric-walk"]), check_train_flags),
    SFTConfig: (SFTConfig.from_args(["--model", "tiny:qwen2-vl", "--output_dir", "runs/numeric-walk"]), check_sft_flags),
}
WALK = [(cls, path, field) for cls in BASES for path, field in numeric_fields(cls)]


def test_the_walk_covers_every_numeric_option():
    names = {path[-1] for _, path, _ in WALK}
    assert {"learning_rate", "beta", "temperature", "seed", "max_steps", "reward_weights", "vllm_server_port",
            "warmup_ratio", "logging_steps", "video_fps", "teacher_kl_coef"} <= names
    assert len(WALK) > 80


@pytest.mark.parametrize("cls, path, field", WALK, ids=[f"{c.__name__}-{'.'.join(p)}" for c, p, _ in WALK])
def test_a_non_finite_value_is_one_line_naming_the_flag(cls, path, field):
    base, _ = BASES[cls]
    domain = field.metadata.get("domain")
    for value in (math.nan, math.inf, -math.inf):
        if domain is not None and not domain.finite and value == math.inf:
            continue  # declared open to infinity (--vllm_importance_sampling_cap inf: no cap)
        with pytest.raises(ConfigError, match=rf"^--{path[-1]} "):
            with_value(base, path, field, value).validate()


@pytest.mark.parametrize("cls, path, field", WALK, ids=[f"{c.__name__}-{'.'.join(p)}" for c, p, _ in WALK])
def test_edge_values_are_taken_or_refused_naming_the_flag(cls, path, field, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base, check = BASES[cls]
    huge = 10**30 if "int" in str(field.type) else 1e30
    for value in (-1, 0, huge):
        cfg = with_value(base, path, field, value)
        try:
            check(cfg)
        except ConfigError as error:
            assert "--" in str(error), error  # a flag's line (this one's, or the rule it breaks with another)


@pytest.mark.parametrize("text, field, expected", [
    ("learning_rate: 1e-6\n", ("optim", "learning_rate"), 1e-6),  # a string to PyYAML
    ("optim:\n  learning_rate: 3e-5\n", ("optim", "learning_rate"), 3e-5),
    ("reward_funcs: format\n", ("algo", "reward_funcs"), ["format"]),  # a scalar where a list goes
    ("max_steps: null\n", ("max_steps",), 100),  # null: the default
    ("max_steps: 2.0\n", ("max_steps",), 2),
    ("bf16: 'false'\n", ("bf16",), False),
    ("run_name: 2026\n", ("run_name",), "2026"),
])
def test_a_config_yaml_is_read_as_the_flags_would_read_it(tmp_path, text, field, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    cfg = TrainConfig.from_args(["--config", str(path)])
    value = cfg
    for part in field:
        value = getattr(value, part)
    assert value == expected and type(value) is type(expected)


def test_a_config_yaml_value_that_cannot_be_read_is_shown(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: ten\n")
    with pytest.raises(ConfigError, match=r"run.yaml: max_steps: 'ten' is not an integer"):
        TrainConfig.from_args(["--config", str(path)])


@pytest.mark.parametrize("flags, match", [
    (["--output_dir", ""], "--output_dir '': give a folder"),
    (["--seed", "-1"], "--seed -1: give a seed in"),
    (["--seed", str(2**40)], "--seed 1099511627776: give a seed in"),
    (["--max_steps", "-5"], "--max_steps -5: give an integer >= -1"),
    (["--vllm_server_port", "8000", "70000"], "--vllm_server_port 70000: give a port in"),
    (["--reward_weights", "1", "nan"], "--reward_weights nan"),
    (["--delta", "nan"], "--delta nan"),
])
def test_the_issue_instances_are_one_line(flags, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_args(["--model", "tiny:qwen2-vl", *flags]).validate()


def test_a_run_that_can_train_on_nothing_says_so():
    cfg = TrainConfig.from_args(["--model", "tiny:qwen2-vl", "--mask_truncated_completions", "--suppress_eos"])
    with pytest.warns(UserWarning, match="trains on nothing"):
        cfg.validate()


def test_mixture_weights_that_overflow_are_one_line():
    from mmgrpo.data.catalog import mix_datasets

    with pytest.raises(ConfigError, match="add up past the largest float"):
        mix_datasets(["shapes-color:train:1e308", "shapes-count:train:1e308"], split="train")


@pytest.mark.parametrize("argv, match", [
    (["--device_memory_gb", "nan"], "--device_memory_gb nan: give a finite number of GB > 0"),
    (["--image_pixels", "-5"], "--image_pixels -5: give an integer >= 1"),
])
def test_estimate_refuses_what_it_cannot_size(argv, match):
    from mmgrpo.estimate import main as estimate_main

    with pytest.raises(ConfigError, match=match):
        estimate_main(["--model", "random:qwen2.5-vl-3b", *argv])


@pytest.mark.parametrize("argv, match", [
    (["--temperature", "nan", "--num_samples", "2"], "--temperature nan: --num_samples 2 samples at a finite"),
    (["--temperature", "0", "--num_samples", "2"], "--temperature 0.0"),
    (["--video_fps", "nan"], "--video_fps nan: give frames per second"),
])
def test_eval_refuses_a_sampling_it_cannot_do(tmp_path, argv, match):
    from mmgrpo.eval.evaluate import main as eval_main

    with pytest.raises(ConfigError, match=match):
        eval_main(["--model", "tiny:qwen2-vl", "--dataset", "shapes-color:test", "--output_dir", str(tmp_path), *argv])


@pytest.mark.parametrize("row, columns, match", [
    ({"messages": [{"role": "user", "content": "hi"}], "query": "hi", "solution": "a"}, None, "both `messages` and `query`"),
    ({"query": "hi", "answer": "a", "solution": "b"}, {"answer": "solution"}, "renames 'answer' -> 'solution' but the row already has"),
])
def test_rows_that_say_one_thing_twice_are_refused_naming_the_row(row, columns, match):
    from mmgrpo.data.sample import normalize_row
    from mmgrpo.errors import DataError

    with pytest.raises(DataError, match=match):
        normalize_row(row, dataset="toy", index=3, columns=columns)


@pytest.mark.parametrize("solution", [float("nan"), "", "   ", None])
def test_a_nan_or_blank_solution_is_a_missing_one(solution):
    from mmgrpo.data.sample import normalize_row

    assert "solution" not in normalize_row({"query": "hi", "solution": solution}, dataset="toy", index=0).columns


def test_compare_says_when_there_is_nothing_to_compare(tmp_path):
    from mmgrpo.eval.compare import compare

    sample = {"id": "x/0", "scores": {"acc": None}}
    full = {"model": "m", "dataset": "d", "split": "test", "samples": [sample], "metrics": {}}
    with pytest.raises(ConfigError, match="has no samples: nothing to compare"):
        compare({**full, "samples": []}, full)
    with pytest.raises(ConfigError, match=r"no metric has a score on both sides.*\(acc are missing"):
        compare(full, full)


def test_eval_resume_with_other_settings_names_the_flag(tmp_path):
    from mmgrpo.eval.evaluate import main as eval_main

    base = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color:test", "--output_dir", str(tmp_path),
            "--max_completion_length", "4"]
    eval_main([*base, "--limit", "2"])
    with pytest.raises(ConfigError, match=r"--limit: 2 then, 3 now"):
        eval_main([*base, "--limit", "3", "--resume"])


def test_a_template_that_raises_while_rendering_is_named(tiny_qwen2_vl_path):
    from mmgrpo.data.sample import normalize_row
    from mmgrpo.errors import DataError
    from mmgrpo.models.loading import load_template

    _, _, template = load_template(tiny_qwen2_vl_path, None)

    def broken(messages, add_generation_prompt=True):
        raise KeyError("role")

    template.render = broken
    sample = normalize_row({"query": "hi", "solution": "a"}, dataset="toy", index=7).load_media()
    with pytest.raises(DataError, match=r"sample toy/train/7: template 'qwen2-vl' raised while rendering .*KeyError"):
        template.encode_prompt(sample)


def test_a_trainer_displaced_on_a_rollout_server_is_told_who_holds_it(tiny_qwen2_vl_path):
    from mmgrpo.rollout.vllm_server import RolloutService

    service = RolloutService(None, tiny_qwen2_vl_path, 64)  # the weight-group bookkeeping needs no engine
    query = {"backend": "gloo", "timeout": "0.2", "address": "127.0.0.1", "port": "1", "rank": "1", "world_size": "2"}
    groups = []
    for session in ("first", "second"):
        assert service.join({**query, "session": session}, "127.0.0.1")[0] == 202
        groups.append(service.group)
    for group in groups:  # no trainer listens: each join fails in its thread, which ends before the test does
        assert group.joined.wait(30) and group.error
    status, answer = service.receive("first")
    assert status == 409 and "another trainer (weight group second) joined this server" in answer["error"]
    status, answer = service.receive("unknown")
    assert status == 409 and "was restarted since the trainer joined" in answer["error"]
