"""Training-run report: built from a fabricated run directory (20 logged steps, completions with a
real PNG) and from a real tiny training run, its embedded images decode, metrics constant over the
run are named instead of plotted, and headless Chromium renders it to a non-blank page.

Chromium is required, not optional: `make test` installs it from Debian when missing
(.ci/ensure_chromium); MMGRPO_SKIP_BROWSER=1 skips this one test where it cannot be installed.
"""

import base64
import io
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from mmgrpo.cli import main as cli_main
from mmgrpo.errors import ConfigError
from mmgrpo.eval.report import eval_curves, training_seconds, write_report

CHROMIUM = "/usr/bin/chromium"
APT_HINT = "apt-get update && apt-get install -y chromium"
TINY_RUN = ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--num_generations", "4",
            "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--dataloader_num_workers", "0",
            "--reward_funcs", "vqa_accuracy", "answer_format", "--max_steps", "2"]  # as tests/test_engine.py


def _fabricate_run(run_dir, steps=20):
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {
                "step": step,
                "reward": 0.2 + 0.03 * step + 0.02 * rng.standard_normal(),
                "reward/format": min(1.0, 0.5 + 0.04 * step),
                "reward/iou": 0.1 + 0.02 * step,
                "reward_std": 0.1,
                "kl": 0.001 * step,
                "entropy": 1.5 - 0.03 * step,
                "completion_length": 80 - step,
                "clip_ratio/low_mean": 0.01 * (step % 3),
                "clip_ratio/high_mean": 0.02,  # constant, but its panel is drawn for the low clip ratio
                "clip_ratio/region_mean": 0.03,
                "time/gen": 3.0,
                "time/reward": 0.1,
                "time/update": 1.5,
                "time/step": 4.8,  # the whole step: drawn as a line over the stacked phases
                "learning_rate": 1e-6,  # constant over the run: named under the plots, not drawn
                "loss": 0.05 * rng.standard_normal(),
                "grad_norm": 0.5 + 0.1 * rng.random(),
                "perf/tokens_per_s": 900.0 + step,  # not a known panel: an "other" panel
            }
            if step % 5 == 0:
                row["eval/iou_acc@0.5"] = 0.3 + 0.02 * step
                row["eval/iou"] = 0.4 + 0.01 * step
                row["time/eval"] = 30.0  # not training time: in the step's wall time, not on the seconds axis
                row["time/step"] += 30.0  # the loop's time/step is the whole wall time, evaluation included
            f.write(json.dumps(row) + "\n")

    image = Image.new("RGB", (320, 240), "white")
    ImageDraw.Draw(image).rectangle([40, 60, 200, 180], fill=(200, 30, 30))
    image.save(run_dir / "square.png")
    data_uri = "data:image/png;base64," + base64.b64encode((run_dir / "square.png").read_bytes()).decode()
    with open(run_dir / "completions.jsonl", "w") as f:
        for step in (1, 10, 20):
            for k in range(3):
                # as the engine writes them: chat messages, image refs (a path relative to the run
                # directory, a data URI, one missing file), per-completion rewards, reward, advantage
                image = "square.png" if step != 20 else data_uri
                record = {
                    "step": step,
                    "sample_id": f"shapes/train/{k}",
                    "prompt": [
                        {
                            "role": "user",
                            "content": [{"type": "image"}, {"type": "text", "text": "Where is it?"}],
                        }
                    ],
                    "images": [image] if k != 1 else ["no/such/image.png"],
                    "solution": [40, 60, 200, 180],
                    "completions": ["<answer>[40, 60, 200, 180]</answer>", "<script>alert(1)</script>"],
                    "rewards": {"format": [1.0, 0.0], "iou": [1.0, None]},
                    "reward": [2.0, 0.0],
                    "advantage": [0.7071, -0.7071],
                }
                f.write(json.dumps(record) + "\n")
        f.write('{"step": 21, "sample_')  # a run still writing: torn last line
    return run_dir


