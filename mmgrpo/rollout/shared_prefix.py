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
and attended by its G rows in one SDPA call) for the Qwen-style decoders, transformers' text
decoder with a ready mask for the others (Gemma3).

The loop does nothing else: no logits processors, no re-padding, no processor calls, no
per-step host sync (finished rows are tracked on device; `finished.all()` is read every
`check_every` steps). The K/V buffer is allocated once for P + max_new_tokens positions, so a
step writes one column instead of concatenating the whole cache as DynamicCache does.

Every template family runs here (mmgrpo.grpo.shared_prefix.SHARED_PREFIX_FAMILIES): the prefill
calls the family's core with the prompt's media and positions ([3, B, P] mRoPE for the Qwen-VL
families and the Qwen2.5-Omni thinker, [B, P] 1-D RoPE for Qwen2, Qwen2-Audio, LLaVA-OneVision
and Gemma3), the decode steps call its text decoder. Qwen2-Audio's clips stay in their prompt's
row (no `repeat_rows` needed, unlike HFRollout). Gemma3's sliding-window layers get their own
per-step mask (see `_step_masks`).

Sampling follows transformers' order: placeholder ids suppressed, then temperature, top-k,
top-p, then one draw per row by inverse CDF (`sample_from`); greedy takes the argmax after
suppression. Greedy outputs equal HF generate's token for token (tests/test_shared_prefix.py).

    backend = SharedPrefixRollout(model, eos_token_ids=[...], pad_token_id=..., suppress_token_ids=[...])
    rollout = backend.generate(prompt_batch, SamplingParams(num_generations=8, max_new_tokens=256))

