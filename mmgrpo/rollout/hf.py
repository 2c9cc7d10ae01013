"""Rollout with transformers' `generate`: the reference engine, on any model and device.

    engine = HFRollout(model, template)
    rollout = engine.generate(prompts, SamplingParams(num_generations=8, max_new_tokens=256))

The G samples of a prompt come from `num_return_sequences=G`, so they stay contiguous. Audio
is the exception: `generate` repeats every input tensor per row, but `input_features` holds one
entry per clip (a row may have none or several), so a batch with audio is repeated by the
template (`repeat_rows`, which knows which clips belong to which row) and sampled once per row.
Placeholder tokens (`<|image_pad|>` ...) are suppressed: a sampled placeholder would break
the training forward ("image features and image tokens do not match").

An MoE policy's routes are recorded as it samples (`Rollout.routed_experts`, for
--routing_replay; mmgrpo/forward/routing_replay.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from mmgrpo.forward.policy import plain_call
from mmgrpo.forward.routing_replay import RoutingRecorder, moe_routers
from mmgrpo.rollout.base import (
    Rollout,
    RolloutEngine,
    SamplingParams,
    collate_on_device,
    completion_mask_from_ids,
    cut_to_budgets,
)


class HFRollout(RolloutEngine):
    def __init__(
        self,
        model,
        template,
        *,
        call: Callable = plain_call,
        scope: Callable[[], AbstractContextManager] = nullcontext,
        prepare: Callable[[dict], dict] | None = None,
        synced: bool = False,
        eos_token_ids: list[int] | None = None,
        suppress_token_ids: list[int] | None = None,
        separate_weights: bool = False,
    ):
        """model, template: the policy's HF model and its family's template.

        call / scope / prepare: how a sharding strategy runs a rollout (through its wrapper; inside
        a context that gathers the weights once; a batch hook such as `align_media`).
        synced: every rank runs as many decoding steps as the slowest (generate's `synced_gpus`),
        for sharded models that gather weights inside every step.
        eos_token_ids, suppress_token_ids: instead of the template's.
        separate_weights: `model` is the engine's own copy (asynchronous rollouts): `update_weights`
        copies the policy's weights into it.
        """
        self.model, self.template = model, template
        self.eos_token_ids = list(template.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.pad_token_id = template.completion_pad_id
        self.suppress_token_ids = list(template.suppress_token_ids if suppress_token_ids is None else suppress_token_ids)
        self.call, self.scope, self.prepare = call, scope, prepare
        self.synced = synced
        self.separate_weights = separate_weights
        self.records_routes = bool(moe_routers(model))  # an MoE model: each row's routes go with it

    def generate(self, prompts: list, sampling: SamplingParams) -> Rollout:
        """B encoded prompts -> B x G completions (on the model's device)."""
        batch = collate_on_device(self.template, prompts, self.model, self.prepare)
        with self.scope():
            rollout = self.call(self._generate, batch, sampling)
        rollout.weight_version = self.weight_version
        return cut_to_budgets(rollout, sampling, self.pad_token_id)

    @torch.no_grad()
    def _generate(self, prompt_batch: dict, params: SamplingParams) -> Rollout:
        was_training = self.model.training
        self.model.eval()
        # Every sampling option explicit: a checkpoint's generation_config (e.g. Qwen's top_k=1,
        # repetition_penalty=1.05) must not change the distribution the log-probs assume.
        sampling = dict(do_sample=False)
        if not params.greedy:
            sampling = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        group = 1 if params.greedy else params.num_generations  # greedy copies are identical
        copies = params.num_generations // group  # completions copied after generate (greedy: G)
        if group > 1 and "input_features" in prompt_batch:
            prompt_batch = self.template.repeat_rows(prompt_batch, group)  # [B * G, L], each row with its own clips
            group = 1  # the G copies of a prompt are rows now: one sample each
        if params.seed is not None:
            torch.manual_seed(params.seed)  # generate draws from the global generator
        recorder = RoutingRecorder(self.model) if self.records_routes else None
        try:
            with recorder or nullcontext():  # the routers' choices as they sample (MoE)
                output = self.model.generate(
                    **prompt_batch,
                    **sampling,
                    repetition_penalty=1.0,
                    num_return_sequences=group,
                    max_new_tokens=params.max_new_tokens,
                    eos_token_id=self.eos_token_ids,
                    pad_token_id=self.pad_token_id,
                    suppress_tokens=params.suppressed(self.suppress_token_ids, self.eos_token_ids) or None,
                    use_cache=True,
                    synced_gpus=self.synced,
                )
        finally:
            self.model.train(was_training)
        prompt_len = prompt_batch["input_ids"].shape[1]
        completion_ids = output[:, prompt_len:]  # [B * group, T]
        routed = None
        if recorder is not None:  # generate repeats each prompt row `group` times, in place
            prompt_mask = prompt_batch["attention_mask"].repeat_interleave(group, dim=0)  # [B * group, P]
            lengths = completion_mask_from_ids(completion_ids, self.eos_token_ids)[0].sum(1)
            routed = [row for row in recorder.per_row(prompt_mask, lengths) for _ in range(copies)]
        completion_ids = completion_ids.repeat_interleave(copies, dim=0)  # [B * G, T]
        mask, truncated = completion_mask_from_ids(completion_ids, self.eos_token_ids)
        completion_ids = completion_ids.masked_fill(mask == 0, self.pad_token_id)
        return Rollout(completion_ids=completion_ids, completion_mask=mask, truncated=truncated, routed_experts=routed)
