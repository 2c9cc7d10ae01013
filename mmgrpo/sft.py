"""Supervised warm start: cross-entropy on the answer tokens, with the GRPO engine's pieces.

    mmgrpo sft --model tiny:qwen2-vl --dataset shapes-color --max_steps 100 --output_dir runs/sft

The target of a sample is its `reference_response` column (the dataset's assistant turn) or,
failing that, `<answer>{solution}</answer>`, boxes written in the model's own convention.
The loss is the mean negative log-prob of the target tokens (EOS included; `--loss_normalization
sample`: each answer's mean, then the mean over answers), computed by the
same chunked log-prob path as GRPO's. SFT is composed of the pieces GRPO uses (the template and
model loading, the prompt stream, the optimizer and its schedule, one-process strategy); it has
its own options (`SFTConfig`: `mmgrpo sft --help` lists only those).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from mmgrpo.config import DistConfig, SFTConfig
from mmgrpo.config.checks import parse_stop_at
from mmgrpo.data.catalog import mix_datasets
from mmgrpo.data.prompt_batches import prompt_stream
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.forward.policy import Policy, autocast
from mmgrpo.models.loading import load_template, template_options
from mmgrpo.models.train_type import load_trainable_model
from mmgrpo.parallel import build_strategy
from mmgrpo.rollout import build_rollout_engine
from mmgrpo.runstate.runlog import RunLogger, console, progress_bar
from mmgrpo.runstate.state import TrainState, deterministic_kernels, seed_everything
from mmgrpo.training.build import ModelRun, check_modalities, total_steps, training_eval
from mmgrpo.training.optim import group_rates, make_optimizer, make_scheduler
from mmgrpo.training.startup_checks import check_sft_flags

STOP_FILE = "stop.json"  # output_dir/stop.json: where --stop_at ended the run, and why


def sft_target(sample, encoded, template) -> str:
    """The text the model should produce for a sample."""
    if sample.columns.get("reference_response"):
        return sample.columns["reference_response"]
    solution = sample.columns.get("solution")
    if solution is None:
        raise DataError(f"sample {sample.id}: SFT needs a `solution` or an assistant turn (reference_response).")
    if isinstance(solution, (list, tuple)) and len(solution) == 4 and all(isinstance(v, (int, float)) for v in solution):
        box = template.box_from_image(list(solution), encoded.image_sizes[0], encoded.input_sizes[0])
        answer = "[" + ", ".join(str(round(v)) for v in box) + "]"
    elif isinstance(solution, (list, tuple)):
        answer = Counter(solution).most_common(1)[0][0]  # the annotators' majority answer
    else:
        answer = str(solution)
    return f"<answer>{answer}</answer>"


def encode_targets(texts: list[str], tokenizer, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded target ids [N, T] (EOS appended) and their mask."""
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_token_id] for text in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id or eos_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def sample_mean_loss(logps: torch.Tensor, mask: torch.Tensor, step_samples: int) -> torch.Tensor:
    """Each answer's mean negative log-prob, summed over the rows and divided by the step's answers.

    >>> logps = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.25, 1.0, 1.0, 1.0]]))
    >>> round(float(sample_mean_loss(logps, torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]]), 2)), 4)  # (ln 2 + ln 4) / 2
    1.0397
    """
    per_sample = -(logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sample.sum() / step_samples


def stop_reached(stop: tuple[str, str, float], scores: dict[str, float]) -> bool:
    """Whether this evaluation's scores ({"eval/<metric>": value}) meet `--stop_at` (as `parse_stop_at` reads it).

    >>> stop_reached(("vqa_accuracy", ">=", 0.5), {"eval/vqa_accuracy": 0.55}), stop_reached(("loss", "<=", 0.1), {"eval/loss": 0.2})
    (True, False)
    """
    name, comparison, target = stop
    value = scores.get(f"eval/{name}")  # sft() checked the name at start-up
    if value is None:  # every sample scored None
        return False
    return value >= target if comparison == ">=" else value <= target


def sft(cfg: SFTConfig) -> Path:
    """Supervised training as configured (one process); returns the final HF folder."""
    check_sft_flags(cfg)
    deterministic_kernels(cfg.full_determinism)
    evaluator = training_eval(cfg)  # the eval datasets and metrics resolve before any model loads
    stop_at = parse_stop_at(cfg.stop_at) if cfg.stop_at is not None else None  # (metric, ">=" | "<=", value)
    if stop_at is not None and stop_at[0] not in evaluator.metric_names():
        raise ConfigError(
            f"--stop_at {cfg.stop_at!r}: {stop_at[0]!r} is not among the eval metrics "
            f"({', '.join(evaluator.metric_names())}); name one of them."
        )
    dataset = mix_datasets(cfg.data.dataset, split=cfg.data.split, seed=cfg.seed, extra_files=cfg.data.dataset_registry,
                           media_root=cfg.data.media_root, system_prompt=cfg.data.system)
    path, processor, template = load_template(cfg.model.model, cfg.model.model_type, **template_options(cfg.model))
    check_modalities(dataset, template)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    strategy = build_strategy(DistConfig(), cfg.optim, cfg.precision)  # one process
    model, peft_model = load_trainable_model(cfg.model, cfg.optim, path, template, strategy, cfg.seed)
    policy = Policy(model, template, shared_prefix=cfg.model.shared_prefix)
    seed_everything(cfg.seed)
    out = Path(cfg.output_dir)
    logger = RunLogger(out, cfg.to_dict(), cfg.report_to)
    (out / STOP_FILE).unlink(missing_ok=True)  # left by an earlier run into this output_dir
    optimizer = make_optimizer(cfg.optim, model, template.components)(policy.trainable_parameters())
    batch_size, accumulation = cfg.optim.per_device_train_batch_size, cfg.optim.gradient_accumulation_steps
    total = total_steps(cfg, len(dataset), batch_size * accumulation, world_size=1)
    scheduler = make_scheduler(cfg.optim, optimizer, total)
    batches = prompt_stream(cfg.data, cfg.model, dataset, template, batch_size, strategy, seed=cfg.seed)
    run = ModelRun(cfg=cfg, processor=processor, template=template, model=model, peft_model=peft_model,
                   strategy=strategy, rollout=build_rollout_engine(policy, strategy))
    eos = template.eos_token_ids[0]
    state = TrainState(model=cfg.model.model)
    with progress_bar(total, "SFT", shown="loss") as bar:
        for step in range(1, total + 1):
            step_started = time.perf_counter()
            micro = []  # (forward batch, target ids, mask) of each accumulated batch
            for _ in range(accumulation):
                prompts = next(batches)
                targets = [sft_target(sample, enc, template) for sample, enc in prompts]
                ids, mask = (t.to(strategy.device) for t in encode_targets(targets, template.tokenizer, eos))
                micro.append((policy.forward_batch([enc for _, enc in prompts], [1] * len(prompts)), ids, mask))
            step_tokens = sum(mask.sum() for _, _, mask in micro)
            step_samples = sum(len(mask) for _, _, mask in micro)
            step_loss = 0.0
            for batch, ids, mask in micro:
                with autocast(strategy.compute_dtype, strategy.device):
                    logps, _ = policy.completion_logprobs(batch, ids, mask)
                    if cfg.loss_normalization == "sample":
                        loss = sample_mean_loss(logps, mask, step_samples)
                    else:  # the mean over the step's target tokens
                        loss = -(logps * mask).sum() / step_tokens
                strategy.backward(loss)  # scaled under --fp16
                step_loss += loss.item()
            grad_norm = strategy.optimizer_step(optimizer, cfg.optim.max_grad_norm)  # clip, step, zero grads
            learning_rate, group_lrs = scheduler.get_last_lr()[0], group_rates(optimizer, scheduler)
            scheduler.step()
            metrics = {"step": step, "loss": step_loss, "grad_norm": grad_norm, "learning_rate": learning_rate, **group_lrs}
            if strategy.loss_scale is not None:  # --fp16: an overflowed step was skipped and the scale halved
                metrics.update({"fp16/overflow": int(strategy.overflowed), "fp16/loss_scale": strategy.loss_scale})
            started = time.perf_counter()
            state.step = step
            scores = run.evaluate(evaluator, step, state, final=step == total)
            if scores:
                metrics.update(scores, **{"time/eval": time.perf_counter() - started})
            metrics["time/step"] = time.perf_counter() - step_started  # as in GRPO: evaluation included
            stop = stop_at is not None and bool(scores) and stop_reached(stop_at, scores)
            logger.log_step(metrics, print_it=stop or bool(scores) or (step % max(cfg.logging_steps, 1) == 0 and step % 20 == 0))
            bar.advance(metrics)
            if stop:
                record = {"step": step, "stop_at": cfg.stop_at, "max_steps": total, "metrics": scores}
                (out / STOP_FILE).write_text(json.dumps(record, indent=1) + "\n")
                console.print(f"[green]--stop_at {cfg.stop_at} reached at step {step} of {total}: SFT stops here")
                break
            if cfg.save_steps and step % cfg.save_steps == 0 and step != total:
                run.save(out / f"checkpoint-{step}")
    run.save(out / "final")
    logger.close()
    return out / "final"