def _embedded_images(page):
    return re.findall(r'src="data:image/(png|jpeg);base64,([A-Za-z0-9+/=]+)"', page)


def test_report_embeds_every_plot_and_thumbnail(tmp_path):
    run_dir = _fabricate_run(tmp_path / "run")
    out = write_report(run_dir)
    assert out == run_dir / "report.html"
    page = out.read_text()

    images = _embedded_images(page)
    formats = []
    for kind, data in images:
        with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as decoded:
            decoded.load()
            formats.append(decoded.format)
            assert decoded.format == {"png": "PNG", "jpeg": "JPEG"}[kind]
            assert decoded.width > 10 and decoded.height > 10
    # reward, kl, entropy, length, clip, time, eval, loss, grad_norm, perf: 10 plots; the learning
    # rate is constant over the run
    assert formats.count("PNG") == 10
    # 3 steps shown x 2 samples each, one of them without a readable image
    assert formats.count("JPEG") == 3
    assert "image not readable: no/such/image.png" in page
    assert "&lt;image&gt;Where is it?" in page and "solution: [40, 60, 200, 180]" in page
    assert "<th>format</th><th>iou</th><th>reward</th><th>advantage</th>" in page
    pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    assert len(pngs) == 10 and "time.png" in pngs and "other_perf.png" in pngs and "learning_rate.png" not in pngs
    # the steady phases of the drawn stack are drawn; the constant clip ratios are not
    assert "constant over the run (not plotted): clip_ratio/high_mean 0.02, clip_ratio/region_mean 0.03, " \
        "learning_rate 1e-06</p>" in page
    # completions are escaped, never executed
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
    # self-contained: nothing fetched from anywhere
    assert not re.search(r'(src|href)="(?!data:)', page)


def test_held_out_curve_against_steps_and_training_seconds(tmp_path):
    run_dir = _fabricate_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curves = eval_curves(rows, ["eval/iou_acc@0.5", "eval/iou"])
    # evaluated at steps 5, 10, 15, 20; each step took 4.8 s of training, the 30 s evals do not count
    assert curves["eval/iou_acc@0.5"]["step"] == [5, 10, 15, 20]
    assert curves["eval/iou_acc@0.5"]["seconds"] == pytest.approx([24.0, 48.0, 72.0, 96.0])
    assert curves["eval/iou_acc@0.5"]["value"] == pytest.approx([0.4, 0.5, 0.6, 0.7])
    assert curves["eval/iou"]["value"] == pytest.approx([0.45, 0.5, 0.55, 0.6])

    page = write_report(run_dir).read_text()
    with Image.open(run_dir / "report" / "eval.png") as figure:
        assert figure.size == (960, 320)  # two plots side by side: by step and by seconds
        pixels = np.asarray(figure.convert("L"))
    # both halves hold a plot (dark axes, ticks and lines), not one plot and a blank
    for half in (pixels[:, :480], pixels[:, 480:]):
        assert (half < 128).mean() > 0.01
    assert 'alt="Held-out accuracy" class="wide"' in page


def test_training_seconds_skip_evaluation_and_fill_missing_step_times():
    rows = [
        {"step": 1, "time/step": 2.0},
        {"step": 2, "time/rollout": 1.0, "time/update": 0.5, "time/eval": 40.0},  # no time/step logged
        {"step": 3, "time/step": 41.0, "time/eval": 40.0},  # time/step holds the evaluation
    ]
    assert training_seconds(rows) == [2.0, 3.5, 4.5]


def test_report_skips_absent_keys(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(5))
    )
    page = write_report(run_dir).read_text()
    assert len(_embedded_images(page)) == 1
    assert "No completions.jsonl" in page


def test_missing_metrics_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"metrics\.jsonl not found"):
        write_report(tmp_path)


