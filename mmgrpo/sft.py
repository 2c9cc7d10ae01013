"""Supervised warm start: cross-entropy on the answer tokens, with the GRPO engine's pieces.

    mmgrpo sft --model tiny:qwen2-vl --dataset shapes-color --max_steps 100 --output_dir runs/sft

The target of a sample is its `reference_response` column (the dataset's assistant turn) or,
failing that, `<answer>{solution}</answer>`, boxes written in the model's own convention.
The loss is the mean negative log-prob of the target tokens (EOS included), computed by the
same chunked log-prob path as GRPO's.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from mmgrpo.config import SFTConfig
from mmgrpo.engine import autocast, lr_lambda, make_adamw, seed_everything
from mmgrpo.errors import DataError
from mmgrpo.runlog import RunLogger, progress_bar
from mmgrpo.setup import build_run


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


def sft(cfg: SFTConfig) -> Path:
    if cfg.model.model_type is None:
        cfg.validate()  # names the missing --model_type
    cfg.algo.beta = 0.0  # no reference model for SFT
    cfg.algo.reward_funcs = cfg.algo.reward_funcs or ["format"]  # unused, but the run builder checks them
    run = build_run(cfg)
    seed_everything(cfg.seed)
    out = Path(cfg.output_dir)
    logger = RunLogger(out, cfg)
    optimizer = make_adamw(cfg)(run.policy.trainable_parameters())
    total = run.total_steps(cfg.optim.per_device_train_batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total))
    batches = run.prompt_batches(cfg.optim.per_device_train_batch_size)
    eos = run.policy.eos_token_ids[0]
    with progress_bar(total, "SFT") as bar:
        for step in range(1, total + 1):
            prompts = next(batches)
            targets = [sft_target(sample, enc, run.template) for sample, enc in prompts]
            ids, mask = (t.to(run.device) for t in encode_targets(targets, run.template.tokenizer, eos))
            with autocast(cfg, run.device):
                batch = run.policy.forward_batch([enc for _, enc in prompts], [1] * len(prompts))
                logps, _ = run.policy.completion_logprobs(batch, ids, mask)
                loss = -(logps * mask).sum() / mask.sum()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(run.policy.trainable_parameters(), cfg.optim.max_grad_norm or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            metrics = {"step": step, "loss": loss.item(), "grad_norm": float(grad_norm), "learning_rate": scheduler.get_last_lr()[0]}
            logger.log_step(metrics, print_it=step % max(cfg.logging_steps, 1) == 0 and step % 20 == 0)
            bar.advance({"reward": -metrics["loss"], "time/step": float("nan")})
            if cfg.save_steps and step % cfg.save_steps == 0 and step != total:
                run.save(out / f"checkpoint-{step}")
    run.save(out / "final")
    logger.close()
    return out / "final"
