"""Eval runs: eval.json / eval.md from a fake generate_fn, the incremental samples.jsonl and
--resume (finished ids are skipped, a torn line is cut), and the errors a user sees."""

import json

import pytest

from mmgrpo.data.sample import Sample
from mmgrpo.errors import ConfigError
from mmgrpo.eval.results import SampleWriter, finalize_eval, read_samples, run_eval


def _samples(n=5, image_every=2):
    samples = []
    for i in range(n):
        with_image = i % image_every == 0
        content = (
            [{"type": "image"}, {"type": "text", "text": f"Colour {i}?"}] if with_image else f"Colour {i}?"
        )
        samples.append(
            Sample(
                id=f"shapes/test/{i}",
                messages=[{"role": "user", "content": content}],
                images=["img.png"] if with_image else [],
                columns={"solution": "the shape is red" if i % 2 else "the shape is blue"},
            )
        )
    return samples


def _always_red(batch, num_samples):
    return [["<answer>the shape is red</answer>"] * num_samples for _ in batch]


def _run(tmp_path, generate_fn=_always_red, **kwargs):
    options = dict(
        model="m",
        dataset="shapes",
        split="test",
        metrics=["exact_match", "bleu", "pass_at_k"],
        num_samples=2,
        batch_size=2,
    )
    options.update(kwargs)
    return run_eval(options.pop("samples", _samples()), generate_fn, tmp_path / "eval", **options)


def test_eval_json_has_metrics_modalities_and_samples(tmp_path):
    result = _run(tmp_path)
    on_disk = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert {
        "model",
        "dataset",
        "split",
        "config",
        "metrics",
        "per_modality",
        "wall_time_s",
        "samples",
    } <= set(result)
    # samples 1 and 3 want "red": exact match 2/5
    assert result["metrics"]["exact_match"] == pytest.approx(0.4)
    assert result["metrics"]["pass@2"] == pytest.approx(0.4)
    assert set(result["metrics"]) == {"exact_match", "pass@1", "pass@2", "sentence_bleu", "bleu"}
    # samples 0, 2, 4 have an image (all "blue"); 1 and 3 are text (both "red")
    assert result["per_modality"]["image"]["exact_match"] == 0.0
    assert result["per_modality"]["text"]["exact_match"] == 1.0
    assert result["per_modality"]["text"]["bleu"] == pytest.approx(100.0)  # corpus BLEU per modality
    assert result["counts"] == {"all": 5, "image": 3, "text": 2}
    first = result["samples"][0]
    assert first["id"] == "shapes/test/0" and first["modality"] == "image"
    assert first["prompt"] == "<image>Colour 0?"
    assert first["completions"] == ["<answer>the shape is red</answer>"] * 2
    assert first["scores"]["exact_match"] == 0.0 and "sentence_bleu" in first["scores"]
    assert result["config"]["num_samples"] == 2
    markdown = (tmp_path / "eval" / "eval.md").read_text()
    assert "| metric | all | image | text |" in markdown
    assert "| exact_match | 0.4 | 0 | 1 |" in markdown


class Interrupted(Exception):
    pass


def test_resume_skips_the_samples_already_written(tmp_path):
    def dies_after_three(batch, num_samples):
        if any(sample.id.endswith(("/3", "/4")) for sample in batch):
            raise Interrupted
        return _always_red(batch, num_samples)

    with pytest.raises(Interrupted):
        _run(tmp_path, dies_after_three, batch_size=1)
    samples_file = tmp_path / "eval" / "samples.jsonl"
    assert [r["id"] for r in read_samples(samples_file)] == [f"shapes/test/{i}" for i in range(3)]
    assert not (tmp_path / "eval" / "eval.json").exists()

    asked = []

    def counting(batch, num_samples):
        asked.extend(sample.id for sample in batch)
        return _always_red(batch, num_samples)

    result = _run(tmp_path, counting, batch_size=1, resume=True)
    assert asked == ["shapes/test/3", "shapes/test/4"]  # only the 2 that remained
    assert sorted(s["id"] for s in result["samples"]) == [f"shapes/test/{i}" for i in range(5)]
    assert result["metrics"]["exact_match"] == pytest.approx(0.4)


