"""The model as the GRPO engine sees it: its parts, generate, and completion log-probs.

The template says where the model's parts live (vision/audio tower, aligner, language model,
LM head) and how media is merged into the token sequence; the policy uses that to
  - run a rollout backend over a batch of prompts,
  - compute log-probs of completion tokens only, from the last hidden state through a chunked
    LM head (no [batch, seq, vocab] tensor ever exists),
  - freeze or train parts by name.
"""

from __future__ import annotations

import torch
from torch import nn

from mmgrpo.grpo.logprobs import completion_logprobs
from mmgrpo.rollout.base import Rollout, SamplingParams
from mmgrpo.rollout.hf import HFRollout


def get_submodule(model: nn.Module, dotted: str) -> nn.Module | None:
    try:
        return model.get_submodule(dotted)
    except AttributeError:
        return None


class Policy:
    def __init__(self, model: nn.Module, template, *, logprob_chunk_size: int = 4096):
        self.model = model
        self.template = template
        self.logprob_chunk_size = logprob_chunk_size
        tokenizer = template.tokenizer
        eos = {tokenizer.eos_token_id, *template.stop_token_ids}
        self.eos_token_ids = sorted(i for i in eos if i is not None)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.rollout_backend = HFRollout(
            model, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, suppress_token_ids=template.suppress_token_ids
        )

    # ---- parts ---------------------------------------------------------------------------

    def component(self, name: str, model: nn.Module | None = None) -> nn.Module | None:
        """The module of a named part ("vision", "aligner", "llm", "lm_head"), or None."""
        path = self.template.components.get(name)
        return get_submodule(model or self.model, path) if path else None

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # ---- rollout -------------------------------------------------------------------------

    def generate(self, prompt_batch: dict, params: SamplingParams) -> Rollout:
        return self.rollout_backend.generate(prompt_batch, params)

    # ---- log-probs -----------------------------------------------------------------------

    def completion_logprobs(
        self,
        prompt_batch: dict,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        model: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of each completion token given the prompt (one row per completion).

        prompt_batch: collated, left-padded, one row per completion (prompts repeated).
        Returns logps [N, T] (and entropy [N, T] if asked), zero where completion_mask is 0.
        """
        model = model or self.model
        inputs = self.template.forward_inputs(prompt_batch, completion_ids, completion_mask)
        backbone = model.get_submodule(self.template.components["backbone"])
        hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [N, P + T, H]
        prompt_len = prompt_batch["input_ids"].shape[1]
        # Position P - 1 + t predicts completion token t.
        hidden = hidden[:, prompt_len - 1 : -1]  # [N, T, H]
        lm_head = model.get_submodule(self.template.components["lm_head"])
        logps, entropy = completion_logprobs(
            hidden,
            lm_head.weight,
            completion_ids,
            chunk_size=self.logprob_chunk_size,
            temperature=temperature,
            lm_head_bias=getattr(lm_head, "bias", None),
            compute_entropy=compute_entropy,
        )
        mask = completion_mask.to(logps.dtype)
        return logps * mask, (entropy * mask if entropy is not None else None)