def test_report_renders_in_headless_chromium(tmp_path):
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        if os.environ.get("MMGRPO_SKIP_BROWSER") == "1":
            pytest.skip("MMGRPO_SKIP_BROWSER=1 and no Chromium: the report is not rendered in a browser")
        pytest.fail(f"headless Chromium is needed to check the HTML report: run `{APT_HINT}`")
    run_dir = _fabricate_run(tmp_path / "run")
    html_path = write_report(run_dir)
    screenshot = tmp_path / "shot.png"
    command = [
        CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={screenshot}", "--window-size=1200,2000",
        html_path.resolve().as_uri(),
    ]  # fmt: skip
    env = {**os.environ, "HOME": str(tmp_path)}  # Chromium writes under HOME
    completed = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert screenshot.exists(), f"no screenshot (exit {completed.returncode}): {completed.stderr[-2000:]}"
    with Image.open(screenshot) as shot:
        pixels = np.asarray(shot.convert("L"), dtype=np.float64)  # [height, width]
    assert pixels.shape == (2000, 1200)
    # a blank (all-white) page has variance 0; plots and text give plenty
    assert pixels.var() > 100, pixels.var()
    assert (pixels < 128).mean() > 0.005  # some dark pixels: text, axes, lines


def test_constant_metrics_get_no_panel_but_are_named(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "reward": s / 10, "skipped": 0, "micro_batches": 2, "nonfinite_steps": 0,
             "kl": float("nan"), "eval/acc": 0.5 if s == 4 else None} for s in range(1, 6)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    page = write_report(run_dir).read_text()
    assert sorted(p.name for p in (run_dir / "report").glob("*.png")) == ["eval.png", "reward.png"]  # one eval: a result
    assert "constant over the run (not plotted): skipped 0, micro_batches 2, nonfinite_steps 0, kl nan</p>" in page
    assert len(_embedded_images(page)) == 2


def test_thumbnails_resolve_through_the_recorded_media_root(tmp_path, monkeypatch):
    media = tmp_path / "media"
    (media / "images").mkdir(parents=True)
    Image.new("RGB", (64, 48), "red").save(media / "images" / "a.png")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    records = [
        {"step": 1, "sample_id": "d/train/0", "prompt": "q", "images": ["images/a.png"], "media_root": str(media),
         "completions": ["a"]},
        {"step": 1, "sample_id": "d/train/1", "prompt": "q", "images": [], "images_in_memory": 2, "completions": ["a"]},
    ]
    (run_dir / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.chdir(tmp_path)  # neither the media root nor the run directory
    page = write_report(run_dir).read_text()
    assert [kind for kind, _ in _embedded_images(page)].count("jpeg") == 1
    assert "image not readable" not in page
    assert "2 images given in memory by the dataset (bytes, array or PIL): not kept in completions.jsonl" in page


def test_report_of_a_real_tiny_run_shows_its_dataset_images(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the report is read from neither the dataset's folder nor the run's
    run_dir = tmp_path / "run"
    cli_main(["train", *TINY_RUN, "--output_dir", str(run_dir)])
    records = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    ref = records[0]["images"][0]
    media_root = records[0]["media_root"]  # shapes-color: generated files under the dataset cache
    assert not os.path.isabs(ref) and (Path(media_root) / ref).is_file()
    assert not (elsewhere / ref).exists() and not (run_dir / ref).exists()

    page = write_report(run_dir).read_text()
    assert "image not readable" not in page
    thumbnails = [data for kind, data in _embedded_images(page) if kind == "jpeg"]
    per_step = Counter(record["step"] for record in records)
    assert len(thumbnails) == sum(min(2, n) for n in per_step.values()) == 4  # 2 steps, 2 samples each, one image each
    with Image.open(io.BytesIO(base64.b64decode(thumbnails[0]))) as thumbnail:
        assert max(thumbnail.size) > 10
    # metrics logged at both steps with one value each (skipped steps: 0) are named, not plotted
    constant_line = re.search(r'<p class="constant">constant over the run \(not plotted\): ([^<]*)</p>', page)
    assert constant_line is not None
    for named in constant_line.group(1).split(", "):
        key = named.rsplit(" ", 1)[0]
        assert not (run_dir / "report" / f"{key}.png").exists(), key
