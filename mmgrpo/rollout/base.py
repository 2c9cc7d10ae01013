"""What every rollout engine takes and returns.

A rollout engine turns B prompts into B x G completions. The training step needs nothing else
from it, so the in-process engines (HF generate, the shared-prefix sampler) and vLLM (colocated
or as a server) stand behind the same two calls:

    rollout = engine.generate(prompts, sampling)      # list[PromptInputs] -> Rollout
    engine.update_weights(named_tensors, version)     # after every optimizer step

An in-process engine samples from the policy's own module, so its `update_weights` only records
the version; an engine holding its own copy of the weights (vLLM) loads the tensors it is given.
`named_tensors` is a lazy iterable of (HF parameter name, full tensor): an engine that does not
iterate it costs nothing, one that does receives the tensors one at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    num_generations: int  # G completions per prompt, contiguous in the output
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    # Seeds this rollout's draws (its own generator where the engine has one, so a rollout in a
    # background thread draws the same numbers as in step); None: the global generator as it is.
    seed: int | None = None
    # Each prompt's own budget, each <= max_new_tokens (datasets of a mixture with their own
    # `max_completion_length`); None: max_new_tokens for every prompt.
    max_new_tokens_per_prompt: list[int] | None = None
    # --suppress_eos: EOS is never drawn, every completion runs to its budget (fixed-length benchmarks)
    suppress_eos: bool = False

    def suppressed(self, suppress_token_ids: list[int], eos_token_ids: list[int]) -> list[int]:
        """The ids an engine never samples: its placeholders, and EOS under --suppress_eos."""
        return list(suppress_token_ids) + (list(eos_token_ids) if self.suppress_eos else [])

    def budget(self, prompt_index: int) -> int:
        """The most tokens prompt `prompt_index`'s completions may have."""
        if self.max_new_tokens_per_prompt is None:
            return self.max_new_tokens
        return self.max_new_tokens_per_prompt[prompt_index]

    def row_budgets(self, device=None) -> torch.Tensor | None:
        """[B * G] each completion's budget (the G of a prompt contiguous), None when all are max_new_tokens."""
        if self.max_new_tokens_per_prompt is None:
            return None
        budgets = torch.tensor(self.max_new_tokens_per_prompt, dtype=torch.long, device=device)
        return budgets.repeat_interleave(self.num_generations)


@dataclass
class Rollout:
    completion_ids: torch.Tensor  # [B * G, T] right-padded with pad_token_id
    completion_mask: torch.Tensor  # [B * G, T] 1 up to and including the EOS token
    truncated: torch.Tensor  # [B * G] bool: no EOS within max_new_tokens
    logps: torch.Tensor | None = None  # [B * G, T] the sampler's log-probs of the tokens (0 after EOS), if it gives them
    weight_version: int = 0  # the optimizer steps the sampling weights had seen
    # Multi-turn episodes (mmgrpo/rollout/multiturn.py); a single-turn engine leaves these unset.
    # A completion is then the whole trajectory after the prompt: the model's turns and the tool
    # turns between them, all under completion_mask (the training forward runs them all).
    loss_mask: torch.Tensor | None = None  # [B * G, T] 1 on the model's own tokens; None: all of completion_mask
    completion_media: list[dict] | None = None  # per row: media tensors of the images inside its completion, in order
    texts: list[str] | None = None  # per row: what rewards score (an episode's last model turn); None: decode the ids
    columns: dict[str, list] = field(default_factory=dict)  # per-row reward columns (trajectory, tool_calls ...)
    metrics: dict[str, float] = field(default_factory=dict)  # logged with the step (tools/...)

    @property
    def lengths(self) -> torch.Tensor:  # [B * G]
        return self.completion_mask.sum(1)


class RolloutEngine(Protocol):
    """The interface every rollout engine implements (see the module docstring)."""

    # True where the engine samples from its own copy of the weights (vLLM; an in-process engine
    # on a copy, for asynchronous rollouts): its samples may lag or differ numerically from the
    # policy, so the step recomputes their log-probs and measures the mismatch.
    separate_weights: bool
    weight_version: int  # the version of the weights it samples from
    def generate(self, prompts: list, sampling: SamplingParams) -> Rollout:
        """B encoded prompts (`PromptInputs`) -> B x G completions, the G of a prompt contiguous."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Make the next `generate` sample from these weights, tagged `version`."""
        ...


def collate_on_device(template, prompts: list, model: torch.nn.Module, prepare=None) -> dict:
    """The in-process engines' batch: `template.collate(prompts)`, the strategy's `prepare` hook
    (blank media for equal tower calls across ranks), tensors moved to the model's device."""
    batch = template.collate(prompts)
    if prepare is not None:
        batch = prepare(batch)
    device = next(model.parameters()).device
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def load_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each (name, tensor) into `model`'s parameter of that name, in place; returns how many.
    An unknown name is an error (a rollout copy that silently skipped a weight would be stale)."""
    params = dict(model.named_parameters())
    count = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"the rollout model has no parameter {name!r}")
            params[name].copy_(tensor)
            count += 1
    return count


def cut_to_budgets(rollout: Rollout, sampling: SamplingParams, pad_token_id: int) -> Rollout:
    """Every completion cut after its prompt's budget (`SamplingParams.max_new_tokens_per_prompt`):
    what an engine that decoded all rows to `max_new_tokens` returns, as if each row had stopped
    at its own budget (the first tokens of a sample do not depend on the budget). A row cut here
    had no EOS within its budget, so it counts as truncated. Unchanged when there are no budgets.

    >>> rollout = Rollout(torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8]]), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
    ...                   torch.tensor([False, True]))
    >>> cut = cut_to_budgets(rollout, SamplingParams(1, 4, max_new_tokens_per_prompt=[2, 3]), pad_token_id=0)
    >>> cut.completion_ids.tolist(), cut.truncated.tolist()
    ([[5, 6, 0], [5, 6, 7]], [True, True])
    """
    budgets = sampling.row_budgets(rollout.completion_ids.device)
    if budgets is None:
        return rollout
    positions = torch.arange(rollout.completion_ids.shape[1], device=budgets.device)  # [T]
    within = positions[None, :] < budgets[:, None]  # [N, T]
    mask = rollout.completion_mask * within
    rollout.truncated = rollout.truncated | (rollout.completion_mask.sum(1) > budgets)
    width = max(1, int(mask.sum(1).max())) if mask.numel() else 0
    rollout.completion_mask = mask[:, :width]
    rollout.completion_ids = rollout.completion_ids.masked_fill(mask == 0, pad_token_id)[:, :width]
    if rollout.logps is not None:
        rollout.logps = (rollout.logps * mask)[:, :width]
    return rollout


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask every token after the first EOS; a row without EOS is truncated.

    >>> ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8]])
    >>> mask, truncated = completion_mask_from_ids(ids, [2])
    >>> mask.tolist(), truncated.tolist()
    ([[1, 1, 1, 0], [1, 1, 1, 1]], [False, True])
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # [N, T]
    has_eos = is_eos.any(1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(1), completion_ids.shape[1])  # [N]
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)  # [T]
    mask = (positions[None, :] <= first_eos[:, None]).long()  # EOS itself is scored
    return mask, ~has_eos
