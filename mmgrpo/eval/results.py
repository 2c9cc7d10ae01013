"""Run an evaluation and keep its results: samples.jsonl as it goes, eval.json and eval.md at the end.

    from mmgrpo.eval import run_eval
    result = run_eval(samples, generate_fn, "runs/eval-base", model="Qwen/Qwen2-VL-2B-Instruct",
                      dataset="shapes-color", split="test", metrics=["exact_match", "pass@4"],
                      num_samples=4)

`generate_fn(batch, num_samples)` gets a list of samples (objects with `id`, `messages`,
`columns`, `modality`, such as `mmgrpo.data.sample.Sample`) and returns, for each sample, its
`num_samples` completions: `list[list[str]]`. It may instead return `(completions, columns)`
where `columns` holds extra per-sample columns for the metrics (e.g. the template's
`to_image_box` callables that the `iou` reward uses).

Files in the output directory:
    eval_config.json  model, dataset, split, metrics, num_samples, config (checked on --resume)
    samples.jsonl     one line per finished sample, flushed at once: an interrupted eval keeps
                      what it finished, and `resume=True` skips those ids
    eval.json         {"model", "dataset", "split", "config", "metrics": {name: value},
                       "per_modality": {modality: {name: value}}, "counts": {modality: n},
                       "wall_time_s", "samples": [{"id", "modality", "prompt", "completions",
                       "solution", "scores": {name: value}, "time_s"}]}
    eval.md           the metrics table with a column per modality
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from mmgrpo.errors import ConfigError, DataError
from mmgrpo.eval.metrics import Metric, check_columns, get_metric, score_batch

log = logging.getLogger(__name__)

CONFIG_FILE = "eval_config.json"
SAMPLES_FILE = "samples.jsonl"
EVAL_FILE = "eval.json"
MARKDOWN_FILE = "eval.md"
# What must match for --resume to continue a run rather than mix two different evaluations.
_RESUME_KEYS = ("model", "dataset", "split", "metrics", "num_samples")
# The generation settings recorded in `config`, by the flag that sets them (`mmgrpo eval`).
_CONFIG_FLAGS = {"max_new_tokens": "max_completion_length", "temperature": "temperature", "limit": "limit"}

GenerateFn = Callable[[list, int], "list[list[str]] | tuple[list[list[str]], dict[str, list]]"]


def run_eval(
    samples: Iterable,
    generate_fn: GenerateFn,
    output_dir: str | os.PathLike,
    *,
    model: str,
    dataset: str,
    split: str,
    metrics: list[str],
    num_samples: int = 1,
    batch_size: int = 8,
    resume: bool = False,
    config: dict | None = None,
) -> dict:
    """Generate `num_samples` completions per sample, score them, write the results; returns eval.json."""
    output_dir = Path(output_dir)
    metric_list = [get_metric(name) for name in metrics]  # unknown names fail before any generation
    live_metrics = [m for m in metric_list if not m.corpus]
    header = {
        "model": model,
        "dataset": dataset,
        "split": split,
        "metrics": list(metrics),
        "num_samples": num_samples,
        "config": config or {},
    }
    _write_or_check_header(output_dir, header, resume)

    with SampleWriter(output_dir / SAMPLES_FILE, resume=resume) as writer:
        skipped = len(writer.done_ids)
        for batch in _batches(_todo(samples, set(writer.done_ids)), batch_size):
            start = time.perf_counter()
            ids = [sample.id for sample in batch]
            for metric in metric_list:  # a missing `solution` fails before any generation
                check_columns(metric, _batch_columns(batch, {}), ids)
            completions, extra_columns = _call_generate(generate_fn, batch, num_samples)
            columns = _batch_columns(batch, extra_columns)
            scores = score_batch(live_metrics, completions, columns, ids)
            seconds = (time.perf_counter() - start) / len(batch)
            for i, sample in enumerate(batch):
                writer.write(
                    {
                        "id": sample.id,
                        "modality": sample.modality,
                        "prompt": prompt_text(sample.messages),
                        "completions": completions[i],
                        "solution": sample.columns.get("solution"),
                        "scores": {name: values[i] for name, values in scores.items()},
                        "time_s": seconds,
                        **_kept(metric_list, completions[i], {key: values[i] for key, values in columns.items()}),
                    }
                )
            log.info("eval: %d samples done (%d from an earlier run)", len(writer.done_ids), skipped)
    return finalize_eval(output_dir)


def finalize_eval(output_dir: str | os.PathLike) -> dict:
    """Score the corpus metrics over samples.jsonl and write eval.json and eval.md; returns eval.json."""
    output_dir = Path(output_dir)
    header = _read_json(output_dir / CONFIG_FILE)
    records = read_samples(output_dir / SAMPLES_FILE)
    start = time.perf_counter()
    corpus_metrics = [m for m in map(get_metric, header["metrics"]) if m.corpus]
    corpus_values = _score_corpus(corpus_metrics, records)
    by_modality: dict[str, list[dict]] = {}
    for record in records:
        by_modality.setdefault(record["modality"], []).append(record)
    per_modality = {}
    for modality, group in by_modality.items():
        # corpus-level values (corpus BLEU) are recomputed on each modality's subset; per-sample
        # scores keep the values scored on the whole set (CIDEr's idf comes from all of it)
        with_values = [m for m in corpus_metrics if corpus_values.get(m.name)]
        group_values = _score_corpus(with_values, group, store=False)
        per_modality[modality] = {**_means(group), **_merged(group_values)}
    result = {
        "model": header["model"],
        "dataset": header["dataset"],
        "split": header["split"],
        "config": {**header["config"], "metrics": header["metrics"], "num_samples": header["num_samples"]},
        "metrics": {**_means(records), **_merged(corpus_values)},
        "per_modality": per_modality,
        "counts": {"all": len(records), **{m: len(g) for m, g in by_modality.items()}},
        "wall_time_s": sum(r.get("time_s", 0.0) for r in records) + time.perf_counter() - start,
        "samples": records,
    }
    _write_json(output_dir / EVAL_FILE, result)
    (output_dir / MARKDOWN_FILE).write_text(eval_markdown(result))
    return result


def _score_corpus(metrics: list[Metric], records: list[dict], store: bool = True) -> dict[str, dict]:
    """Run corpus metrics over `records`: {metric name: its corpus-level values}. With `store`,
    their per-sample scores are added to the records."""
    if not records:
        return {}
    ids = [r["id"] for r in records]
    columns = {"solution": [r.get("solution") for r in records]}
    for key in dict.fromkeys(key for r in records for key in r.get("kept", {})):  # e.g. mapped boxes (Metric.keeps)
        columns[key] = [r.get("kept", {}).get(key) for r in records]
    completions = [r["completions"] for r in records]
    out = {}
    for metric in metrics:
        check_columns(metric, columns, ids)
        values = metric.fn(completions, **columns)
        if store:
            for name, per_sample in values.scores.items():
                for record, value in zip(records, per_sample):
                    record["scores"][name] = value
        out[metric.name] = values.corpus
    return out


def _kept(metrics: list[Metric], completions: list[str], columns: dict) -> dict:
    """{"kept": ...}: what corpus metrics keep of one sample for their score at the end (Metric.keeps)."""
    kept = {}
    for metric in metrics:
        if metric.keeps is not None:
            kept.update(metric.keeps(completions, columns))
    return {"kept": kept} if kept else {}


def _merged(values_by_metric: dict[str, dict]) -> dict[str, float]:
    return {name: value for values in values_by_metric.values() for name, value in values.items()}


def _means(records: list[dict]) -> dict[str, float | None]:
    names = list(dict.fromkeys(name for r in records for name in r["scores"]))
    means = {}
    for name in names:
        values = [r["scores"].get(name) for r in records]
        kept = [float(v) for v in values if v is not None]
        means[name] = sum(kept) / len(kept) if kept else None
    return means


# ---------------------------------------------------------------------------------------------
# samples.jsonl


class SampleWriter:
    """Appends one JSON line per finished sample and flushes it at once.

    With `resume=True` an existing file is read first (a line torn by an interruption is cut
    off) and `done_ids` holds the ids already there; without it an existing file is an error,
    so two evaluations never mix in one file.
    """

    def __init__(self, path: str | os.PathLike, resume: bool = False):
        self.path = Path(path)
        if self.path.exists() and self.path.stat().st_size and not resume:
            raise ConfigError(
                f"{self.path} already holds results: pass --resume to continue that evaluation, "
                f"or choose another --output_dir"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = read_samples(self.path, repair=True) if self.path.exists() else []
        self.done_ids: set[str] = {r["id"] for r in records}
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if record["id"] in self.done_ids:
            raise DataError(f"sample id {record['id']!r} occurs twice: ids must be unique to pair results")
        self._file.write(json.dumps(record, ensure_ascii=False, default=_jsonable) + "\n")
        self._file.flush()
        self.done_ids.add(record["id"])

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_samples(path: str | os.PathLike, repair: bool = False) -> list[dict]:
    """The records of a samples.jsonl. A torn last line (the process died while writing it) is
    ignored, and with `repair` cut from the file; a bad line elsewhere is a DataError."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} not found: no evaluation results there")
    records, good_bytes = [], 0
    with open(path, "rb") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise DataError(f"{path} line {number} is not valid JSON: fix or delete that line") from None
        good_bytes += len(line)
    if repair and good_bytes < path.stat().st_size:
        log.warning("%s: cutting a torn last line (an interrupted write)", path)
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return records


