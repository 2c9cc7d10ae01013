"""The evaluation chain through the command line on tiny Qwen2-VL: `mmgrpo eval` (files, --resume,
a missing split), `mmgrpo compare`, and evaluation during `mmgrpo train` with the best checkpoint."""

import json

import pytest
import torch

from mmgrpo.cli import main
from mmgrpo.errors import ConfigError
from mmgrpo.eval import evaluate as eval_run
from mmgrpo.runstate.state import TrainState


def _eval(model_path, output_dir, *extra):
    main(
        [
            "eval",
            "--model",
            model_path,
            "--model_type",
            "qwen2-vl",
            "--dataset",
            "shapes-color:test",
            "--max_completion_length",
            "8",
            "--output_dir",
            str(output_dir),
            *extra,
        ]
    )
    return json.loads((output_dir / "eval.json").read_text())


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory, tiny_qwen2_vl_path):
    out = tmp_path_factory.mktemp("eval") / "base"
    _eval(tiny_qwen2_vl_path, out, "--limit", "16")
    return out


def _count_generated(monkeypatch) -> list[str]:
    """Patch the eval's generator to record the ids it generates for."""
    seen, generate = [], eval_run.EngineGenerator.__call__

    def counting(self, samples, num_samples):
        seen.extend(sample.id for sample in samples)
        return generate(self, samples, num_samples)

    monkeypatch.setattr(eval_run.EngineGenerator, "__call__", counting)
    return seen


def test_eval_writes_metrics(eval_dir):
    result = json.loads((eval_dir / "eval.json").read_text())
    assert set(result["metrics"]) == {"answer_format", "vqa_accuracy"}  # the dataset's rewards
    assert result["counts"]["all"] == 16 and len(result["samples"]) == 16
    assert (result["dataset"], result["split"]) == ("shapes-color", "test")
    assert all(0.0 <= v <= 1.0 for v in result["metrics"].values())
    assert (eval_dir / "eval.md").is_file()


def test_resume_generates_only_the_rest(eval_dir, tmp_path, monkeypatch, capsys, tiny_qwen2_vl_path):
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(eval_dir, out)
    lines = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    # killed after 10 samples, in the middle of writing the 11th
    (out / "samples.jsonl").write_text("".join(lines[:10]) + lines[10][:25])
    (out / "eval.json").unlink()

    with pytest.raises(SystemExit) as exit_info:  # without --resume the results are never mixed
        _eval(tiny_qwen2_vl_path, out, "--limit", "16")
    assert exit_info.value.code == 2 and "--resume" in capsys.readouterr().err

    generated = _count_generated(monkeypatch)
    result = _eval(tiny_qwen2_vl_path, out, "--limit", "16", "--resume")
    assert generated == [f"shapes-color/test/{i}" for i in range(10, 16)]
    full = json.loads((eval_dir / "eval.json").read_text())
    assert [s["id"] for s in result["samples"]] == [s["id"] for s in full["samples"]]
    # greedy decoding: the resumed run reproduces the uninterrupted one
    assert [s["completions"] for s in result["samples"]] == [s["completions"] for s in full["samples"]]
    assert result["metrics"] == full["metrics"]


def test_missing_split_is_a_clean_error(tmp_path, capsys, tiny_qwen2_vl_path):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "eval",
                "--model",
                tiny_qwen2_vl_path,
                "--model_type",
                "qwen2-vl",
                "--dataset",
                "shapes-color:dev",
                "--output_dir",
                str(tmp_path / "out"),
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mmgrpo eval: error:") and "no split 'dev'" in err and "train, test, validation" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_compare_prints_a_table(eval_dir, tmp_path, capsys, tiny_qwen2_vl_path):
    shorter = tmp_path / "short"
    _eval(tiny_qwen2_vl_path, shorter, "--limit", "16", "--max_completion_length", "2")
    capsys.readouterr()
    main(["compare", str(eval_dir), str(shorter), "--n_boot", "200", "--output", str(tmp_path / "cmp.json")])
    printed = capsys.readouterr().out
    assert "16 paired samples" in printed and "metric" in printed and "vqa_accuracy" in printed
    table = (tmp_path / "cmp.md").read_text()
    assert "| metric |" in table and "| vqa_accuracy |" in table
    result = json.loads((tmp_path / "cmp.json").read_text())
    assert {row["metric"] for row in result["metrics"]} >= {"answer_format", "vqa_accuracy"}


# ---- evaluation during training -------------------------------------------------------------


