"""A/B comparison of two evaluations of the same samples: is B better than A, and by how much?

    result = compare("runs/eval-base", "runs/eval-grpo", seed=0)
    print_compare(result)                      # rich table on the console
    write_compare(result, "runs/compare.json")  # compare.json + compare.md beside it

Samples are paired by id. For each per-sample score both evaluations have: A's and B's mean,
the difference B - A with a 95% paired bootstrap CI, and a two-sided p-value: the exact
McNemar test when every score is 0 or 1, else the paired sign-flip permutation test
(see `mmgrpo.eval.stats`). Corpus-level values (corpus BLEU) have no per-sample scores and are
compared through their per-sample counterparts (`sentence_bleu`).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from mmgrpo.errors import ConfigError
from mmgrpo.eval.results import format_value, load_eval
from mmgrpo.eval.stats import is_binary, mcnemar_exact, paired_bootstrap_ci, sign_flip_test

HEADER = "| metric | A (baseline) | B | diff [95% CI] | p |"


def compare(
    eval_a: str | os.PathLike | dict, eval_b: str | os.PathLike | dict, *, seed: int = 0, n_boot: int = 10_000
) -> dict:
    """Compare eval B against baseline A (eval.json paths, their directories, or loaded dicts)."""
    a, b = (e if isinstance(e, dict) else load_eval(e) for e in (eval_a, eval_b))
    for side, name in ((a, eval_a), (b, eval_b)):
        if not side.get("samples"):
            raise ConfigError(f"{name if not isinstance(name, dict) else 'an eval'} has no samples: nothing to compare "
                              "(an evaluation of --limit 0 or of an empty split?)")
    scores_a = {s["id"]: s["scores"] for s in a["samples"]}
    scores_b = {s["id"]: s["scores"] for s in b["samples"]}
    _check_same_ids(scores_a, scores_b)
    ids = sorted(scores_a)

    names_a = list(dict.fromkeys(n for s in a["samples"] for n in s["scores"]))
    names_b = set(n for s in b["samples"] for n in s["scores"])
    rows = []
    for name in names_a:
        if name not in names_b:
            continue
        pairs = [(scores_a[i].get(name), scores_b[i].get(name)) for i in ids]
        pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
        if not pairs:
            continue
        values_a, values_b = np.array(pairs, dtype=np.float64).T  # [n] each
        # one stream per metric, seeded by (seed, name): a metric's numbers do not depend on
        # which other metrics are compared
        metric_seed = [seed, zlib.crc32(name.encode())]
        binary = is_binary(values_a) and is_binary(values_b)
        p = (
            mcnemar_exact(values_a, values_b)
            if binary
            else sign_flip_test(values_a, values_b, n_perm=n_boot, seed=metric_seed)
        )
        low, high = paired_bootstrap_ci(values_a, values_b, n_boot=n_boot, seed=metric_seed)
        rows.append(
            {
                "metric": name,
                "a": float(values_a.mean()),
                "b": float(values_b.mean()),
                "diff": float((values_b - values_a).mean()),
                "ci_low": low,
                "ci_high": high,
                "p": p,
                "test": "mcnemar_exact" if binary else "sign_flip_permutation",
                "n": len(pairs),
            }
        )
    only_one = sorted(set(names_a) ^ names_b)
    if not rows:
        shared = sorted(set(names_a) & names_b)
        raise ConfigError(("no metric has a score on both sides for any sample" + (f" ({', '.join(shared)} are missing "
                           "on one side everywhere)" if shared else f" (A scores {', '.join(names_a) or 'nothing'}, B "
                           f"{', '.join(sorted(names_b)) or 'nothing'})")) + ": nothing to compare.")
    return {
        "a": _describe(a, eval_a),
        "b": _describe(b, eval_b),
        "n_samples": len(ids),
        "seed": seed,
        "n_boot": n_boot,
        "metrics": rows,
        "not_compared": only_one,  # scores only one of the evaluations has
    }


def _check_same_ids(scores_a: dict, scores_b: dict) -> None:
    only_a, only_b = sorted(set(scores_a) - set(scores_b)), sorted(set(scores_b) - set(scores_a))
    if only_a or only_b:
        raise ConfigError(
            f"A and B were evaluated on different samples: {len(only_a) + len(only_b)} ids differ "
            f"({len(only_a)} only in A, e.g. {only_a[:3]}; {len(only_b)} only in B, e.g. {only_b[:3]}). "
            f"Evaluate both on the same dataset and split, and let both finish (or --resume them)"
        )


def _describe(result: dict, source) -> dict:
    return {
        "source": None if isinstance(source, dict) else str(source),
        "model": result.get("model"),
        "dataset": result.get("dataset"),
        "split": result.get("split"),
        "wall_time_s": result.get("wall_time_s"),
    }


# ---------------------------------------------------------------------------------------------
# output


def _cells(row: dict) -> list[str]:
    def signed(x):
        return f"{x:+.4g}"

    test = "McNemar" if row["test"] == "mcnemar_exact" else "perm."
    return [
        row["metric"],
        format_value(row["a"]),
        format_value(row["b"]),
        f"{signed(row['diff'])} [{signed(row['ci_low'])}, {signed(row['ci_high'])}]",
        f"{row['p']:.3g} ({test})",
    ]


def _time_cells(result: dict) -> list[str]:
    time_a, time_b = result["a"]["wall_time_s"], result["b"]["wall_time_s"]
    diff = f"{time_b - time_a:+.4g}" if time_a is not None and time_b is not None else "-"
    return ["eval wall time (s)", format_value(time_a), format_value(time_b), diff, ""]


def compare_markdown(result: dict) -> str:
    a, b = result["a"], result["b"]
    lines = [
        "# A/B comparison",
        "",
        f"- A (baseline): {a['model']} ({a['source'] or 'in memory'})",
        f"- B: {b['model']} ({b['source'] or 'in memory'})",
        f"- {result['n_samples']} paired samples of {a['dataset']} ({a['split']}); "
        f"{result['n_boot']} bootstrap resamples, seed {result['seed']}",
        "- diff = B - A with its 95% paired bootstrap CI; p is two-sided: exact McNemar test for "
        "0/1 scores, paired sign-flip permutation test otherwise",
        "",
        HEADER,
        "|---|---|---|---|---|",
    ]
    for row in result["metrics"]:
        lines.append("| " + " | ".join(_cells(row)) + " |")
    lines.append("| " + " | ".join(_time_cells(result)) + " |")
    if result["not_compared"]:
        lines += ["", f"Not compared (only one evaluation has them): {', '.join(result['not_compared'])}"]
    return "\n".join(lines) + "\n"


def print_compare(result: dict, console=None) -> None:
    """The comparison as a rich table on the console."""
    from rich.console import Console
    from rich.table import Table

    a, b = result["a"], result["b"]
    table = Table(title=f"A = {a['model']}  vs  B = {b['model']}  ({result['n_samples']} paired samples)")
    for column in ("metric", "A (baseline)", "B", "diff [95% CI]", "p"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in result["metrics"]:
        cells = _cells(row)
        significant = row["p"] < 0.05
        colour = ("green" if row["diff"] > 0 else "red") if significant else None
        table.add_row(*cells[:3], f"[{colour}]{cells[3]}[/]" if colour else cells[3], cells[4])
    table.add_row(*_time_cells(result))
    (console or Console()).print(table)


def write_compare(result: dict, output: str | os.PathLike) -> tuple[Path, Path]:
    """Write compare.json and compare.md: `output` is the JSON path, or a directory for both."""
    output = Path(output)
    json_path = output if output.suffix == ".json" else output / "compare.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    markdown_path = json_path.with_suffix(".md")
    markdown_path.write_text(compare_markdown(result))
    return json_path, markdown_path
