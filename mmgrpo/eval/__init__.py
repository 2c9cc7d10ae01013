"""Evaluation: metrics, eval runs with resumable results, A/B statistics, training reports.

    run_eval(samples, generate_fn, output_dir, model=..., dataset=..., split=..., metrics=[...])
        -> eval.json dict                                  (results.py, metrics.py)
    compare(eval_a, eval_b, seed=0, n_boot=10_000) -> dict  (compare.py, stats.py)
    write_report(run_dir) -> Path of report.html           (report.py)

See docs/evaluation.md.
"""

from mmgrpo.eval import detection, vqa_official  # noqa: F401  (register `map`, `vqa_accuracy`)
from mmgrpo.eval.compare import compare, compare_markdown, print_compare, write_compare
from mmgrpo.eval.metrics import get_metric, metric_names, pass_at_k, register_metric
from mmgrpo.eval.report import write_report
from mmgrpo.eval.results import SampleWriter, eval_markdown, finalize_eval, load_eval, run_eval

__all__ = [
    "SampleWriter",
    "compare",
    "compare_markdown",
    "eval_markdown",
    "finalize_eval",
    "get_metric",
    "metric_names",
    "load_eval",
    "pass_at_k",
    "print_compare",
    "register_metric",
    "run_eval",
    "write_compare",
    "write_report",
]
