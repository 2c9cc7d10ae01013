"""Rollout with transformers' `generate`: the reference backend, on any device.

The G samples of a prompt come from `num_return_sequences=G`, so they stay contiguous. Audio
is the exception: `generate` repeats every input tensor per row, but `input_features` holds one
entry per clip (a row may have none or several), so a batch with audio is repeated by the
template (`repeat_rows`, which knows which clips belong to which row) and sampled once per row.
Placeholder tokens (`<|image_pad|>` ...) are suppressed: a sampled placeholder would break
the training forward ("image features and image tokens do not match").
"""

from __future__ import annotations

import torch

from mmgrpo.rollout.base import Rollout, SamplingParams, completion_mask_from_ids


class HFRollout:
    def __init__(
        self,
        model,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        suppress_token_ids: list[int],
        repeat_rows=None,
    ):
        """repeat_rows: `template.repeat_rows(batch, G)`, needed for prompts with audio."""
        self.model = model
        self.repeat_rows = repeat_rows
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.suppress_token_ids = list(suppress_token_ids)
        # Extra generate() arguments; sharded training sets synced_gpus=True so every rank runs
        # the same number of forward steps (each gathers weights collectively).
        self.generate_kwargs: dict = {}

    @torch.no_grad()
    def generate(self, prompt_batch: dict, params: SamplingParams) -> Rollout:
        """prompt_batch: a left-padded collated batch of B prompts -> B x G completions."""
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
            if self.repeat_rows is None:
                raise ValueError("prompts with audio need HFRollout(repeat_rows=template.repeat_rows)")
            prompt_batch = self.repeat_rows(prompt_batch, group)  # [B * G, L], each row with its own clips
            group = 1  # the G copies of a prompt are rows now: one sample each
        output = self.model.generate(
            **prompt_batch,
            **sampling,
            repetition_penalty=1.0,
            num_return_sequences=group,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            suppress_tokens=self.suppress_token_ids or None,
            use_cache=True,
            **self.generate_kwargs,
        )
        self.model.train(was_training)
        prompt_len = prompt_batch["input_ids"].shape[1]
        completion_ids = output[:, prompt_len:].repeat_interleave(copies, dim=0)  # [B * G, T]
        mask, truncated = completion_mask_from_ids(completion_ids, self.eos_token_ids)
        completion_ids = completion_ids.masked_fill(mask == 0, self.pad_token_id)
        return Rollout(completion_ids=completion_ids, completion_mask=mask, truncated=truncated)
