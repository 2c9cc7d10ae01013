"""The model as the training step sees it: log-probs of completion tokens, under the policy or
its reference.

    policy = Policy(model, template)                               # one process
    batch = policy.forward_batch(prompts, counts)                  # a micro-batch's prompts, collated once
    logps, entropy = policy.completion_logprobs(batch, completion_ids, completion_mask)
    ref_logps, _ = policy.completion_logprobs(batch, completion_ids, completion_mask, reference=True)

Log-probs come from the last hidden state through a chunked LM head (mmgrpo/grpo/logprobs.py):
no [batch, seq, vocab] tensor ever exists. A model that soft-caps its final logits (Gemma 2,
Gemma 4: `final_logit_softcapping`) has them capped there as its own forward caps them. Where the template allows it (docs/speed.md), each
prompt and its media run once per group and its G completions read the prompt's keys and
values (mmgrpo/forward/shared_prefix.py); elsewhere the naive path repeats the prompt per
completion. Both give the same log-probs and gradients (tests/test_shared_prefix.py).

Everything a Policy needs is given when it is built (mmgrpo/training/build.py builds the run's one):
how its forwards run (`call`: a plain call, or through a sharding wrapper that gathers the
weights they touch) and what the reference is (a frozen copy of the starting weights, or with
LoRA the same model with its adapters disabled). Nothing patches it afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from mmgrpo.forward.routing_replay import Routing, moe_routers
from mmgrpo.forward.shared_prefix import shared_prefix_hidden, supports_shared_prefix
from mmgrpo.fusion.attach import prompt_length
from mmgrpo.grpo.logprobs import completion_logprobs, logits_chunk_rows
from mmgrpo.templates.turns import with_completion_media


@dataclass
class ForwardBatch:
    """The prompts of a micro-batch, collated once, and how many completion rows each has."""

    prompts: dict  # collated: one row per prompt (shared prefix) or per completion (naive)
    counts: list[int]  # completion rows of each prompt, in order; sum = N
    shared: bool


def plain_call(fn, *args, **kwargs):
    """How a forward runs in one process: just call it."""
    return fn(*args, **kwargs)


def get_submodule(model: nn.Module, dotted: str) -> nn.Module | None:
    try:
        return model.get_submodule(dotted)
    except AttributeError:
        return None


def final_logit_softcap(model: nn.Module, template) -> float | None:
    """The cap of the final-logit soft-capping the model's forward applies (the text config's
    `final_logit_softcapping`: 30.0 in Gemma 2 and Gemma 4 checkpoints; the field its template
    names, `Template.logit_softcap_field`), or None where it applies none (None or 0). Read once by
    whatever turns hidden states into logits outside the model's forward (the chunked log-probs,
    the shared-prefix sampler), so they see the distribution the model's forward gives."""
    if template.logit_softcap_field is None:
        return None
    text_config = model.config.get_text_config()
    return float(getattr(text_config, template.logit_softcap_field, None) or 0.0) or None


