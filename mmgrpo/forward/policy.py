"""The model as the GRPO engine sees it: its parts, generate, and completion log-probs.

The template says where the model's parts live (vision/audio tower, aligner, language model,
LM head) and how media is merged into the token sequence; the policy uses that to
  - run a rollout backend over a batch of prompts,
  - compute log-probs of completion tokens only, from the last hidden state through a chunked
    LM head (no [batch, seq, vocab] tensor ever exists),
  - freeze or train parts by name.

Group-shared prefix (docs/speed.md): where the family supports it, each prompt (with its media)
runs once per group in rollout and in every log-prob forward, and its G completions attend to
its keys and values. Elsewhere the naive path repeats the prompt per completion; both give the
same log-probs and gradients (tests/test_shared_prefix.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmgrpo.grpo.logprobs import completion_logprobs, logits_chunk_rows
from mmgrpo.grpo.shared_prefix import shared_prefix_hidden, supports_shared_prefix
from mmgrpo.rollout.base import Rollout, SamplingParams
from mmgrpo.rollout.hf import HFRollout
from mmgrpo.rollout.shared_prefix import SharedPrefixRollout
from mmgrpo.runlog import console


@dataclass
class ForwardBatch:
    """The prompts of a micro-batch, collated once, and how many completion rows each has."""

    prompts: dict  # collated: one row per prompt (shared prefix) or per completion (naive)
    counts: list[int]  # completion rows of each prompt, in order; sum = N
    shared: bool


def get_submodule(model: nn.Module, dotted: str) -> nn.Module | None:
    try:
        return model.get_submodule(dotted)
    except AttributeError:
        return None


def _plain_call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


class Policy:
    def __init__(
        self, model: nn.Module, template, *, shared_prefix: bool = True, shared_rollout: bool = True,
        logprob_chunk_size: int | None = None,
    ):
        """shared_prefix: run each prompt once per group in the log-prob forwards and (with
        shared_rollout) in rollouts, where `supports_shared_prefix` allows it."""
        self.model = model
        self.template = template
        self.logprob_chunk_size = logprob_chunk_size
        tokenizer = template.tokenizer
        eos = {tokenizer.eos_token_id, *template.stop_token_ids}
        self.eos_token_ids = sorted(i for i in eos if i is not None)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.shared_prefix = False  # in the log-prob forwards (old, ref, update)
        if shared_prefix:
            self.shared_prefix, reason = supports_shared_prefix(model, template)
            if not self.shared_prefix:
                console.print(f"[yellow]group-shared prefix off ({reason}): prompts run once per completion")
        shared = self.shared_prefix and shared_rollout
        backend = SharedPrefixRollout if shared else HFRollout
        extra = {} if shared else {"repeat_rows": template.repeat_rows}  # audio rows (rollout/hf.py)
        self.rollout_backend = backend(
            model, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, suppress_token_ids=template.suppress_token_ids,
            **extra,
        )
        # How forwards and rollouts run (mmgrpo/parallel): a plain call here; FSDP2 / ZeRO-3 route
        # them through a wrapper module whose forward gathers the sharded weights they touch.
        self.call = self.ref_call = self.rollout_call = _plain_call
        self.ref_model: nn.Module | None = None  # frozen copy of the starting weights (full training, beta > 0)
        self.disable_adapters = None  # LoRA: a context manager under which the model is the base = the reference

    # ---- parts ---------------------------------------------------------------------------

    def component(self, name: str, model: nn.Module | None = None) -> nn.Module | None:
        """The module of a named part ("vision", "aligner", "llm", "lm_head"), or None."""
        path = self.template.components.get(name)
        return get_submodule(model or self.model, path) if path else None

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # ---- rollout -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to_device(self, batch: dict) -> dict:
        """Tensors of a collated batch moved to the model's device (a no-op on CPU)."""
        device = self.device
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def generate(self, prompt_batch: dict, params: SamplingParams) -> Rollout:
        """B collated prompts -> B x G completions (on the model's device)."""
        return self.rollout_call(self.rollout_backend.generate, self.to_device(prompt_batch), params)

    def decode(self, rollout: Rollout) -> list[str]:
        """Completion texts: the tokens up to EOS, special tokens dropped."""
        rows = rollout.completion_ids.masked_fill(rollout.completion_mask == 0, self.pad_token_id).tolist()
        return self.template.tokenizer.batch_decode(rows, skip_special_tokens=True)

    # ---- log-probs -----------------------------------------------------------------------

    def forward_batch(self, prompts: list, counts: list[int]) -> ForwardBatch:
        """Collate a micro-batch's prompts (PromptInputs) whose completions number `counts`."""
        if self.shared_prefix:
            return ForwardBatch(self.to_device(self.template.collate(prompts)), list(counts), True)
        repeated = [p for p, count in zip(prompts, counts) for _ in range(count)]
        return ForwardBatch(self.to_device(self.template.collate(repeated)), list(counts), False)

    def completion_logprobs(
        self,
        batch: ForwardBatch,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        reference: bool = False,
        model: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of each completion token given its prompt (see `_completion_logprobs`).

        reference: under the reference model: the frozen copy, or (LoRA) this model with its
        adapters disabled.
        """
        kwargs = dict(temperature=temperature, compute_entropy=compute_entropy)
        if not reference:
            return self.call(self._completion_logprobs, batch, completion_ids, completion_mask, model=model, **kwargs)
        if self.ref_model is not None:
            return self.ref_call(self._completion_logprobs, batch, completion_ids, completion_mask, model=self.ref_model, **kwargs)
        if self.disable_adapters is None:
            raise ValueError("no reference model: beta > 0 loads one in full training; LoRA uses the adapter-free base")
        with self.disable_adapters():
            return self.call(self._completion_logprobs, batch, completion_ids, completion_mask, **kwargs)

    def _completion_logprobs(
        self,
        batch: ForwardBatch,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        model: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of each completion token given its prompt.

        completion_ids, completion_mask: [N, T], the rows of each prompt contiguous, in order.
        Returns logps [N, T] (and entropy [N, T] if asked), zero where completion_mask is 0.
        """
        model = model or self.model
        backbone = model.get_submodule(self.template.components["backbone"])
        if batch.shared:
            hidden = shared_prefix_hidden(backbone, batch.prompts, completion_ids, completion_mask, batch.counts)
        else:
            inputs = self.template.forward_inputs(batch.prompts, completion_ids, completion_mask)
            hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [N, P + T, H]
            prompt_len = batch.prompts["input_ids"].shape[1]
            # Position P - 1 + t predicts completion token t.
            hidden = hidden[:, prompt_len - 1 : -1]  # [N, T, H]
        lm_head = model.get_submodule(self.template.components["lm_head"])
        logps, entropy = completion_logprobs(
            hidden,
            lm_head.weight,
            completion_ids,
            # rows per LM-head chunk: by default as many as fit 128 MB of fp32 logits (220 at a 152K vocabulary)
            chunk_size=self.logprob_chunk_size or logits_chunk_rows(lm_head.weight.shape[0]),
            temperature=temperature,
            lm_head_bias=getattr(lm_head, "bias", None),
            compute_entropy=compute_entropy,
        )
        mask = completion_mask.to(logps.dtype)
        return logps * mask, (entropy * mask if entropy is not None else None)
