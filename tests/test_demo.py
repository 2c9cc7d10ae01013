"""The embedded demo: its shipped start, its arguments, its table, and every stage end to end, shrunk."""

import io
import json

import pytest
import yaml
from rich.console import Console

from mmgrpo.cli import main as cli_main
from mmgrpo.demo import main as demo_main
from mmgrpo.demo import parse_args
from mmgrpo.demo import shipped_start as demo_start
from mmgrpo.demo.table import TaskResult, result_table
from mmgrpo.errors import CheckpointError


def test_the_shipped_start_matches_its_manifest_and_names_how_it_was_built():
    folder = demo_start.checked_start()
    manifest = demo_start.read_manifest(folder)
    assert {"model.safetensors", "config.json", "mmgrpo.json", "tokenizer.json"} <= set(manifest["files"])
    assert "mmgrpo.demo.shipped_start" in manifest["built_by"]
    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["rope_parameters"]["rope_theta"] == 10  # the start sees image positions
    assert set(manifest["test_accuracy"]) == {"shapes-color", "shapes-count", "shapes-ground"}


@pytest.fixture
def small_start(tmp_path):
    """A start folder shipped by `ship` from real files (not a model: the check reads files only)."""
    built = tmp_path / "built"
    built.mkdir()
    (built / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (built / "config.json").write_text('{"model_type": "qwen2_vl"}')
    return demo_start.ship(built, tmp_path / "start", built_by="a test")


def test_a_start_whose_files_match_passes(small_start):
    assert demo_start.checked_start(small_start) == small_start
    assert demo_start.read_manifest(small_start)["built_by"] == "a test"


@pytest.mark.parametrize("damage, word", [
    (lambda folder: (folder / "model.safetensors").unlink(), "missing"),
    (lambda folder: (folder / "manifest.json").unlink(), "missing"),
    (lambda folder: (folder / "manifest.json").write_text("{not json"), "corrupt"),
    (lambda folder: (folder / "model.safetensors").write_bytes(b"\0" * 16384), "corrupt"),  # same size, other bytes
])
def test_a_missing_or_corrupt_start_is_one_line_naming_the_file_and_the_rebuild_command(small_start, damage, word):
    damage(small_start)
    with pytest.raises(CheckpointError) as error:
        demo_start.checked_start(small_start)
    message = str(error.value)
    assert "\n" not in message
    assert f"the demo's start {small_start}/" in message and word in message
    assert "mmgrpo demo --from_scratch" in message


def test_mmgrpo_demo_without_its_start_exits_with_that_line(small_start, monkeypatch, capsys, tmp_path):
    (small_start / "model.safetensors").unlink()
    monkeypatch.setattr(demo_start, "SHIPPED", small_start)
    with pytest.raises(SystemExit) as exit_status:
        cli_main(["demo", "--output_dir", str(tmp_path / "demo")])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert f"{small_start}/model.safetensors is missing" in err and "mmgrpo demo --from_scratch" in err
    assert "Traceback" not in err
    assert not (tmp_path / "demo" / "grpo").exists()  # nothing ran


def test_demo_arguments():
    args = parse_args(["--seed", "3"])
    assert (args.seed, args.from_scratch, args.start) == (3, False, None)
    assert parse_args(["--from_scratch", "--seed", "2", "--start_steps", "5"]).start_steps == 5
    for wrong in (["--from_scratch", "--start", "runs/x"], ["--start_steps", "5"]):
        with pytest.raises(SystemExit):
            parse_args(wrong)


def rendered(table, width=80) -> list[str]:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.file.getvalue().splitlines()


def test_the_table_fits_80_columns_with_whole_names_and_says_what_each_interval_shows():
    results = [
        TaskResult("shapes-color", "vqa_accuracy", 0.450, 0.985, 0.535, 0.490, 0.580, 1e-4, 0.40),
        TaskResult("shapes-count", "vqa_accuracy", 0.328, 0.312, -0.015, -0.050, 0.020, 0.46, 0.10),
        TaskResult("shapes-ground", "iou_acc@0.5", 0.235, 0.160, -0.075, -0.120, -0.030, 0.002, 0.05),
    ]
    lines = rendered(result_table(results, samples=400))
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    for name in ("shapes-color", "shapes-count", "shapes-ground", "vqa_accuracy", "iou_acc@0.5"):
        assert f" {name} " in text  # whole, never cut to "shapes-…"
    assert "…" not in text
    verdicts = [word for line in lines for word in ("better", "no significant change", "worse") if word in line]
    assert verdicts == ["better", "no significant change", "worse"]
    assert "+0.535 [+0.490, +0.580]" in text and "+0.40" in text and "+0.05" in text
    assert "pass" not in text.lower() and "met" not in text.split()


def small_registry(path):
    """The demo's registry entries at a few hundred training images, for a smoke run of the start."""
    entries = yaml.safe_load(demo_start.REGISTRY.read_text())
    for entry in entries["datasets"]:
        entry["synthetic_args"]["train_size"] = 200
    path.write_text(yaml.safe_dump(entries))
    return path


@pytest.mark.slow
def test_demo_from_scratch_smoke_run_builds_the_start_then_grpo_evaluations_and_report(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_start, "REGISTRY", small_registry(tmp_path / "datasets.yaml"))
    out = tmp_path / "demo"
    results = demo_main(["--output_dir", str(out), "--from_scratch", "--seed", "1", "--start_steps", "2",
                         "--grpo_steps", "2", "--eval_limit", "8"])
    assert [r.dataset for r in results] == ["shapes-color", "shapes-count", "shapes-ground"]
    # the three start stages, each from the one before, then GRPO from the last
    for stage, before in (("boxes", "count"), ("colour", "boxes")):
        config = yaml.safe_load((out / "start" / stage / "config.yaml").read_text())
        assert config["model"]["model"] == str(out / "start" / before / "final")
        assert config["seed"] == 1
    grpo = yaml.safe_load((out / "grpo" / "config.yaml").read_text())
    assert grpo["model"]["model"] == str(out / "start" / "colour" / "final")
    assert grpo["seed"] == 1
    for stage in ("eval_start", "eval_grpo"):
        for name in ("shapes-color", "shapes-count", "shapes-ground"):
            assert len(json.loads((out / stage / name / "eval.json").read_text())["samples"]) == 8
    comparison = json.loads((out / "compare" / "shapes-ground.json").read_text())
    assert {row["metric"] for row in comparison["metrics"]} >= {"iou", "iou_acc@0.5"}
    assert (out / "grpo" / "report.html").stat().st_size > 10_000


@pytest.mark.slow
def test_demo_smoke_run_from_the_shipped_start(tmp_path):
    out = tmp_path / "demo"
    demo_main(["--output_dir", str(out), "--seed", "2", "--grpo_steps", "2", "--eval_limit", "8"])
    grpo = yaml.safe_load((out / "grpo" / "config.yaml").read_text())
    assert grpo["model"]["model"] == str(demo_start.SHIPPED)
    assert (out / "compare" / "shapes-color.json").exists()