def test_sample_writer_reopens_and_cuts_a_torn_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    with SampleWriter(path) as writer:
        for i in range(3):
            writer.write({"id": f"x/{i}", "modality": "text", "prompt": "", "completions": [], "scores": {}})
    with open(path, "a") as f:
        f.write('{"id": "x/3", "modal')  # the process died mid-write
    with SampleWriter(path, resume=True) as writer:
        assert writer.done_ids == {"x/0", "x/1", "x/2"}
        writer.write({"id": "x/4", "modality": "text", "prompt": "", "completions": [], "scores": {}})
    assert [r["id"] for r in read_samples(path)] == ["x/0", "x/1", "x/2", "x/4"]
    with pytest.raises(ConfigError, match="pass --resume"):
        SampleWriter(path)


def test_existing_results_need_resume_and_the_same_settings(tmp_path):
    _run(tmp_path)
    with pytest.raises(ConfigError, match="pass --resume"):
        _run(tmp_path)
    with pytest.raises(ConfigError, match=r"--resume.*metrics: \['exact_match', 'bleu', 'pass_at_k'\] then"):
        _run(tmp_path, resume=True, metrics=["exact_match"])
    # resuming a finished eval generates nothing and rewrites the same eval.json
    again = _run(tmp_path, lambda batch, k: pytest.fail("nothing is left to generate"), resume=True)
    assert again["metrics"]["exact_match"] == pytest.approx(0.4)


def test_iou_without_a_box_solution_fails_before_any_generation(tmp_path):
    def never(batch, num_samples):
        pytest.fail("generate_fn must not run when a metric lacks its field")

    with pytest.raises(ConfigError, match=r"metric 'iou' needs a box `solution`.*'shapes/test/0'"):
        _run(tmp_path, never, metrics=["iou"])
    samples = _samples()
    for sample in samples:
        sample.columns = {}
    # the same output directory: the failed attempt left no results in the way
    with pytest.raises(ConfigError, match=r"metric 'iou' needs the dataset field 'solution'"):
        _run(tmp_path, never, metrics=["iou"], samples=samples)


def test_generate_fn_may_add_columns_for_the_metrics(tmp_path):
    samples = _samples(2)
    for sample in samples:
        sample.columns = {"solution": [0, 0, 100, 100]}

    def boxes_in_half_scale(batch, num_samples):
        completions = [["<answer>[0, 0, 50, 50]</answer>"] * num_samples for _ in batch]
        return completions, {"to_image_box": [lambda box: [2 * v for v in box]] * len(batch)}

    result = _run(tmp_path, boxes_in_half_scale, samples=samples, metrics=["iou"], num_samples=1)
    assert result["metrics"] == {"iou": 1.0, "iou_acc@0.5": 1.0}


def test_generate_fn_must_return_num_samples_per_sample(tmp_path):
    with pytest.raises(ValueError, match="2 completions for each of the 2 samples"):
        _run(tmp_path, lambda batch, k: [["one"] for _ in batch])


def test_finalize_rebuilds_eval_json_from_samples(tmp_path):
    first = _run(tmp_path)
    (tmp_path / "eval" / "eval.json").unlink()
    again = finalize_eval(tmp_path / "eval")
    assert again["metrics"] == first["metrics"]
    assert [s["scores"] for s in again["samples"]] == [s["scores"] for s in first["samples"]]


def test_markdown_of_a_single_modality_eval(tmp_path):
    result = _run(tmp_path, samples=_samples(4, image_every=100)[1:])  # text only
    markdown = (tmp_path / "eval" / "eval.md").read_text()
    assert "| metric | all |\n|---|---|\n" in markdown
    assert f"| exact_match | {result['metrics']['exact_match']:.4g} |" in markdown
    assert "| samples | 3 |" in markdown
