"""What every rollout backend returns, and the sampling options it takes.

A backend turns a batch of B prompts into B x G completions. The engine needs nothing else
from it, so HF generate, vLLM colocated and vLLM server can stand behind the same call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    num_generations: int  # G completions per prompt, contiguous in the output
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


@dataclass
class Rollout:
    completion_ids: torch.Tensor  # [B * G, T] right-padded with pad_token_id
    completion_mask: torch.Tensor  # [B * G, T] 1 up to and including the EOS token
    truncated: torch.Tensor  # [B * G] bool: no EOS within max_new_tokens

    @property
    def lengths(self) -> torch.Tensor:  # [B * G]
        return self.completion_mask.sum(1)


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