def load_eval(path: str | os.PathLike) -> dict:
    """An eval.json, given its path or the directory holding it."""
    path = Path(path)
    if path.suffix != ".json":
        path = path / EVAL_FILE
    if not path.exists():
        raise ConfigError(f"{path} not found: run `mmgrpo eval ... --output_dir {path.parent}` first")
    result = _read_json(path)
    if "samples" not in result:
        raise ConfigError(f"{path} is not an eval.json (no 'samples' key)")
    return result


# ---------------------------------------------------------------------------------------------
# eval.md


def eval_markdown(result: dict) -> str:
    """The metrics table (one column per modality when there are several) as Markdown."""
    modalities = list(result["per_modality"]) if len(result["per_modality"]) > 1 else []
    counts = result.get("counts", {})
    lines = [
        f"# Evaluation: {result['model']} on {result['dataset']} ({result['split']})",
        "",
        f"{counts.get('all', len(result['samples']))} samples, "
        f"{result['config'].get('num_samples', 1)} completion(s) each, "
        f"wall time {result['wall_time_s']:.1f} s.",
        "",
        "| " + " | ".join(["metric", "all", *modalities]) + " |",
        "|---|---|" + "---|" * len(modalities),
    ]
    for name, value in result["metrics"].items():
        cells = [format_value(value)] + [
            format_value(result["per_modality"][m].get(name)) for m in modalities
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = [str(counts.get("all", ""))] + [str(counts.get(m, "")) for m in modalities]
    lines.append("| samples | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_value(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# helpers


def prompt_text(messages: list[dict]) -> str:
    """The user turns of a conversation as text, one tag per medium (`<image>`).

    >>> prompt_text([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}])
    '<image>Color?'
    """
    lines = []
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            lines.append(content)
        else:
            lines.append(
                "".join(
                    p.get("text", "") if p.get("type") == "text" else f"<{p.get('type')}>" for p in content
                )
            )
    return "\n".join(lines)


def _todo(samples: Iterable, done: set[str]) -> Iterator:
    """The samples whose ids are not in `done` (finished by an earlier run)."""
    seen = set()
    for sample in samples:
        if sample.id in seen:
            raise DataError(f"sample id {sample.id!r} occurs twice in the dataset: ids must be unique")
        seen.add(sample.id)
        if sample.id not in done:
            yield sample


def _batches(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _call_generate(generate_fn, batch: list, num_samples: int):
    output = generate_fn(batch, num_samples)
    completions, extra = output if isinstance(output, tuple) else (output, {})
    if len(completions) != len(batch) or any(len(c) != num_samples for c in completions):
        raise ValueError(
            f"generate_fn must return {num_samples} completions for each of the {len(batch)} samples, "
            f"got {[len(c) for c in completions]}"
        )
    return [list(c) for c in completions], extra


def _batch_columns(batch: list, extra: dict[str, list]) -> dict[str, list]:
    names = list(dict.fromkeys(name for sample in batch for name in sample.columns))
    columns = {name: [sample.columns.get(name) for sample in batch] for name in names}
    return {**columns, **extra}


def _write_or_check_header(output_dir: Path, header: dict, resume: bool) -> None:
    path = output_dir / CONFIG_FILE
    if resume and path.exists():
        previous = _read_json(path)
        changed = [(k, previous.get(k), header[k]) for k in _RESUME_KEYS if previous.get(k) != header[k]]
        then, now = previous.get("config", {}), header["config"]  # the generation settings, named by their flags
        changed += [(f"--{_CONFIG_FLAGS.get(k, k)}", then.get(k), now.get(k)) for k in sorted({*then, *now})
                    if then.get(k) != now.get(k)]
        if changed:
            diffs = "; ".join(f"{name}: {old!r} then, {new!r} now" for name, old, new in changed)
            raise ConfigError(
                f"--resume in {output_dir}: the earlier evaluation differs ({diffs}); "
                f"use the same settings or another --output_dir"
            )
        return
    samples_file = output_dir / SAMPLES_FILE
    if not resume and samples_file.exists() and samples_file.stat().st_size:
        raise ConfigError(
            f"{samples_file} already holds results: pass --resume to continue that "
            f"evaluation, or choose another --output_dir"
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    _write_json(path, header)


def _jsonable(value):
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"{path} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error})") from None


def _write_json(path: Path, value) -> None:
    # write then rename: a reader never sees half a file
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, ensure_ascii=False, default=_jsonable))
    os.replace(tmp, path)
