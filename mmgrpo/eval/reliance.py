"""How much does the policy rely on each modality? Measured on completions it sampled.

    mmgrpo train ... --fusion_probe_steps 10      # every 10 steps, on --fusion_probe_rows completions
    mmgrpo eval ... --fusion_probe                # on every greedy answer of the evaluation

For a completion c of prompt x with media, and each modality m the prompt has:

    reliance(m) = mean_t log p(c_t | x, c_<t) - mean_t log p(c_t | x with m blanked, c_<t)

a counterfactual forward under no_grad. Blanked: the medium's input tensors are zeros, which for
images and video is the processor's mean image (its normalisation maps the mean to 0), for audio
a constant spectrogram; the tower still runs on it, so every rank makes the same calls, and the
tokens and positions stay where they were. A policy that ignores the image scores ~0 (exactly 0
when its tower's output does not depend on the input); one that reads it scores > 0: its own
answer became less likely without the image. Logged as fusion/reliance/<modality> (nats per token).

The same forward (with the media) runs the text decoder with eager attention, and each layer's
attention weights give the share of attention the completion's tokens put on each modality's
tokens (mean over heads and completion tokens), averaged over the layers of each band: the
decoder's layers split in three (shallow, middle, deep; two or one for smaller decoders).
Logged as fusion/attention/<modality>/<band>. Eager attention runs only in the probe's forwards
(the blanked ones too, so they differ from the first by the medium alone): the policy's own
forwards keep theirs.

Cost: 1 + (modalities present) forwards of a few rows, without gradients, every N steps
(benchmarks/fusion_probe_cost.py measures it against the step).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from mmgrpo.forward.policy import ForwardBatch, Policy, autocast
from mmgrpo.parallel.base import Strategy
from mmgrpo.rollout.base import Rollout

BAND_NAMES = {1: ("all",), 2: ("shallow", "deep"), 3: ("shallow", "middle", "deep")}


def layer_bands(num_layers: int) -> list[tuple[str, list[int]]]:
    """The decoder's layers in up to three contiguous bands.

    >>> layer_bands(2), layer_bands(7)[1]
    ([('shallow', [0]), ('deep', [1])], ('middle', [2, 3, 4]))
    """
    count = min(3, num_layers)
    bounds = [round(i * num_layers / count) for i in range(count + 1)]
    return [(BAND_NAMES[count][i], list(range(bounds[i], bounds[i + 1]))) for i in range(count)]


def blank_modality(batch: dict, template, modality: str) -> dict:
    """`batch` with every input tensor of `modality` zeroed (grids and masks, integers, kept)."""
    hook = template.media[modality]
    keys = (*hook.patch_keys, *hook.item_keys, *getattr(hook, "row_keys", ()))
    return {key: torch.zeros_like(value) if key in keys and torch.is_floating_point(value) else value
            for key, value in batch.items()}


@contextmanager
def eager_attention(decoder):
    """The text decoder computes attention weights (eager) for the duration."""
    config = decoder.config
    was = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = was


@contextmanager
def attention_shares(decoder, columns: dict[str, torch.Tensor], queries: torch.Tensor, out: dict[str, list]):
    """Collect, per layer, each modality's share of the attention of the query positions.

    columns: {modality: [R, L] bool}, its tokens; queries: [R, L] bool, the completion's positions.
    out[modality] gets one [R] tensor per layer (NaN for a row without that modality).
    """
    def keep(module, args, output):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None  # [R, heads, L, L]
        if weights is None:
            return
        weights = weights.float().mean(1)  # [R, L, L]
        counted = queries.float()  # [R, L]
        for modality, mask in columns.items():
            share = (weights * mask[:, None, :].float()).sum(-1)  # [R, L]: each query's share on the modality
            per_row = (share * counted).sum(1) / counted.sum(1).clamp(min=1)  # [R]
            out[modality].append(torch.where(mask.any(1), per_row, torch.nan))

    modules = [layer.self_attn for layer in decoder.layers if hasattr(layer, "self_attn")]
    handles = [module.register_forward_hook(keep) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def measure_reliance(policy: Policy, prompts: list, completion_ids: torch.Tensor, completion_mask: torch.Tensor, *,
                     strategy: Strategy | None = None, temperature: float = 1.0, dtype: torch.dtype | None = None) -> dict[str, float]:
    """The probe on R completions, one per prompt (prompts: R PromptInputs; completion_ids, mask [R, T]).

    strategy: a sharded run's (its ranks run the same forwards: every modality some rank has).
    Returns {"fusion/reliance/<m>": nats per token, "fusion/attention/<m>/<band>": share}.
    """
    template = policy.template
    batch = policy.to_device(template.collate(prompts))
    if strategy is not None:
        batch = strategy.align_media(batch, template)
    completion_ids, completion_mask = completion_ids.to(policy.device), completion_mask.to(policy.device)
    input_ids, attention = batch["input_ids"], batch["attention_mask"].bool()  # [R, P]
    columns = {m: (input_ids == token) & attention for m, token in template.placeholder_ids.items()}  # [R, P]
    present = [m for m in columns if bool(columns[m].any())]
    if strategy is not None and strategy.world_size > 1:  # the same forwards on every rank
        present = [m for m in columns if strategy.any_rank(m in present)]
    rows, prompt_len = input_ids.shape
    width = completion_ids.shape[1]
    pad = torch.zeros(rows, width, dtype=torch.bool, device=input_ids.device)
    full_columns = {m: torch.cat([columns[m], pad], dim=1) for m in present}  # [R, P + T]
    # position P - 1 + t predicts completion token t: the completion's queries
    queries = torch.zeros(rows, prompt_len + width, dtype=torch.bool, device=input_ids.device)
    queries[:, prompt_len - 1 : prompt_len - 1 + width] = completion_mask.bool()
    decoder = policy.model.get_submodule(template.components["llm"])
    per_layer: dict[str, list] = {m: [] for m in present}
    tokens = completion_mask.sum(1).clamp(min=1)  # [R]

    def mean_logp(inputs: dict) -> torch.Tensor:  # [R]
        forward = ForwardBatch(inputs, [1] * rows, shared=False)  # naive: one row per prompt
        logps, _ = policy.completion_logprobs(forward, completion_ids, completion_mask, temperature=temperature)
        return logps.float().sum(1) / tokens

    metrics = {}
    # every forward eager, so the blanked ones differ from the first by the medium alone
    with torch.no_grad(), autocast(dtype, policy.device), eager_attention(decoder):
        with attention_shares(decoder, full_columns, queries, per_layer):
            with_media = mean_logp(batch)
        answered = completion_mask.sum(1) > 0
        for modality in present:
            blanked = mean_logp(blank_modality(batch, template, modality))
            rows_with = columns[modality].any(1) & answered
            metrics[f"fusion/reliance/{modality}"] = (
                float((with_media - blanked)[rows_with].mean()) if rows_with.any() else float("nan"))
    for modality, layers in per_layer.items():
        if not layers:
            continue
        shares = torch.stack(layers)  # [layers, R]
        for band, indices in layer_bands(len(layers)):
            values = shares[indices].mean(0)  # [R]
            values = values[~values.isnan()]
            metrics[f"fusion/attention/{modality}/{band}"] = float(values.mean()) if values.numel() else float("nan")
    return metrics


def probe_rows(num_prompts: int, group: int, limit: int) -> list[int]:
    """The rows the probe reads: the first completion of each of the first `limit` prompts.

    >>> probe_rows(num_prompts=5, group=4, limit=3)
    [0, 4, 8]
    """
    return list(range(0, min(num_prompts, limit) * group, group))


def probe_step(policy: Policy, encoded: list, batch: Rollout, group: int, *, rows: int, strategy: Strategy | None = None,
               temperature: float = 1.0, dtype: torch.dtype | None = None) -> dict[str, float]:
    """The probe on a GRPO step's completions (--fusion_probe_steps), before the step's update: the
    first completion of each of the first `rows` prompts (--fusion_probe_rows). encoded: the B
    prompts (PromptInputs); batch: their B x `group` completions; the rest as `measure_reliance`."""
    picked = probe_rows(len(encoded), group, rows)
    probed = batch.select(picked)
    return measure_reliance(
        policy, [encoded[r // group] for r in picked], probed.completion_ids, probed.completion_mask,
        strategy=strategy, temperature=temperature, dtype=dtype,
    )