def test_train_evaluates_and_keeps_the_best_checkpoint(tmp_path, tiny_qwen2_vl_path):
    out = tmp_path / "run"
    main(
        [
            "train",
            "--model",
            tiny_qwen2_vl_path,
            "--model_type",
            "qwen2-vl",
            "--dataset",
            "shapes-color",
            "--max_steps",
            "4",
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "8",
            "--beta",
            "0",
            "--dataloader_num_workers",
            "0",
            "--eval_dataset",
            "shapes-color",
            "--eval_steps",
            "2",
            "--eval_limit",
            "8",
            "--output_dir",
            str(out),
        ]
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    evaluated = [row["step"] for row in rows if "eval/vqa_accuracy" in row]
    assert evaluated == [2, 4]
    assert all("eval/answer_format" in rows[s - 1] and rows[s - 1]["time/eval"] > 0 for s in evaluated)
    for row in rows:  # the evaluation is counted once: inside the step's wall time, out of samples/s
        assert 0 <= row["time/eval"] < row["time/step"]
        assert row["samples_per_s"] == pytest.approx(4 / (row["time/step"] - row["time/eval"]), rel=1e-6)
    for step in evaluated:
        result = json.loads((out / "eval" / f"step-{step}" / "eval.json").read_text())
        assert result["split"] == "test" and result["counts"]["all"] == 8
        assert rows[step - 1]["eval/vqa_accuracy"] == result["metrics"]["vqa_accuracy"]
    best = json.loads((out / "checkpoint-best" / "best.json").read_text())
    assert best["metric"] == "answer_format" and best["step"] in evaluated  # the first metric by default
    assert best["value"] == rows[best["step"] - 1]["eval/answer_format"]
    assert (out / "checkpoint-best" / "model.safetensors").is_file()
    assert not (out / "checkpoint-best.tmp").exists()


def _save(path):
    """What TrainingEval.keep_best is handed to write the model's folder (a Run's save)."""
    path.mkdir(parents=True, exist_ok=True)  # a staging folder that exists already (mmgrpo/runstate/checkpoint.py)
    (path / "weights").write_text("saved")


def _evaluator(tmp_path, **options):
    from mmgrpo.config import TrainConfig
    from mmgrpo.training.build import training_eval

    cfg = TrainConfig(output_dir=str(tmp_path))
    cfg.eval.eval_dataset = "shapes-color"
    for key, value in options.items():
        setattr(cfg.eval, key, value)
    return training_eval(cfg)


@pytest.mark.parametrize("greater, best_step", [(True, 2), (False, 1)])
def test_best_checkpoint_follows_greater_is_better(tmp_path, greater, best_step):
    evaluator = _evaluator(tmp_path, metric_for_best_model="eval/vqa_accuracy", greater_is_better=greater)
    assert evaluator.metrics == ["answer_format", "vqa_accuracy"]  # the eval dataset's rewards
    state = TrainState()
    for step, value in [
        (1, 0.5),
        (2, 0.7),
        (3, 0.6),
        (4, 0.7),
        (5, None),
    ]:  # a tie or None keeps the earlier one
        evaluator.keep_best(step, state, {"answer_format": 1.0, "vqa_accuracy": value}, _save)
    best = json.loads((tmp_path / "checkpoint-best" / "best.json").read_text())
    assert (best["step"], best["metric"]) == (best_step, "vqa_accuracy")
    assert (state.best_step, state.best_metric) == (best_step, 0.7 if greater else 0.5)  # what a checkpoint saves
    assert (tmp_path / "checkpoint-best" / "weights").is_file()


def test_eval_options_fail_before_training(tmp_path):
    from mmgrpo.config import TrainConfig

    with pytest.raises(ConfigError, match="need --eval_dataset"):
        TrainConfig.from_args(["--eval_steps", "10"]).validate()
    with pytest.raises(ConfigError, match="unknown metric 'vqa_acc'"):
        _evaluator(tmp_path, eval_metrics=["vqa_acc"])
    with pytest.raises(ConfigError, match="no split 'dev'"):
        _evaluator(tmp_path, eval_dataset="shapes-color:dev")
    with pytest.raises(ConfigError, match="not an eval metric"):
        _evaluator(tmp_path, metric_for_best_model="accuracy").keep_best(1, TrainState(), {"vqa_accuracy": 1.0}, _save)
    assert _evaluator(tmp_path).due(4, final=False) is False  # eval_steps 0: only after the last step
    assert _evaluator(tmp_path, eval_steps=2).due(4, final=False) and _evaluator(tmp_path).due(7, final=True)
    assert not TrainConfig().eval.eval_dataset and not _evaluator(tmp_path, eval_dataset=None).due(
        1, final=True
    )


def test_train_evaluates_several_datasets(tmp_path, tiny_qwen2_vl_path):
    """--eval_dataset with two names: each evaluated into its own folder, keys eval/<dataset>/<metric>."""
    out = tmp_path / "run"
    main(["train", "--model", tiny_qwen2_vl_path, "--model_type", "qwen2-vl", "--dataset", "shapes-color",
          "--max_steps", "2", "--num_generations", "2", "--per_device_train_batch_size", "4",
          "--max_completion_length", "8", "--beta", "0", "--dataloader_num_workers", "0",
          "--eval_dataset", "shapes-color", "shapes-ground", "--eval_steps", "1", "--eval_limit", "4",
          "--metric_for_best_model", "shapes-ground/iou", "--output_dir", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for dataset, metric in (("shapes-color", "vqa_accuracy"), ("shapes-ground", "iou_acc@0.5")):
            result = json.loads((out / "eval" / f"step-{row['step']}" / dataset / "eval.json").read_text())
            assert result["dataset"] == dataset and result["counts"]["all"] == 4
            assert row[f"eval/{dataset}/{metric}"] == result["metrics"][metric]
        assert "eval/vqa_accuracy" not in row  # several datasets: every key names its dataset
    best = json.loads((out / "checkpoint-best" / "best.json").read_text())
    assert best["metric"] == "shapes-ground/iou" and best["eval"] == f"eval/step-{best['step']}"


def test_the_eval_bar_shows_seconds_per_sample_not_a_reward(tmp_path, tiny_qwen2_vl_path):
    from mmgrpo.runstate.runlog import console

    with console.capture() as captured:
        _eval(tiny_qwen2_vl_path, tmp_path / "bar", "--limit", "4")
    bar = [line for line in captured.get().splitlines() if line.startswith("eval shapes-color")][-1]
    assert "4/4" in bar and "s/sample" in bar and "nan" not in bar and "reward" not in bar


def test_eval_runs_the_model_in_the_dtype_asked_and_names_what_it_cannot(tmp_path, capsys, tiny_qwen2_vl_path, monkeypatch):
    """--torch_dtype bfloat16 loads the weights in bf16 (what a GPU eval does by default; here on the CPU)
    and generates with them; a GPU this machine has not, or a missing flash-attn, is one line."""
    loaded = []
    load_for_eval = eval_run.load_for_eval

    def recording(*args, **kwargs):
        engine, template = load_for_eval(*args, **kwargs)
        loaded.append(next(engine.model.parameters()).dtype)
        return engine, template

    monkeypatch.setattr(eval_run, "load_for_eval", recording)
    result = _eval(tiny_qwen2_vl_path, tmp_path / "bf16", "--limit", "4", "--device", "cpu", "--torch_dtype", "bfloat16")
    assert loaded == [torch.bfloat16] and result["counts"]["all"] == 4
    assert "on cpu in bfloat16, sdpa attention" in " ".join(capsys.readouterr().err.split())
    def refused(*flags) -> str:
        with pytest.raises(SystemExit) as exit_:
            _eval(tiny_qwen2_vl_path, tmp_path / "refused", "--limit", "2", *flags)
        assert exit_.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    if not torch.cuda.is_available():
        assert refused("--device", "cuda").endswith("--device cuda: this machine has no CUDA GPU; use --device cpu (or auto).")
        assert "flash_attention_2" in refused("--attn_implementation", "flash_attention_2")
    assert refused("--torch_dtype", "half").endswith("--torch_dtype 'half': give auto, bfloat16, float16, float32.")
    assert not (tmp_path / "refused").exists()


def test_use_vllm_without_vllm_or_with_the_probe_is_one_line(tmp_path, capsys, tiny_qwen2_vl_path):
    """`eval --use_vllm` where vLLM is not installed names how to get it (or to leave the flag out);
    bad vLLM sizes name their flag; all before a model loads."""
    import importlib.util

    def refused(*flags) -> str:
        with pytest.raises(SystemExit) as exit_:
            _eval(tiny_qwen2_vl_path, tmp_path / "refused", "--limit", "2", *flags)
        assert exit_.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    if importlib.util.find_spec("vllm") is None:
        assert "leave --use_vllm out to generate with transformers" in refused("--use_vllm")
        with pytest.raises(SystemExit):  # compare evaluating two models passes the flag on to each eval
            main(["compare", tiny_qwen2_vl_path, tiny_qwen2_vl_path, "--dataset", "shapes-color:test", "--limit", "2",
                  "--use_vllm", "--output", str(tmp_path / "cmp")])
        assert "leave --use_vllm out" in capsys.readouterr().err
    assert "--vllm_gpu_memory_utilization 1.5: a share in (0, 1]" in refused("--vllm_gpu_memory_utilization", "1.5")
    assert "--vllm_max_model_len 0: must be at least 1" in refused("--vllm_max_model_len", "0")
    assert not (tmp_path / "refused").exists()
