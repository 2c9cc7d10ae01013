"""Evaluation during training: every --eval_steps steps and after the last one, on --eval_dataset.

    mmgrpo train --model tiny:qwen2-vl --dataset shapes-color --reward_funcs vqa_accuracy \\
        --eval_dataset shapes-color:test --eval_steps 50 --eval_limit 200 \\
        --metric_for_best_model vqa_accuracy --output_dir runs/x

Each evaluation is `mmgrpo eval` run on the training run's own rollout engine and template: greedy, one
completion per sample, up to --max_completion_length tokens (or the dataset's own), the model in eval mode meanwhile
(then back in train mode). It writes

    output_dir/eval/step-N/         eval.json, eval.md, samples.jsonl (as `mmgrpo eval` does)
    output_dir/metrics.jsonl        eval/<metric> in that step's line (TensorBoard gets them too),
                                    and time/eval (the loop's timer), the evaluation's seconds

With several eval datasets (`--eval_dataset shapes-color shapes-count`) each is evaluated in turn
into output_dir/eval/step-N/<dataset>/ and logged as eval/<dataset>/<metric>; a best-model metric
is then named `<dataset>/<metric>` (default: the first dataset's first metric).
    output_dir/checkpoint-best/     the weights at the best evaluation so far by
                                    --metric_for_best_model, with best.json {"step", "metric", "value" ...}

The run builds one before any model loads (the eval dataset and metrics resolve then), and the
loop makes one call per step, handing it the model in training and what generates and saves it
(`run.evaluate(run.evaluator, step, state, final)` in mmgrpo/training/build.py does):

    metrics.update(evaluator.maybe_evaluate(step, state, final=step == total_steps, model=model, rollout=engine,
                                            template=template, strategy=strategy, media_kwargs=media, save=save))

The best value so far and its step live in the run's `TrainState` (state.best_metric, state.best_step),
so a resumed run keeps checkpoint-best as the uninterrupted run would.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmgrpo.config import EvalConfig
from mmgrpo.errors import ConfigError
from mmgrpo.forward.policy import autocast
from mmgrpo.runstate.checkpoint import save_atomically

if TYPE_CHECKING:
    from mmgrpo.parallel import Strategy
    from mmgrpo.rollout import RolloutEngine

BEST_DIR = "checkpoint-best"
BEST_FILE = "best.json"


class TrainingEval:
    """Runs the evaluations --eval_* ask for (`options`) and keeps the best checkpoint in `output_dir`.

    max_new_tokens: the run's completion budget (a dataset's own in the registry wins);
    fallback_metrics: what an eval dataset naming no rewards is scored with (GRPO: --reward_funcs);
    dataset_registry: extra registry files (--dataset_registry) the eval datasets are looked up in;
    system_prompt, media_root: --system and --media_root, as the training data reads them.
    """

    def __init__(self, options: EvalConfig, output_dir: str, max_new_tokens: int,
                 fallback_metrics: Sequence[str] = (), dataset_registry: Sequence[str] = (),
                 system_prompt: str | None = None, media_root: str | None = None):
        from mmgrpo.data.catalog import resolve_dataset
        from mmgrpo.eval.metrics import get_metric

        self.options = options
        self.max_new_tokens = max_new_tokens
        self.run_name = str(output_dir)  # names the evaluated model in eval.json: "<output_dir> step N"
        self.output_dir = Path(output_dir)
        self.dataset = None  # the first eval dataset
        specs = self.options.eval_dataset
        specs = [specs] if isinstance(specs, str) else list(specs or [])  # a YAML file may give one name
        self.evals = []  # (dataset, its metrics, prefix of its keys: "" for a single dataset, else "<name>/")
        for spec in specs:
            dataset = resolve_dataset(spec, split="test", extra_files=list(dataset_registry), media_root=media_root,
                                      system_prompt=system_prompt)
            if len(dataset) == 0:
                raise ConfigError(f"--eval_dataset {spec}: the split is empty")
            metrics = list(self.options.eval_metrics or dataset.reward_funcs or fallback_metrics)
            if not metrics:
                raise ConfigError(
                    f"--eval_dataset {spec} names no reward functions to score with: "
                    "pass --eval_metrics (e.g. --eval_metrics exact_match)."
                )
            for name in metrics:
                get_metric(name)  # an unknown name fails now, not after the first eval_steps steps
            self.evals.append((dataset, metrics, f"{dataset.name}/" if len(specs) > 1 else ""))
        if self.evals:
            self.dataset, self.metrics, _ = self.evals[0]

    def metric_names(self) -> list[str]:
        """The names this run's evaluations log (without "eval/"): `<metric>`, or `<dataset>/<metric>` for several."""
        return [f"{prefix}{name}" for _, metrics, prefix in self.evals for name in metrics]

    def due(self, step: int, final: bool) -> bool:
        every = self.options.eval_steps
        return bool(self.evals) and (final or (every > 0 and step % every == 0))

    def maybe_evaluate(self, step: int, state, final: bool = False, *, model: torch.nn.Module, rollout: RolloutEngine,
                       template, strategy: Strategy, media_kwargs: dict,
                       save: Callable[[Path], None]) -> dict[str, float]:
        """Evaluate if this step is due: {"eval/<metric>": value, ...}, else {} (the loop times it as time/eval).

        model: the model in training (in eval mode while evaluated); rollout: the engine that generates
        with it; media_kwargs: `Sample.load_media` options (`media_options`); save: writes the model as an
        HF folder (every rank calls it, rank 0 writes), for checkpoint-best."""
        from mmgrpo.eval.evaluate import evaluate
        from mmgrpo.runstate.runlog import console

        if not self.due(step, final):
            return {}
        out = self.output_dir / "eval" / f"step-{step}"
        scratch = None
        if not strategy.is_main:
            # Every rank runs the same generations (sharded weights gather in collectives); rank 0 alone writes
            # the results: two ranks writing one folder deleted each other's samples and left an eval empty.
            scratch = tempfile.TemporaryDirectory(prefix=f"mmgrpo-eval-rank{strategy.rank}-")
            out = Path(scratch.name)
        else:
            shutil.rmtree(out, ignore_errors=True)  # left by an earlier run into this output_dir
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        scores, counts = {}, []
        try:
            for dataset, metrics, prefix in self.evals:
                with autocast(strategy.compute_dtype, strategy.device):
                    result = evaluate(
                        rollout,
                        template,
                        dataset,
                        out / prefix,
                        metrics=metrics,
                        model_name=f"{self.run_name} step {step}",
                        num_samples=1,
                        # the dataset's own budget (registry), as in training, else the run's
                        max_new_tokens=dataset.max_completion_length or self.max_new_tokens,
                        batch_size=self.options.per_device_eval_batch_size,
                        limit=self.options.eval_limit,
                        media_kwargs=media_kwargs,
                        show_progress=False,
                    )
                scores.update({f"{prefix}{name}": value for name, value in result["metrics"].items()})
                counts.append(str(result["counts"].get("all", "?")))
        finally:
            model.train(was_training)
            if scratch is not None:
                scratch.cleanup()
        logged = {f"eval/{name}": value for name, value in scores.items()}
        # time/eval is the loop's timer around this call (logging it here too counted it twice)
        shown = "  ".join(f"{k}={v:.4g}" for k, v in logged.items() if isinstance(v, int | float))
        console.log(f"eval at step {step} on {' + '.join(counts)} samples in {time.perf_counter() - start:.1f} s  {shown}")
        self.keep_best(step, state, scores, save, is_main=strategy.is_main)
        return logged

    def keep_best(self, step: int, state, metrics: dict, save: Callable[[Path], None], is_main: bool = True) -> None:
        """Save output_dir/checkpoint-best if this evaluation beats every earlier one. `save(folder)` writes
        the model's folder and runs on every rank; rank 0 (`is_main`) stages the folder and swaps it in."""
        name = (self.options.metric_for_best_model or next(iter(metrics), "")).removeprefix("eval/")
        if name not in metrics:
            raise ConfigError(
                f"--metric_for_best_model {name!r} is not an eval metric; this eval has: {', '.join(metrics)}"
            )
        value = metrics[name]
        if value is None or not math.isfinite(value):
            return  # every sample scored None: nothing to compare
        if state.best_metric is not None:
            better = value > state.best_metric if self.options.greater_is_better else value < state.best_metric
            if not better:
                return  # a tie keeps the earlier checkpoint
        state.best_metric, state.best_step = value, step
        record = {
            "step": step,
            "metric": name,
            "value": value,
            "greater_is_better": self.options.greater_is_better,
            "eval": str(Path("eval") / f"step-{step}" / ("eval.json" if len(self.evals) == 1 else "")),  # several: the folder
            "metrics": metrics,
        }

        def write(folder: Path) -> None:
            save(folder)
            (folder / BEST_FILE).write_text(json.dumps(record, indent=1) + "\n")

        # Staged, marked complete, then swapped in: the old checkpoint-best stays until the new one is whole.
        if is_main:
            save_atomically(self.output_dir / BEST_DIR, write)
        else:
            save(self.output_dir / BEST_DIR)  # the other ranks join the weights' gather; only rank 0 writes