class Policy:
    def __init__(
        self,
        model: nn.Module,
        template,
        *,
        shared_prefix: bool = True,
        logprob_chunk_size: int | None = None,
        call: Callable = plain_call,
        ref_model: nn.Module | None = None,
        ref_call: Callable = plain_call,
        disable_adapters: Callable | None = None,
        per_row_routing: bool = False,
        teacher_model: nn.Module | None = None,
        teacher_call: Callable = plain_call,
        teacher_server=None,
        sequence_group=None,
    ):
        """
        shared_prefix: run each prompt once per group where `supports_shared_prefix` allows it.
        call: runs a forward function (`call(fn, *args)`); sharding strategies pass their wrapper.
        ref_model, ref_call: the frozen reference copy (full training with beta > 0) and how it runs.
        disable_adapters: LoRA: a context manager under which the model is the base = the reference.
        per_row_routing: an MoE model whose forwards replay recorded routes or add the router's
        load-balancing loss (mmgrpo/forward/routing_replay.py): the naive path, whose rows are
        the sampler's rows, token for token.
        teacher_model, teacher_call: --teacher_model, frozen, of the same family (it reads the policy's
        batches), and how it runs (sharded as the reference is); teacher_server: instead, the client of its
        rollout server (--teacher_server_port, `VLLMServerRollout.score`).
        sequence_group: --sequence_parallel_size: the process group whose ranks split each row's tokens
        (mmgrpo/forward/sequence_parallel.py); the forwards, naive or with the shared prefix, then run split.
        """
        self.model = model
        self.logit_softcap = final_logit_softcap(model, template)  # Gemma 2 / Gemma 4: the chunked head caps as HF's does
        self.template = template
        self.logprob_chunk_size = logprob_chunk_size
        self.call, self.ref_call = call, ref_call
        self.ref_model, self.disable_adapters = ref_model, disable_adapters
        self.teacher_model, self.teacher_call, self.teacher_server = teacher_model, teacher_call, teacher_server
        self.shared_prefix, self.naive_reason = False, "off (--shared_prefix false)"
        if shared_prefix:
            self.shared_prefix, self.naive_reason = supports_shared_prefix(model, template)
        if self.shared_prefix and per_row_routing and moe_routers(model):
            self.shared_prefix, self.naive_reason = False, "routes replayed per row (--routing_replay, --router_aux_loss_coef)"
        # The rollout does not run split (each rank of a sequence group samples whole rows, the leader's
        # are kept): it prefills each prompt once for its G samples wherever the forwards do.
        self.rollout_shares_prefix = self.shared_prefix
        self.sequence_group = sequence_group

    # ---- parts ---------------------------------------------------------------------------

    def component(self, name: str, model: nn.Module | None = None) -> nn.Module | None:
        """The module of a named part ("vision", "aligner", "llm", "lm_head"), or None."""
        path = self.template.components.get(name)
        return get_submodule(model or self.model, path) if path else None

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to_device(self, batch: dict) -> dict:
        """Tensors of a collated batch moved to the model's device (a no-op on CPU)."""
        device = self.device
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    # ---- log-probs -----------------------------------------------------------------------

    def forward_batch(self, prompts: list, counts: list[int], completion_media: list[dict] | None = None) -> ForwardBatch:
        """Collate a micro-batch's prompts (PromptInputs) whose completions number `counts`.

        completion_media: per completion row, the media inside it (a multi-turn trajectory's tool
        images, `Rollout.completion_media`). Rows with such media take the naive path, each row its
        prompt with the prompt's media then its own: the shared-prefix forward runs the
        completions through the text decoder only, against the prompt's keys and values, so an
        image after the prompt would never reach the vision tower, and that image's tokens (and
        the mRoPE positions after it) differ from row to row of a group.
        """
        with_media = completion_media is not None and any(completion_media)
        if self.shared_prefix and not with_media:
            return ForwardBatch(self.to_device(self.template.collate(prompts)), list(counts), True)
        repeated = [p for p, count in zip(prompts, counts) for _ in range(count)]
        if with_media:
            repeated = [with_completion_media(self.template, p, media) for p, media in zip(repeated, completion_media)]
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
        teacher: bool = False,
        routing: Routing | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of each completion token given its prompt (see `_completion_logprobs`).

        reference: under the reference model: the frozen copy, or (LoRA) this model with its
        adapters disabled. teacher: under --teacher_model.
        routing: an MoE model's recorded routes to replay or compare, its load-balancing loss
        (mmgrpo/forward/routing_replay.py); its hooks stay on the routers until the caller's
        `routing.detach()` after the backward (without gradients: detached here).
        """
        kwargs = dict(temperature=temperature, compute_entropy=compute_entropy, routing=routing)
        if teacher:
            return self.teacher_call(self._completion_logprobs, batch, completion_ids, completion_mask,
                                     model=self.teacher_model, **kwargs)
        if not reference:
            return self.call(self._completion_logprobs, batch, completion_ids, completion_mask, **kwargs)
        if self.ref_model is not None:
            return self.ref_call(
                self._completion_logprobs, batch, completion_ids, completion_mask, model=self.ref_model, **kwargs
            )
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
        routing: Routing | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of each completion token given its prompt.

        completion_ids, completion_mask: [N, T], the rows of each prompt contiguous, in order.
        Returns logps [N, T] (and entropy [N, T] if asked), zero where completion_mask is 0.
        """
        model = model or self.model
        if routing is not None and (batch.shared or self.sequence_group is not None):
            raise ValueError("recorded routes apply to the naive forward of whole rows: build the Policy with "
                             "per_row_routing=True, without a sequence group")
        lm_head = model.get_submodule(self.template.components["lm_head"])
        options = self._head_options(lm_head, temperature, compute_entropy)
        if self.sequence_group is not None:  # this rank's slice; the group's sum is the rows' log-probs
            logps, entropy = self._split_logprobs(model, batch, completion_ids, completion_mask, lm_head, options)
        else:
            if batch.shared:
                hidden = shared_prefix_hidden(model, self.template, batch.prompts, completion_ids, completion_mask,
                                              batch.counts)
            else:
                hidden = self._naive_hidden(model, batch, completion_ids, completion_mask, routing)
            logps, entropy = completion_logprobs(hidden, lm_head.weight, completion_ids, **options)
        mask = completion_mask.to(logps.dtype)
        return logps * mask, (entropy * mask if entropy is not None else None)

    def _naive_hidden(self, model, batch, completion_ids, completion_mask, routing) -> torch.Tensor:
        """Final hidden states [N, T, H] of each row's prompt and completion in one forward; hidden[:, t]
        predicts completion token t."""
        backbone = model.get_submodule(self.template.components["backbone"])
        inputs = self.template.forward_inputs(batch.prompts, completion_ids, completion_mask)
        prompt_len = batch.prompts["input_ids"].shape[1]
        if routing is not None:
            routing.attach(model, inputs["attention_mask"][:, :prompt_len], completion_mask)
        try:
            with prompt_length(model, prompt_len):  # fusion modules' features read the prompt only
                hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [N, P + T, H]
        except BaseException:
            if routing is not None:
                routing.detach()
            raise
        if routing is not None:
            routing.forward_done()
            if not torch.is_grad_enabled():  # no backward will recompute a layer
                routing.detach()
        return hidden[:, prompt_len - 1 : -1]  # position P - 1 + t predicts completion token t

    def _head_options(self, lm_head: nn.Module, temperature: float, compute_entropy: bool) -> dict:
        # rows per LM-head chunk: by default as many as fit 128 MB of fp32 logits (220 at a 152K vocabulary)
        return dict(chunk_size=self.logprob_chunk_size or logits_chunk_rows(lm_head.weight.shape[0]),
                    temperature=temperature, lm_head_bias=getattr(lm_head, "bias", None), softcap=self.logit_softcap,
                    compute_entropy=compute_entropy)

    def _split_logprobs(self, model, batch, completion_ids, completion_mask, lm_head, options) -> tuple:
        """The forward with the tokens split across the sequence group (Ulysses): each prompt once for its
        rows (the shared prefix: prompts, then completions, both split), or each row whole, split."""
        from mmgrpo.forward.sequence_parallel import (
            sequence_parallel_logprobs,
            split_shared_prefix_logprobs,
            ulysses,
        )

        if batch.shared:
            return split_shared_prefix_logprobs(model, self.template, self.sequence_group, batch.prompts, completion_ids,
                                                completion_mask, batch.counts, lm_head.weight, **options)
        backbone = model.get_submodule(self.template.components["backbone"])
        inputs = self.template.forward_inputs(batch.prompts, completion_ids, completion_mask)
        with ulysses(model, self.template, self.sequence_group) as split:
            hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [N, L / n, H]
        return sequence_parallel_logprobs(hidden, lm_head.weight, split, batch.prompts["input_ids"].shape[1],
                                          completion_ids, **options)


def autocast(dtype: torch.dtype | None, device: torch.device):
    """Autocast to `dtype` (bfloat16 under --bf16, float16 under --fp16) on `device`'s kind; None: float32."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