Use it only where `supports_shared_prefix(model, template)` says so (other attention kinds,
reentrant checkpointing ...); elsewhere use HFRollout.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from mmgrpo.grpo.shared_prefix import _recording_cache, find_core, prompt_positions
from mmgrpo.rollout.base import Rollout, SamplingParams, completion_mask_from_ids
from mmgrpo.rollout.lean_decode import GroupedPrefixKV, LeanDecoder


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


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as transformers' warpers do (at least one token kept).

    >>> logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    >>> filter_logits(logits, 1.0, 2, 1.0).isinf().tolist()
    [[False, False, True, True]]
    >>> filter_logits(logits, 1.0, 0, 0.5).isinf().tolist()
    [[False, True, True, True]]
    """
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        remove = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p  # [N, V]
        remove[:, -1] = False
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def sample_from(probs: torch.Tensor) -> torch.Tensor:
    """One index per row drawn from probs [N, V] by inverting the CDF: one uniform per row.

    torch.multinomial draws V random numbers per row on CPU (33 ms per step for 8 rows of a
    152K vocabulary); this is cumsum + binary search (1.4 ms). A zero-probability token is never
    drawn: it needs cdf[i - 1] <= u < cdf[i] with cdf[i] == cdf[i - 1].

    >>> torch.manual_seed(0) and None
    >>> draws = sample_from(torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(20000, 4))
    >>> [round(n / 20000, 1) for n in torch.bincount(draws, minlength=4).tolist()]
    [0.1, 0.0, 0.6, 0.3]
    """
    cdf = probs.cumsum(-1)  # [N, V]
    total = cdf[:, -1:]
    # u in [0, total): strictly below the last cdf value even after rounding
    u = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


class SharedPrefixRollout:
    """B prompts -> B x G completions, each prompt's media and prefill computed once.

    check_every: steps between the host reads of "has every row finished?" (each read is one
    device sync; after all rows finish at most check_every - 1 steps are wasted).
    lean: run decode steps with `LeanDecoder` (the layers' operations without transformers'
    module stack, rollout/lean_decode.py) where the decoder's layers allow it.
    """

    def __init__(
        self,
        model,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        suppress_token_ids: list[int],
        check_every: int = 8,
        lean: bool = True,
    ):
        self.model = model
        self.core, self.family = find_core(model)
        self.decoder = self.family.text_decoder(self.core)  # runs the decode steps
        self.lm_head = model.get_output_embeddings()
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.suppress_token_ids = list(suppress_token_ids)
        self.check_every = check_every
        self.lean = LeanDecoder(self.decoder) if lean and LeanDecoder.supports(self.decoder)[0] else None

    @staticmethod
    def lean_applies(model) -> bool:
        """True if the decode steps of `model` would run as lean steps: after the prefill they call
        no module, so on a sharded model whose weights are gathered for the whole rollout a rank
        can stop when its own rows finish (no collective inside the loop)."""
        try:
            core, family = find_core(model)
        except ValueError:  # not a family the shared prefix knows
            return False
        return LeanDecoder.supports(family.text_decoder(core))[0]

    def generate(self, prompt_batch: dict, params: SamplingParams) -> Rollout:
        """prompt_batch: a left-padded collated batch of B prompts -> B x G completions."""
        return self.sample(prompt_batch, params)[0]

    @torch.no_grad()
    def sample(self, prompt_batch: dict, params: SamplingParams) -> tuple[Rollout, torch.Tensor]:
        """The rollout and logps [B * G, T]: log-probs of the sampled tokens under
        softmax(logits / temperature) (no top-k/top-p/suppression), 0 after EOS."""
        was_training = self.model.training
        self.model.eval()
        try:
            tokens, logps = self._decode(prompt_batch, params)
        finally:
            self.model.train(was_training)
        mask, truncated = completion_mask_from_ids(tokens, self.eos_token_ids)  # [N, T]
        used = int(mask.sum(1).max()) if mask.numel() else 0  # rows stopped together: trim the spare steps
        tokens, mask, logps = tokens[:, :used], mask[:, :used], logps[:, :used]
        tokens = tokens.masked_fill(mask == 0, self.pad_token_id)
        rollout = Rollout(completion_ids=tokens, completion_mask=mask, truncated=truncated)
        return rollout, logps * mask

    def _decode(self, prompt_batch: dict, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        core, group, max_new = self.core, params.num_generations, params.max_new_tokens
        prompt_mask = prompt_batch["attention_mask"]  # [B, P]
        num_prompts, prompt_len = prompt_mask.shape
        num_rows = num_prompts * group
        device = prompt_mask.device
        temperature = 1.0 if params.greedy else params.temperature

        # 1. prefill, once per prompt
        # [3, B, P] and [3, B] (mRoPE) or [B, P] and [B]
        positions, next_position = prompt_positions(core, self.family, prompt_batch)
        recorded = _recording_cache(len(self.decoder.layers))
        prompt_kwargs = {k: v for k, v in prompt_batch.items() if k != "position_ids"}
        hidden = core(
            **prompt_kwargs, position_ids=positions, past_key_values=recorded, use_cache=True
        ).last_hidden_state
        logits = self.lm_head(hidden[:, -1]).float().repeat_interleave(group, dim=0)  # [N, V]

        # 2. the decode steps' K/V stores, from the prompts' recorded K/V
        position = next_position.repeat_interleave(group, dim=-1)[..., None]  # [3, N, 1] or [N, 1]
        advance = self._stepper(recorded, prompt_mask, group, max_new, position, hidden.dtype)
        del recorded

        # 3. decode
        eos = torch.tensor(self.eos_token_ids, device=device)
        suppress = torch.tensor(self.suppress_token_ids, dtype=torch.long, device=device)
        tokens = torch.full((num_rows, max_new), self.pad_token_id, dtype=torch.long, device=device)  # [N, T]
        logps = torch.zeros(num_rows, max_new, dtype=torch.float32, device=device)  # [N, T]
        finished = torch.zeros(num_rows, dtype=torch.bool, device=device)  # [N]
        for step in range(max_new):
            token = self._pick(logits, suppress, params)  # [N]
            token = torch.where(finished, self.pad_token_id, token)
            tokens[:, step] = token
            scaled = logits / temperature if temperature != 1.0 else logits
            logps[:, step] = scaled.log_softmax(-1).gather(1, token[:, None]).squeeze(1)
            finished |= torch.isin(token, eos)
            if step == max_new - 1 or ((step + 1) % self.check_every == 0 and bool(finished.all())):
                break
            logits = self.lm_head(advance(token, step)).float()  # [N, V]
        return tokens, logps

    def _stepper(self, recorded: Cache, prompt_mask: torch.Tensor, group: int, max_new: int, position, dtype):
        """A function (token [N], step) -> the decoder's final hidden state [N, H] for that token,
        which sits at cache index P + step: the lean step where it applies, else transformers'.

        Lean: each prompt's K/V is held once and its G rows read it together (`GroupedPrefixKV`).
        Transformers' step: every row holds a copy of its prompt's K/V in a buffer for
        P + max_new positions.
        """
        prompt_len = prompt_mask.shape[1]
        capacity = prompt_len + max_new
        if self.lean is not None:
            steps = torch.arange(max_new, device=prompt_mask.device)
            cos, sin = self.lean.rotary_tables(position + steps, dtype)  # [N, max_new, head_dim], all steps at once
            mask = GroupedPrefixKV.group_mask(prompt_mask, group, max_new)  # one for every layer
            kv = [GroupedPrefixKV(layer.keys, layer.values, group, max_new, mask) for layer in recorded.layers]

            def lean_step(token: torch.Tensor, step: int) -> torch.Tensor:
                return self.lean.step(token, cos[:, step], sin[:, step], kv, step)

            return lean_step
        cache = Cache(layers=[_BufferLayer(layer.keys, layer.values, group, capacity) for layer in recorded.layers])
        step_mask = self._step_masks(prompt_mask, group, capacity, dtype)

        def transformers_step(token: torch.Tensor, step: int) -> torch.Tensor:
            return self.decoder(
                input_ids=token[:, None],
                attention_mask=step_mask(prompt_len + step + 1),
                position_ids=position + step,
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state[:, -1]

        return transformers_step

    def _step_masks(self, prompt_mask: torch.Tensor, group: int, capacity: int, dtype: torch.dtype):
        """A function: keys seen so far -> the attention mask of one decode step.

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
        num_rows = prompt_mask.shape[0] * group

        def to_attention(keep: torch.Tensor) -> torch.Tensor:  # keep: [N, L], True = attend
            if attention == "sdpa":
                return keep[:, None, None, :]  # [N, 1, 1, L]
            if attention == "eager":  # additive
                mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
                return mask.masked_fill(~keep, torch.finfo(dtype).min)[:, None, None, :]
            return keep.long()  # flash attention and others take the 2D mask

        keep = None  # without padding: no mask at all (one host read, before the loop)
        if not bool(prompt_mask.all()):
            keep = torch.ones(num_rows, capacity, dtype=torch.bool, device=prompt_mask.device)
            keep[:, : prompt_mask.shape[1]] = prompt_mask.bool().repeat_interleave(group, dim=0)  # [N, P + max_new]
        full_mask = None if keep is None else to_attention(keep)  # [N, 1, 1, P + max_new]

        def full(length: int) -> torch.Tensor | None:
            return None if full_mask is None else full_mask[..., :length]

        if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
            return full
        if attention not in ("sdpa", "eager"):  # supports_shared_prefix refuses these too
            raise ValueError(f"sliding-window decode masks: sdpa and eager only, not {attention}")
        window = config.sliding_window
        columns = torch.arange(capacity, device=prompt_mask.device)

        def sliding(length: int) -> torch.Tensor | None:
            # the query is cache index length - 1; it sees indices > (length - 1) - window
            if keep is None and length <= window:
                return None
            in_window = (columns[:length] >= length - window).expand(num_rows, length)  # [N, L]
            return to_attention(in_window if keep is None else keep[:, :length] & in_window)

        return lambda length: {"full_attention": full(length), "sliding_attention": sliding(length)}

    @staticmethod
    def _pick(logits: torch.Tensor, suppress: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        if suppress.numel():
            logits = logits.index_fill(1, suppress, float("-inf"))
        if params.greedy:
            return logits.argmax(-1)
        logits = filter_logits(logits, params.temperature, params.top_k, params.top_p)
        return sample_from(logits.softmax(-1))


# ---------------------------------------------------------------------------------------------
# Benchmark: python -m mmgrpo.rollout.shared_prefix [--family qwen2-vl] [--image_size 448] ...
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Time HF generate vs this backend (rollout), and the naive vs shared log-prob forward +
    backward, on a tiny random model, alternating A/B runs; prints the median ratios."""
    import argparse
    import os
    import statistics
    import time

    import numpy as np
    from PIL import Image

    from mmgrpo.data.schema import LoadedSample
    from mmgrpo.grpo.logprobs import completion_logprobs
    from mmgrpo.grpo.shared_prefix import shared_prefix_hidden
    from mmgrpo.models import load_model, load_processor
    from mmgrpo.rollout.hf import HFRollout
    from mmgrpo.templates import get_template

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--family", default="qwen2-vl", help="tiny model family (tiny:<family>)")
    parser.add_argument("--model", default=None, help="a checkpoint folder instead of the tiny model")
    parser.add_argument(
        "--image_size", type=int, default=448, help="square image side; max_pixels is set to fit it"
    )
    parser.add_argument("--num_prompts", type=int, default=1)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="A/B pairs per measurement")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    path = args.model or f"tiny:{args.family}"
    model, processor = load_model(path), load_processor(path)
    template = get_template(args.family, processor, max_pixels=args.image_size**2)
    pixels = np.random.RandomState(0).randint(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
    takes_images = "image" in template.modalities  # else a text prompt (Qwen2, Qwen2-Audio)
    question = ("<image>" if takes_images else "") + "How many red circles?"
    samples = [
        LoadedSample(
            id=f"bench/{i}",
            messages=[{"role": "user", "content": question}],
            images=[Image.fromarray(pixels)] if takes_images else [],
        )
        for i in range(args.num_prompts)
    ]
    batch = template.collate([template.encode_prompt(s) for s in samples])
    tokenizer = template.tokenizer
    eos = sorted({tokenizer.eos_token_id, *getattr(template, "stop_token_ids", ())} - {None})
    kwargs = dict(
        eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id, suppress_token_ids=template.suppress_token_ids
    )
    params = SamplingParams(num_generations=args.num_generations, max_new_tokens=args.max_new_tokens)
    backends = {"hf": HFRollout(model, **kwargs), "shared": SharedPrefixRollout(model, **kwargs)}
    image_tokens = int((batch["input_ids"] == template.media["image"].token_id).sum()) if takes_images else 0
    print(
        f"{path}: {args.num_prompts} prompt(s) of {batch['input_ids'].shape[1]} tokens "
        f"({image_tokens // args.num_prompts} image tokens each), "
        f"G={args.num_generations}, {args.max_new_tokens} new tokens, {args.threads} thread(s)"
    )

    def timed(fn) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    def compare(name: str, runs: dict) -> None:
        for fn in runs.values():  # warm-up
            fn()
        times = {k: [] for k in runs}
        for _ in range(args.repeats):
            for key, fn in runs.items():  # A B A B ...
                times[key].append(timed(fn))
        (a, ta), (b, tb) = times.items()
        wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
        cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
        ratios = [x[0] / y[0] for x, y in zip(ta, tb)]
        print(
            f"{name}: {a} {wall[a]:.3f} s (cpu {cpu[a]:.3f}), {b} {wall[b]:.3f} s (cpu {cpu[b]:.3f}); "
            f"speedup {statistics.median(ratios):.2f}x (pairs {min(ratios):.2f}-{max(ratios):.2f})"
        )

    rollout = backends["shared"].generate(batch, params)
    compare("rollout", {k: (lambda b=b: b.generate(batch, params)) for k, b in backends.items()})

    completion_ids, completion_mask = rollout.completion_ids, rollout.completion_mask
    lm_head = model.get_output_embeddings()
    backbone = model.get_submodule(template.components["backbone"])

    def logprob_step(shared: bool) -> None:
        model.zero_grad(set_to_none=True)
        if shared:
            hidden = shared_prefix_hidden(
                backbone, batch, completion_ids, completion_mask, args.num_generations
            )
        else:
            inputs = template.forward_inputs(batch, completion_ids, completion_mask, model=model)
            prompt_len = batch["input_ids"].shape[1]
            hidden = backbone(**inputs, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]
        logps, _ = completion_logprobs(hidden, lm_head.weight, completion_ids)
        (logps * completion_mask).sum().backward()

    model.train()
    compare(
        "log-prob forward+backward",
        {"naive": lambda: logprob_step(False), "shared": lambda: logprob_step(True)},
    )


if __name__ == "__main__":
    main()
