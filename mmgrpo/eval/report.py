"""One self-contained HTML report of a training run: curves and a sample of completions.

    mmgrpo report runs/shapes-grpo        # -> runs/shapes-grpo/report.html (+ report/*.png)

Reads RUN_DIR/metrics.jsonl (one JSON object per logged step) and, when present,
RUN_DIR/completions.jsonl (step, sample_id, prompt (text or chat messages), images (paths or
data URIs), media_root (what relative paths are relative to), images_in_memory, solution, completions, rewards {name: [per completion]}, reward, advantage). Every plot
is a PNG under RUN_DIR/report/ and is also embedded in the HTML as a base64 data URI, so the
one file can be mailed or attached anywhere. A panel appears only if its keys were logged:

    Reward             reward (with a +-reward_std band), reward/<name>
    KL, Entropy        kl, entropy
    Completion length  completion_length, completion_length/*
    Clip ratios        clip_ratio/*
    Seconds per phase  time/<phase>, stacked; time/step (the whole step) as a line
    Held-out accuracy  eval/<metric> against the step and against the training seconds (the sum
                       of time/step - time/eval up to that step: evaluations excluded)
    Loss, Gradient norm, Learning rate (learning_rate/<group> too: --vit_lr ...)
    Modality reliance  fusion/reliance/<modality> (--fusion_probe_steps; docs/fusion.md)
    Attention share    fusion/attention/<modality>/<band>
    and one panel per prefix of any other numeric key

A metric whose values are all equal over the run (skipped, micro_batches, a fixed learning rate)
gets no curve: a flat line is noise among the panels. Such metrics are named, with their value,
in one line under the plots, so nothing is left out silently. Relative image paths are read
against the record's media_root (the dataset's media folder, recorded by the engine), then, for
runs from before it was recorded, against the working directory and the run directory.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import warnings
from pathlib import Path

from mmgrpo.errors import ConfigError, DataError
from mmgrpo.eval.results import prompt_text

THUMBNAIL_SIZE = 160  # pixels, longest side
MAX_COMPLETION_CHARS = 2000
# (title, file stem, does this key belong to the panel?, stacked?) in display order
PANELS = [
    ("Reward", "reward", lambda k: k == "reward" or (k.startswith("reward/") and not k.endswith("_std")), False),
    ("KL", "kl", lambda k: k == "kl", False),
    ("Entropy", "entropy", lambda k: k == "entropy", False),
    ("Completion length", "completion_length", lambda k: k.split("/")[0] == "completion_length", False),
    ("Clip ratios", "clip_ratio", lambda k: k.startswith("clip_ratio"), False),
    ("Seconds per phase", "time", lambda k: k.startswith("time/"), True),
    ("Loss", "loss", lambda k: k == "loss", False),
    ("Gradient norm", "grad_norm", lambda k: k == "grad_norm", False),
    ("Learning rate", "learning_rate", lambda k: k == "learning_rate" or k.startswith("learning_rate/"), False),
    ("Modality reliance (nats per token)", "fusion_reliance", lambda k: k.startswith("fusion/reliance/"), False),
    ("Attention share by layer band", "fusion_attention", lambda k: k.startswith("fusion/attention/"), False),
]
_NOT_PLOTTED = {"step", "reward_std", "epoch"}
WIDE = ' class="wide"'  # the held-out panel has two plots side by side  # step is the x axis; reward_std is the reward band


def write_report(run_dir: str | os.PathLike, *, steps_shown: int = 4, samples_per_step: int = 2) -> Path:
    """Write RUN_DIR/report.html and RUN_DIR/report/*.png; returns the HTML path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        raise ConfigError(
            f"{metrics_path} not found: `mmgrpo report` needs a training run directory "
            f"(the --output_dir of `mmgrpo train`) holding metrics.jsonl"
        )
    rows = _read_jsonl(metrics_path)
    if not rows:
        raise ConfigError(f"{metrics_path} has no logged steps yet")
    for index, row in enumerate(rows):
        row.setdefault("step", index)
    rows = latest_run(rows, metrics_path)

    plot_dir = run_dir / "report"
    plot_dir.mkdir(exist_ok=True)
    keys = _numeric_keys(rows)
    constants = _left_out(constant_metrics(rows, keys), keys)
    figures = []  # (title, png bytes)
    for title, stem, png in _panels(rows, skip=constants):
        (plot_dir / f"{stem}.png").write_bytes(png)
        figures.append((title, png))

    completions_path = run_dir / "completions.jsonl"
    samples = (
        _pick_samples(latest_run(_read_jsonl(completions_path), completions_path, rows_per_step=2), steps_shown, samples_per_step)
        if completions_path.exists()
        else []
    )

    page = _html(run_dir, rows, figures, samples, constants)
    out = run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out


# ---------------------------------------------------------------------------------------------
# plots


def _numeric_keys(rows: list[dict]) -> list[str]:
    keys = dict.fromkeys(
        k for row in rows for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)
    )
    return [k for k in keys if k not in _NOT_PLOTTED]


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), int | float)]
    return [p[0] for p in points], [p[1] for p in points]


def constant_metrics(rows: list[dict], keys: list[str]) -> dict[str, float]:
    """{key: its one value} for each key logged at two steps or more with the same value every
    time (all NaN counts as the same value). A key logged once is not called constant: one
    evaluation at the end is a result, not a flat line.

    >>> nan = float("nan")
    >>> rows = [{"step": 1, "skipped": 0, "loss": 0.5, "kl": nan}, {"step": 2, "skipped": 0, "loss": 0.4, "kl": nan}]
    >>> constant_metrics(rows, ["skipped", "loss", "kl"])
    {'skipped': 0, 'kl': nan}
    """
    constants = {}
    for key in keys:
        _, values = _series(rows, key)
        distinct = {"nan" if isinstance(v, float) and math.isnan(v) else v for v in values}
        if len(values) >= 2 and len(distinct) == 1:
            constants[key] = values[0]
    return constants


def _left_out(constants: dict, keys: list[str]) -> dict:
    """The constant metrics no panel draws: all but the steady phases of a stack that is drawn."""
    drawn = set()
    for _, _, belongs, stacked in PANELS:
        if stacked and any(belongs(k) and k not in constants for k in keys):
            drawn.update(k for k in constants if belongs(k))
    return {k: v for k, v in constants.items() if k not in drawn}


def _panels(rows: list[dict], skip=frozenset()):
    """Yield (title, file stem, PNG bytes) for every panel that has data; keys in `skip` (the
    constant ones) are left out, except as phases of a stack where another phase varies: the stack
    shows how each step divides, and a steady phase is part of that."""
    logged = _numeric_keys(rows)
    keys = [k for k in logged if k not in skip]
    claimed = set()
    for title, stem, belongs, stacked in PANELS:
        panel_keys = [k for k in (logged if stacked else keys) if belongs(k)]
        claimed.update(panel_keys)
        if any(k not in skip for k in panel_keys):
            yield title, stem, _plot(rows, title, panel_keys, stacked)
        if stem == "time":  # the held-out curve comes right after the seconds per phase
            eval_keys = [k for k in keys if k.startswith("eval/")]
            claimed.update(eval_keys)
            if eval_keys:
                yield "Held-out accuracy", "eval", _plot_eval(rows, eval_keys)
    # whatever else was logged: one panel per prefix ("perf/tokens_per_s" -> "perf")
    others: dict[str, list[str]] = {}
    for key in keys:
        if key not in claimed:
            others.setdefault(key.split("/")[0], []).append(key)
    for prefix, panel_keys in others.items():
        stem = "other_" + "".join(c if c.isalnum() else "_" for c in prefix)
        yield prefix, stem, _plot(rows, prefix, panel_keys, False)


def training_seconds(rows: list[dict]) -> list[float]:
    """Cumulative training seconds at the end of each row's step: the sum so far of `time/step`
    (the step's wall time, which holds an evaluation run in it) minus `time/eval`. A row without
    `time/step` adds the sum of its `time/<phase>` keys other than time/eval.

    >>> training_seconds([{"time/step": 1.5}, {"time/step": 11.0, "time/eval": 9.0}, {"time/rollout": 1.0, "time/update": 0.5}])
    [1.5, 3.5, 5.0]
    """
    total, out = 0.0, []
    for row in rows:
        step_seconds = row.get("time/step")
        evaluating = row.get("time/eval")
        evaluating = float(evaluating) if isinstance(evaluating, int | float) else 0.0
        if isinstance(step_seconds, int | float):
            step_seconds = max(0.0, float(step_seconds) - evaluating)
        else:
            step_seconds = sum(
                float(v) for k, v in row.items()
                if k.startswith("time/") and k != "time/eval" and isinstance(v, int | float)
            )
        total += step_seconds
        out.append(total)
    return out


def eval_curves(rows: list[dict], keys: list[str]) -> dict[str, dict[str, list]]:
    """Each eval metric's points: {key: {"step": [...], "seconds": [...], "value": [...]}}.

    >>> rows = [{"step": 1, "time/step": 2.0}, {"step": 2, "time/step": 2.0, "eval/acc": 0.5}]
    >>> eval_curves(rows, ["eval/acc"])
    {'eval/acc': {'step': [2], 'seconds': [4.0], 'value': [0.5]}}
    """
    seconds = training_seconds(rows)
    curves = {}
    for key in keys:
        points = [(row["step"], s, row[key]) for row, s in zip(rows, seconds) if isinstance(row.get(key), int | float)]
        curves[key] = {"step": [p[0] for p in points], "seconds": [p[1] for p in points], "value": [p[2] for p in points]}
    return curves


def _plot_eval(rows: list[dict], keys: list[str]) -> bytes:
    """Held-out metrics against the step (left) and the training seconds (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9.6, 3.2), dpi=100)
    FigureCanvasAgg(figure)
    by_step, by_seconds = figure.subplots(1, 2, sharey=True)
    for key, curve in eval_curves(rows, keys).items():
        label = key.removeprefix("eval/")
        by_step.plot(curve["step"], curve["value"], marker="o", markersize=4, label=label)
        by_seconds.plot(curve["seconds"], curve["value"], marker="o", markersize=4, label=label)
    by_step.set_xlabel("step")
    by_step.set_title("Held-out accuracy by step")
    by_seconds.set_xlabel("training seconds (evaluation excluded)")
    by_seconds.set_title("by training time")
    for axes in (by_step, by_seconds):
        axes.grid(alpha=0.3)
    by_step.legend(fontsize=7, loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _plot(rows: list[dict], title: str, keys: list[str], stacked: bool) -> bytes:
    # The object-oriented API with an explicit Agg canvas: no pyplot state, no display needed,
    # and the caller's matplotlib backend is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6.4, 3.2), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if stacked:
        phases = [k for k in keys if k != "time/step"]  # time/step is the whole step, not a phase
        timed = [row for row in rows if any(k in row for k in phases)]
        steps = [row["step"] for row in timed]
        values = [[float(row.get(k) or 0.0) for row in timed] for k in phases]  # [phases, steps]
        axes.stackplot(steps, values, labels=[k.split("/", 1)[-1] for k in phases])
        if "time/step" in keys:
            axes.plot(*_series(rows, "time/step"), color="black", linestyle="--", label="step (total)")
        axes.set_ylabel("seconds")
    else:
        for key in keys:
            steps, values = _series(rows, key)
            sparse = len(steps) < 0.5 * len(rows)  # eval metrics: a few points, show them
            axes.plot(steps, values, marker="o" if sparse else None, markersize=4, label=key)
            if key == "reward":
                band_steps, std = _series(rows, "reward_std")
                if band_steps == steps:
                    low = [v - s for v, s in zip(values, std)]
                    high = [v + s for v, s in zip(values, std)]
                    axes.fill_between(steps, low, high, alpha=0.2, label="reward ± std")
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if len(keys) > 1 or "/" in keys[0] or title == "Reward":
        axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# completions


def _pick_samples(records: list[dict], steps_shown: int, per_step: int) -> list[dict]:
    """A few records from the first, the last and evenly spaced steps in between."""
    by_step: dict = {}
    for record in records:
        by_step.setdefault(record.get("step", 0), []).append(record)
    steps = sorted(by_step)
    if len(steps) > steps_shown:
        steps = (
            [steps[round(i * (len(steps) - 1) / (steps_shown - 1))] for i in range(steps_shown)]
            if steps_shown > 1
            else steps[-1:]
        )
    return [r for step in dict.fromkeys(steps) for r in by_step[step][:per_step]]


def thumbnail_data_uri(source: str | os.PathLike | io.BytesIO, size: int = THUMBNAIL_SIZE) -> str:
    """A small JPEG of an image (a path or a file object) as a data URI; OSError if unreadable."""
    from PIL import Image

    with Image.open(source) as image:
        image = image.convert("RGB")
        image.thumbnail((size, size))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def _image_source(ref: str, run_dir: Path, media_root: str | None = None):
    if ref.startswith("data:"):  # a data URI: data:image/png;base64,....
        return io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))
    path = Path(ref.removeprefix("file://"))
    if path.is_absolute():
        return path
    # relative paths: to the dataset's media root as training read them; a run from before the
    # media root was recorded: to the working directory, else to the run directory
    candidates = ([Path(media_root) / path] if media_root else []) + [path, run_dir / path]
    return next((c for c in candidates if c.exists()), candidates[0])


def _media_html(images, run_dir: Path, media_root: str | None = None, in_memory: int = 0) -> str:
    parts = []
    if in_memory:  # bytes, arrays or PIL images in the dataset: completions.jsonl has no file to show
        parts.append(f'<span class="missing">{in_memory} image{"s" * (in_memory > 1)} given in memory by the '
                     "dataset (bytes, array or PIL): not kept in completions.jsonl</span>")
    for ref in images or []:
        shown = html.escape(str(ref)[:120])
        try:
            uri = thumbnail_data_uri(_image_source(str(ref), run_dir, media_root))
        except (OSError, ValueError):
            parts.append(f'<span class="missing">image not readable: {shown}</span>')
            continue
        parts.append(f'<img class="thumb" src="{uri}" alt="{shown}">')
    return f'<div class="media">{"".join(parts)}</div>' if parts else ""


def _sample_html(record: dict, run_dir: Path) -> str:
    completions = record.get("completions") or []
    if isinstance(completions, str):
        completions = [completions]
    # per-completion columns: each reward function, then the total reward and the advantage
    columns = dict(record.get("rewards") or {})
    columns.update({k: record[k] for k in ("reward", "advantage") if k in record})
    header = "".join(f"<th>{html.escape(name)}</th>" for name in columns)
    body = []
    for i, completion in enumerate(completions):
        text = str(completion)
        if len(text) > MAX_COMPLETION_CHARS:
            text = text[:MAX_COMPLETION_CHARS] + f" … ({len(str(completion))} characters)"
        cells = []
        for value in columns.values():
            value = value[i] if isinstance(value, list) and len(value) == len(completions) else value
            cells.append(f"<td class='num'>{html.escape(_fmt(value))}</td>")
        body.append(
            f"<tr><td class='num'>{i}</td><td><pre>{html.escape(text)}</pre></td>{''.join(cells)}</tr>"
        )
    prompt = record.get("prompt", "")
    if isinstance(prompt, list):  # the sample's chat messages
        prompt = prompt_text(prompt)
    solution = ""
    if record.get("solution") is not None:
        solution = f'<p class="solution">solution: {html.escape(str(record["solution"])[:500])}</p>'
    title = f"step {record.get('step', '?')} · {record.get('sample_id', '')}"
    return (
        f'<div class="sample"><h3>{html.escape(title)}</h3>'
        f"{_media_html(record.get('images'), run_dir, record.get('media_root'), record.get('images_in_memory') or 0)}"
        f'<pre class="prompt">{html.escape(str(prompt))}</pre>{solution}'
        f"<table><tr><th>#</th><th>completion</th>{header}</tr>{''.join(body)}</table></div>"
    )


# ---------------------------------------------------------------------------------------------
# page


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; padding: 0 1em; max-width: 1400px; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ccc; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
.plots img { width: 560px; max-width: 100%; border: 1px solid #eee; }
.plots img.wide { width: 840px; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 4px 8px; vertical-align: top; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { white-space: pre-wrap; margin: 0; font-size: 0.9em; }
pre.prompt { background: #f6f6f6; padding: 6px; margin: 6px 0; }
.sample { margin-bottom: 1.5em; }
.thumb { margin-right: 6px; border: 1px solid #ccc; }
.missing { color: #a33; }
.solution { margin: 4px 0; color: #555; }
.constant { color: #555; font-size: 0.9em; }
"""


def _summary_html(rows: list[dict]) -> str:
    keys = [
        k
        for k in _numeric_keys(rows)
        if k.split("/")[0] in ("reward", "kl", "entropy", "eval") or k == "completion_length"
    ]
    lines = []
    for key in keys:
        _, values = _series(rows, key)
        cells = "".join(
            f"<td class='num'>{_fmt(v)}</td>" for v in (values[0], values[-1], min(values), max(values))
        )
        lines.append(f"<tr><td>{html.escape(key)}</td>{cells}</tr>")
    if not lines:
        return ""
    return (
        "<table><tr><th>key</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>"
        + "".join(lines)
        + "</table>"
    )


def _constant_html(constants: dict) -> str:
    if not constants:
        return ""
    named = ", ".join(f"{key} {_fmt(value)}" for key, value in constants.items())
    return f'<p class="constant">constant over the run (not plotted): {html.escape(named)}</p>'


def _html(run_dir: Path, rows: list[dict], figures: list, samples: list[dict], constants: dict | None = None) -> str:
    steps = [row["step"] for row in rows]
    seconds = sum(
        float(v)
        for row in rows
        for k, v in row.items()
        if k.startswith("time/") and k != "time/step" and isinstance(v, int | float)
    )
    plots = "".join(
        f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}" alt="{html.escape(title)}"'
        f'{WIDE if title == "Held-out accuracy" else ""}>'
        for title, png in figures
    )
    sample_html = (
        "".join(_sample_html(r, run_dir) for r in samples) or "<p>No completions.jsonl in this run.</p>"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mmgrpo report: {html.escape(run_dir.name)}</title>
<style>{_CSS}</style></head><body>
<h1>Training run {html.escape(str(run_dir))}</h1>
<p>{len(rows)} logged steps ({steps[0]} to {steps[-1]}); {seconds:.0f} s in timed phases.</p>
{_summary_html(rows)}
<h2>Curves</h2><div class="plots">{plots}</div>{_constant_html(constants or {})}
<h2>Sample completions</h2>{sample_html}
</body></html>
"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def latest_run(rows: list[dict], path: Path, *, rows_per_step: int = 1) -> list[dict]:
    """The rows of one run: where the step goes back (a folder reused by an mmgrpo older than the
    --output_dir check, or a crashed run continued without --resume_from_checkpoint), the later
    rows replace the earlier ones from that step on, with a warning. rows_per_step > 1: a step
    may have several rows in a row (completions.jsonl: one per logged prompt).

    >>> [r["step"] for r in latest_run([{"step": s} for s in (1, 2, 3, 1, 2)], Path("m.jsonl"))]
    [1, 2]
    """
    kept: list[dict] = []
    for row in rows:
        step = row.get("step", 0)
        last = kept[-1].get("step", 0) if kept else None
        if last is not None and (step < last or (step == last and rows_per_step == 1)):
            warnings.warn(f"{path} holds more than one run (step {step} logged again after {last}): the report shows "
                          "the latest from there on", stacklevel=2)
            kept = [r for r in kept if r.get("step", 0) < step]
        kept.append(row)
    return kept


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a run still writing, or killed) is ignored."""
    rows = []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise DataError(f"{path} line {number} is not valid JSON: fix or delete that line") from None
    return rows
