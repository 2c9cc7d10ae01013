"""Rollout that encodes each prompt once for its G samples, then decodes with a lean loop.

`generate(num_return_sequences=G)` repeats every prompt G times before the first forward, so the
decoder prefill runs over G copies of each prompt (transformers 5.23 encodes the media once and
repeats the features; older versions and most trainers ran the vision tower G times too).
This backend runs both once per prompt:

    1. prefill:  media towers + decoder over the B prompts, K/V recorded          (B rows)
    2. K/V:      lean steps: kept once per prompt, its G rows read it together; transformers'
                 steps: written G times into a preallocated buffer                (B * G rows)
    3. decode:   per step one decoder step on the B * G new tokens, sampling, EOS bookkeeping

The decoder step is `LeanDecoder.step` (rollout/lean_decode.py: the layers' operations run
straight on their weights, rotary tables computed once per rollout, each prompt's K/V held once
and attended by its G rows in one SDPA call) where the template declares `lean_decode` (the
Qwen-style decoders), transformers' text decoder with a ready mask for the others (Gemma3).

The loop does nothing else: no logits processors, no re-padding, no processor calls, no
per-step host sync (finished rows are tracked on device and read every `check_every` steps).
At those reads the prompts whose G rows have all finished leave the batch, once a quarter of the
decoding prompts can leave together: in a mixture of short and long answers (colour words beside
boxes) the short ones stop costing decode steps as soon as they end, instead of decoding padding
until the longest row ends. Each row's random draw comes from one draw per row of the whole
batch, so the completions are the same, token for token, as when every row decodes to the end.
The K/V buffer is allocated once for P + max_new_tokens positions, so a step writes one column
instead of concatenating the whole cache as DynamicCache does.

Every template that declares `shared_prefix` runs here (all eight built-in families): the
prefill calls the family's backbone with the prompt's media and the template's positions
([3, B, P] mRoPE for the Qwen-VL families and the Qwen2.5-Omni thinker, [B, P] 1-D RoPE for
Qwen2, Qwen2-Audio, LLaVA-OneVision and Gemma3), the decode steps call its text decoder. Qwen2-Audio's clips stay in their prompt's
row (no `repeat_rows` needed, unlike HFRollout). Gemma3's sliding-window layers get their own
per-step mask (see `_step_masks`).

Sampling is rollout/token_sampler.py's (transformers' order). Greedy outputs equal HF generate's
token for token (tests/test_shared_prefix.py).

    engine = SharedPrefixRollout(model, template)
    rollout = engine.generate(prompts, SamplingParams(num_generations=8, max_new_tokens=256))

Use it only where `supports_shared_prefix(model, template)` says so (other attention kinds,
reentrant checkpointing ...); elsewhere use HFRollout.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from mmgrpo.forward.policy import final_logit_softcap, plain_call
from mmgrpo.forward.shared_prefix import model_parts, recording_cache
from mmgrpo.fusion.attach import keep_prompts
from mmgrpo.grpo.logprobs import cap_logits
from mmgrpo.rollout.base import (
    PartialRollout,
    Rollout,
    RolloutEngine,
    SamplingParams,
    collate_on_device,
    completion_mask_from_ids,
    cut_to_budgets,
)
from mmgrpo.rollout.lean_decode import GroupedPrefixKV, LeanDecoder, RowStates, wide_linear
from mmgrpo.rollout.token_sampler import pick_tokens


class _BufferLayer(DynamicLayer):
    """One layer's K/V in a buffer sized for the whole rollout; `update` writes in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, group: int, capacity: int):
        super().__init__()
        batch, heads, prompt_len, head_dim = keys.shape
        self.lazy_initialization(keys, values)
        shape = (batch * group, heads, capacity, head_dim)
        self.key_buffer, self.value_buffer = keys.new_empty(shape), values.new_empty(shape)
        # rows b * G ... b * G + G - 1 hold prompt b: write through a [B, G, ...] view, no repeat copy
        self.key_buffer.view(batch, group, heads, capacity, head_dim)[..., :prompt_len, :] = keys[:, None]
        self.value_buffer.view(batch, group, heads, capacity, head_dim)[..., :prompt_len, :] = values[:, None]
        self.length = prompt_len
        self.keys, self.values = self.key_buffer[:, :, :prompt_len], self.value_buffer[:, :, :prompt_len]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` decode on (their buffers copied, the others freed)."""
        self.key_buffer, self.value_buffer = self.key_buffer[rows], self.value_buffer[rows]
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]


class _StateRowsLayer(LinearAttentionLayer):
    """One linear-attention layer's state per decoding row, each a copy of its prompt's (Qwen3.5's
    Gated DeltaNet: convolution inputs [N, channels, kernel], recurrent state [N, heads, k, v]);
    transformers' single-token decode step updates both in place."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor, group: int):
        super().__init__()
        self.device, self.dtype = conv.device, conv.dtype
        self.conv_states[0] = conv.repeat_interleave(group, dim=0)
        self.recurrent_states[0] = recurrent.repeat_interleave(group, dim=0)
        self.conv_kernel_size[0] = conv.shape[-1]
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.has_previous_state[0] = True

    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` decode on."""
        self.conv_states[0], self.recurrent_states[0] = self.conv_states[0][rows], self.recurrent_states[0][rows]


class _EmptyLayer(DynamicLayer):
    """A layer that keeps no K/V of its own (it reads another layer's); nothing to drop."""

    def keep(self, rows: torch.Tensor) -> None:
        pass


class SharedPrefixRollout(RolloutEngine):
    """B prompts -> B x G completions, each prompt's media and prefill computed once.

    check_every: steps between the host reads of "has every row finished?" (each read is one
    device sync; after all rows finish at most check_every - 1 steps are wasted).
    lean: run decode steps with `LeanDecoder` (the layers' operations without transformers'
    module stack, rollout/lean_decode.py) where the decoder's layers allow it.
    drop_finished: prompts whose rows have all finished leave the decode batch at those reads
    (off: every row decodes until all have finished; the completions are the same).
    """

    can_pause = True  # a rollout pauses between decode steps and continues on other weights (`continue_`)

    def __init__(
        self,
        model,
        template,
        *,
        call: Callable = plain_call,
        scope: Callable[[], AbstractContextManager] = nullcontext,
        prepare: Callable[[dict], dict] | None = None,
        check_every: int = 8,
        lean: bool = True,
        drop_finished: bool = True,
        eos_token_ids: list[int] | None = None,
        suppress_token_ids: list[int] | None = None,
        separate_weights: bool = False,
    ):
        """model, template: the policy's HF model and its family's template (component paths,
        positions, eos and suppressed ids). call / scope / prepare: how a sharding strategy runs a
        rollout (through its wrapper; inside a context that gathers the weights once; a batch
        hook such as `align_media`); plain in one process. eos_token_ids, suppress_token_ids:
        instead of the template's (e.g. a benchmark that forces every completion to full length).
        separate_weights: `model` is the engine's own copy (asynchronous rollouts): `update_weights`
        copies the policy's weights into it."""
        self.model, self.template = model, template
        self.core, self.decoder = model_parts(model, template)  # the decode steps run the decoder
        self.lm_head = model.get_submodule(template.components["lm_head"])
        self.logit_softcap = final_logit_softcap(model, template)  # sampled from the capped logits, as the policy scores them
        self.eos_token_ids = list(template.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.pad_token_id = template.completion_pad_id
        self.suppress_token_ids = list(template.suppress_token_ids if suppress_token_ids is None else suppress_token_ids)
        self.call, self.scope, self.prepare = call, scope, prepare
        self.check_every, self.drop_finished = check_every, drop_finished
        self.lean = None
        if lean and lean_applies(model, template):
            self.lean = LeanDecoder(self.decoder, zero_centered_norm=template.zero_centered_norm)
        self.separate_weights = separate_weights

    def generate(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None) -> Rollout:
        """B encoded prompts -> B x G completions, with the sampler's log-probs. resume: a rollout of
        these prompts paused by `continue_`, finished here (its tokens kept, with their log-probs and versions)."""
        return self.completed(self.continue_(prompts, sampling, resume), sampling)

    def continue_(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None,
                  until: int | None = None) -> PartialRollout:
        """One chunk of a rollout (--partial_rollouts): decode steps up to `until` (None: to the end)
        on the weights held now, from where `resume` stopped.

        A continued chunk prefills the prompts again and feeds each row's tokens so far back one
        decode step at a time, teacher-forced: the K/V of the earlier chunks are dropped and
        recomputed on these weights (the tokens and their log-probs stay those sampled). Each
        forced step draws its uniforms as the first decode did, and a prompt leaves the batch at
        the same steps, so on unchanged weights the chunks give the uninterrupted rollout, token
        for token. The cost: the forced steps, one decoder step each (no sampling, no lm_head).
        """
        if resume is not None and resume.complete:  # every row ended: nothing left to decode
            return resume
        batch = collate_on_device(self.template, prompts, self.model, self.prepare)
        with self.scope():
            return self.call(self.sample_part, batch, sampling, resume, until)

    def completed(self, partial: PartialRollout, sampling: SamplingParams) -> Rollout:
        """The rollout of a chunked decode that ran to the end, each completion cut to its budget."""
        return cut_to_budgets(self._rollout_of(partial, sampling.max_new_tokens), sampling, self.pad_token_id)

    @torch.no_grad()
    def sample(self, prompt_batch: dict, params: SamplingParams) -> tuple[Rollout, torch.Tensor]:
        """The rollout and logps [B * G, T]: log-probs of the sampled tokens under
        softmax(logits / temperature) (no top-k/top-p/suppression), 0 after EOS."""
        rollout = self._rollout_of(self.sample_part(prompt_batch, params), params.max_new_tokens)
        return rollout, rollout.logps

    @torch.no_grad()
    def sample_part(self, prompt_batch: dict, params: SamplingParams, resume: PartialRollout | None = None,
                    until: int | None = None) -> PartialRollout:
        """Decode steps from `resume`'s end (None: the first) to `until` (None: the end); see `continue_`."""
        was_training = self.model.training
        self.model.eval()
        try:
            tokens, logps, finished = self._decode(prompt_batch, params, resume, until)
        finally:
            self.model.train(was_training)
        steps = tokens.shape[1]
        versions = torch.full_like(tokens, self.weight_version)  # [N, S] this chunk's tokens: the weights held now
        if resume is not None:
            versions[:, : resume.steps] = resume.token_versions.to(versions.device)
        return PartialRollout(tokens, logps, versions, finished, chunks=1 + (resume.chunks if resume is not None else 0),
                              complete=steps >= params.max_new_tokens or bool(finished.all()))

    def _rollout_of(self, partial: PartialRollout, max_new: int) -> Rollout:
        """The rollout of the decode steps done, as one uninterrupted decode's [N, max_new] buffers give it."""
        spare = max_new - partial.steps
        tokens = torch.nn.functional.pad(partial.tokens, (0, spare), value=self.pad_token_id)  # [N, max_new]
        logps = torch.nn.functional.pad(partial.logps, (0, spare))
        mask, truncated = completion_mask_from_ids(tokens, self.eos_token_ids)  # [N, T]
        used = int(mask.sum(1).max()) if mask.numel() else 0  # rows stopped together: trim the spare steps
        tokens, mask, logps = tokens[:, :used], mask[:, :used], logps[:, :used]
        tokens = tokens.masked_fill(mask == 0, self.pad_token_id)
        rollout = Rollout(completion_ids=tokens, completion_mask=mask, truncated=truncated, logps=logps * mask)
        return partial.tag(rollout, self.weight_version)

    def _decode(self, prompt_batch: dict, params: SamplingParams, resume: PartialRollout | None = None,
                until: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [N, S] and logps [N, S] of the S decode steps done (`resume`'s, fed back, and the new
        ones), and which rows ended [N]."""
        core, group, max_new = self.core, params.num_generations, params.max_new_tokens
        prompt_mask = prompt_batch["attention_mask"]  # [B, P]
        num_prompts, prompt_len = prompt_mask.shape
        num_rows = num_prompts * group
        device = prompt_mask.device
        temperature = 1.0 if params.greedy else params.temperature
        forced = 0 if resume is None else resume.steps  # steps fed back teacher-forced (an earlier chunk's)
        stop = max_new if until is None else min(until, max_new)

        # 1. prefill, once per prompt
        # [3, B, P] and [3, B] (mRoPE) or [B, P] and [B]
        positions, next_position = self.template.prompt_positions(core, prompt_batch)
        recorded = recording_cache(self.decoder)
        prompt_kwargs = {k: v for k, v in prompt_batch.items() if k != "position_ids"}
        hidden = core(
            **prompt_kwargs, position_ids=positions, past_key_values=recorded, use_cache=True
        ).last_hidden_state
        logits = self._logits(hidden[:, -1]).repeat_interleave(group, dim=0)  # [N, V]

        # 2. the decode steps' K/V stores, from the prompts' recorded K/V
        position = next_position.repeat_interleave(group, dim=-1)[..., None]  # [3, N, 1] or [N, 1]
        advance = self._stepper(recorded, prompt_mask, group, max_new, position, hidden.dtype)
        del recorded

        # 3. decode. `rows`: the rows still decoding (all at first); a prompt whose G rows have all
        # finished leaves the batch at the next check (`_drop_finished`), so a mixture's short
        # answers stop costing decode steps while its long ones go on.
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        eos = torch.tensor(self.eos_token_ids, device=device)
        suppress = torch.tensor(params.suppressed(self.suppress_token_ids, self.eos_token_ids), dtype=torch.long, device=device)
        tokens = torch.full((num_rows, max_new), self.pad_token_id, dtype=torch.long, device=device)  # [N, T]
        logps = torch.zeros(num_rows, max_new, dtype=torch.float32, device=device)  # [N, T]
        if forced:
            tokens[:, :forced], logps[:, :forced] = resume.tokens.to(device), resume.logps.to(device)
        rows = torch.arange(num_rows, device=device)  # [n] the decoding rows' indices in [0, N)
        finished = torch.zeros(num_rows, dtype=torch.bool, device=device)  # [n]
        budgets = params.row_budgets(device)  # [n] a mixture's per-dataset budgets, or None
        done = 0  # decode steps done
        for step in range(max_new):
            done = step + 1
            uniform = None
            if not params.greedy:  # one draw per row of the whole batch: the same draws however many rows decode
                draws = torch.rand(num_rows, 1, dtype=torch.float32, device=device, generator=generator)  # [N, 1]
                uniform = draws if len(rows) == num_rows else draws[rows]  # [n, 1]
            if step < forced:  # an earlier chunk's token (the pad id after its row's end), its draw discarded
                token = tokens[rows, step]
            else:
                token = pick_tokens(logits, suppress, params, uniform)  # [n]
                token = torch.where(finished, self.pad_token_id, token)
                tokens[rows, step] = token
                scaled = logits / temperature if temperature != 1.0 else logits
                logps[rows, step] = scaled.log_softmax(-1).gather(1, token[:, None]).squeeze(1)
            finished |= torch.isin(token, eos)
            if budgets is not None:  # a row at its budget stops (cut_to_budgets marks it truncated)
                finished |= budgets <= step + 1
            if step == stop - 1:
                break
            if (step + 1) % self.check_every == 0:
                if bool(finished.all()):
                    break
                kept = self._drop_finished(finished, group) if self.drop_finished else None  # [n'] local indices
                if kept is not None:
                    rows, finished, token = rows[kept], finished[kept], token[kept]
                    budgets = None if budgets is None else budgets[kept]
                    advance.keep(kept)
                    keep_prompts(self.model, kept[::group] // group)  # fusion modules' memory: whole groups
            hidden = advance(token, step)  # [n, H]
            if step + 1 >= forced:  # the next step samples: its logits (a forced step needs none)
                logits = self._logits(hidden)  # [n, V]
        ended = torch.ones(num_rows, dtype=torch.bool, device=device)  # the rows that left the batch had all ended
        ended[rows] = finished
        return tokens[:, :done], logps[:, :done], ended

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 next-token logits [n, V] of final hidden states [n, H], soft-capped where the model caps them.
        A plain head runs in blocks of its rows where that is faster (`wide_linear`); a wrapped one (FSDP2, a
        LoRA head) through its forward."""
        head = self.lm_head
        if type(head) is nn.Linear and type(head.weight) is nn.Parameter and head.weight.shape[-1] == hidden.shape[-1]:
            logits = wide_linear(hidden, head.weight, head.bias)
        else:
            logits = head(hidden)
        return cap_logits(logits.float(), self.logit_softcap)

    @staticmethod
    def _drop_finished(finished: torch.Tensor, group: int) -> torch.Tensor | None:
        """The rows to keep decoding (local indices, whole groups), or None to keep them all: a
        prompt leaves once all its G rows have finished, when at least a quarter of the decoding
        prompts can leave together (each drop copies the K/V of the prompts that stay)."""
        done = finished.view(-1, group).all(1)  # [n / G]
        if int(done.sum()) * 4 < done.numel():
            return None
        return (~done).repeat_interleave(group).nonzero().squeeze(1)

    def _stepper(self, recorded: Cache, prompt_mask: torch.Tensor, group: int, max_new: int, position, dtype):
        """A `_LeanSteps` or `_TransformersSteps`: (token [n], step) -> the decoder's final hidden
        state [n, H] for that token, which sits at cache index P + step; `keep(rows)` drops the
        other rows (whole groups) from every later step.

        Lean: each prompt's K/V is held once and its G rows read it together (`GroupedPrefixKV`).
        Transformers' step: every row holds a copy of its prompt's K/V in a buffer for
        P + max_new positions.
        """
        if self.lean is not None:
            return _LeanSteps(self.lean, recorded, prompt_mask, group, max_new, position, dtype)
        return _TransformersSteps(self, recorded, prompt_mask, group, max_new, position, dtype)

    def _step_masks(self, row_mask: torch.Tensor, capacity: int, dtype: torch.dtype):
        """A function: keys seen so far -> the attention mask of one decode step, for rows whose
        prompt masks are row_mask [n, P].

        Built once, sliced per step. transformers would otherwise turn the 2D mask into the
        attention's mask at every step, reading `mask.all()` on the host each time.
        Without padding there is no mask at all (SDPA then runs grouped-query attention
        without repeating K/V); with padding a ready 4D mask in the attention's own convention.
        A decoder with sliding-window layers (Gemma3) gets {"full_attention": ...,
        "sliding_attention": ...}: the sliding one keeps the last `sliding_window` cache
        indices of the padding mask, as transformers' `sliding_window_overlay` does.
        """
        config = self.decoder.config
        attention = config._attn_implementation
        num_rows, prompt_len = row_mask.shape

        def to_attention(keep: torch.Tensor) -> torch.Tensor:  # keep: [n, L], True = attend
            if attention == "sdpa":
                return keep[:, None, None, :]  # [N, 1, 1, L]
            if attention == "eager":  # additive
                mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
                return mask.masked_fill(~keep, torch.finfo(dtype).min)[:, None, None, :]
            return keep.long()  # flash attention and others take the 2D mask

        keep = None  # without padding: no mask at all (one host read, before the loop)
        if not bool(row_mask.all()):
            keep = torch.ones(num_rows, capacity, dtype=torch.bool, device=row_mask.device)
            keep[:, :prompt_len] = row_mask.bool()  # [n, P + max_new]
        full_mask = None if keep is None else to_attention(keep)  # [n, 1, 1, P + max_new]

        def full(length: int) -> torch.Tensor | None:
            return None if full_mask is None else full_mask[..., :length]

        layer_types = set(getattr(config, "layer_types", None) or ())
        if "linear_attention" in layer_types:  # a decode token is never padding: no mask there
            return lambda length: {"full_attention": full(length), "linear_attention": None}
        if "sliding_attention" not in layer_types:
            return full
        if attention not in ("sdpa", "eager"):  # supports_shared_prefix refuses these too
            raise ValueError(f"sliding-window decode masks: sdpa and eager only, not {attention}")
        window = config.sliding_window
        columns = torch.arange(capacity, device=row_mask.device)

        def sliding(length: int) -> torch.Tensor | None:
            # the query is cache index length - 1; it sees indices > (length - 1) - window
            if keep is None and length <= window:
                return None
            in_window = (columns[:length] >= length - window).expand(num_rows, length)  # [N, L]
            return to_attention(in_window if keep is None else keep[:, :length] & in_window)

        return lambda length: {"full_attention": full(length), "sliding_attention": sliding(length)}


class _LeanSteps:
    """Decode steps by `LeanDecoder` over one `GroupedPrefixKV` per layer, the rotary tables of all
    steps computed at once."""

    def __init__(self, lean: LeanDecoder, recorded: Cache, prompt_mask, group: int, max_new: int, position, dtype):
        steps = torch.arange(max_new, device=prompt_mask.device)
        self.lean, self.group = lean, group
        self.cos, self.sin = lean.rotary_tables(position + steps, dtype)  # [N, max_new, head_dim]
        self.mask = mask = GroupedPrefixKV.group_mask(prompt_mask, group, max_new)  # one for every attention layer
        self.kv = [
            RowStates(layer.conv_states[0], layer.recurrent_states[0], group)
            if isinstance(layer, LinearAttentionLayer)  # a Gated DeltaNet layer's state, per row
            else GroupedPrefixKV(layer.keys, layer.values, group, max_new, mask)
            for layer in recorded.layers
        ]

    def __call__(self, token: torch.Tensor, step: int) -> torch.Tensor:
        return self.lean.step(token, self.cos[:, step], self.sin[:, step], self.kv, step)

    def keep(self, rows: torch.Tensor) -> None:
        prompts = rows[:: self.group] // self.group  # whole groups: every G-th row names its prompt
        self.cos, self.sin = self.cos[rows], self.sin[rows]
        self.mask = self.mask[prompts]
        for store in self.kv:
            store.keep(prompts, self.mask)


class _TransformersSteps:
    """Decode steps by the transformers decoder over a `_BufferLayer` cache (a copy of the
    prompt's K/V per row) with ready attention masks."""

    def __init__(self, rollout: SharedPrefixRollout, recorded: Cache, prompt_mask, group: int, max_new: int,
                 position, dtype):
        self.decoder, self.position, self.dtype = rollout.decoder, position, dtype
        self.prompt_len, self.capacity = prompt_mask.shape[1], prompt_mask.shape[1] + max_new
        self.cache = Cache(
            layers=[
                _StateRowsLayer(layer.conv_states[0], layer.recurrent_states[0], group)
                if isinstance(layer, LinearAttentionLayer)
                else _BufferLayer(layer.keys, layer.values, group, self.capacity)
                if layer.is_initialized
                else _EmptyLayer()  # Gemma 4's KV-shared layers read an earlier layer's K/V
                for layer in recorded.layers
            ]
        )
        self.row_mask = prompt_mask.repeat_interleave(group, dim=0)  # [N, P]
        self.masks = rollout._step_masks
        self.step_mask = self.masks(self.row_mask, self.capacity, dtype)

    def __call__(self, token: torch.Tensor, step: int) -> torch.Tensor:
        return self.decoder(
            input_ids=token[:, None],
            attention_mask=self.step_mask(self.prompt_len + step + 1),
            position_ids=self.position + step,
            past_key_values=self.cache,
            use_cache=True,
        ).last_hidden_state[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.keep(rows)
        self.position = self.position[..., rows, :]  # [3, n, 1] or [n, 1]
        self.row_mask = self.row_mask[rows]
        self.step_mask = self.masks(self.row_mask, self.capacity, self.dtype)


def lean_applies(model, template) -> bool:
    """True if the rollout's decode steps run as lean steps: the template declares its decoder
    layers lean-compatible and the loaded layers are plain (nn.Linear projections or LoRA over
    them, SiLU, no sliding window). After the prefill they call no module, so on a sharded model
    whose weights are gathered for the whole rollout a rank can stop when its own rows finish."""
    if not template.lean_decode:
        return False
    try:
        _, decoder = model_parts(model, template)
    except AttributeError:
        return False
    return LeanDecoder.supports(decoder)[0]
