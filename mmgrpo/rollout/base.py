"""What every rollout engine takes and returns.

A rollout engine turns B prompts into B x G completions. The training step needs nothing else
from it, so the in-process engines (HF generate, the shared-prefix sampler) and vLLM (colocated
or as a server) stand behind the same calls of `RolloutEngine`:

    rollout = engine.generate(prompts, sampling)      # list[PromptInputs] -> Rollout
    engine.update_weights(named_tensors, version)     # after every optimizer step
    engine.close()                                    # at the end of the run

An engine that can pause (`can_pause`: the in-process shared-prefix engine, vLLM) also generates a
rollout in chunks, for --partial_rollouts (mmgrpo/rollout/pipeline.py): a chunk decodes up to a
number of decode steps and returns a `PartialRollout`, which a later chunk continues, possibly on
newer weights, and `generate(..., resume=partial)` finishes:

    partial = engine.continue_(prompts, sampling, until=64)            # decode steps 0 .. 63
    partial = engine.continue_(prompts, sampling, partial, until=128)  # 64 .. 127 (after a weight update)
    rollout = engine.generate(prompts, sampling, resume=partial)       # the rest; token_versions per token

An in-process engine samples from the policy's own module, so its `update_weights` only records
the version; an engine holding its own copy of the weights (vLLM) loads the tensors it is given.
`named_tensors` is a lazy iterable of (HF parameter name, full tensor): an engine that does not
iterate it costs nothing, one that does receives the tensors one at a time.

The stages call an engine through a `RolloutSampler`, whose `generate` runs it under the policy's
autocast: the one place a rollout is generated (the pipeline, its background worker, the extra rounds).

A `Rollout` is the one batch type every later stage passes on, from the engine to the update:
rewards are written into it once (`score`, mmgrpo/rollout/rounds.py), the GRPO step adds its own
per-completion tensors (old and reference log-probs, importance weights, advantages), and
`select` / `concat` keep every per-completion field, so dynamic sampling and two-stage generation
never copy fields by hand. The step takes each micro-batch's rows in one call, `rows(micro_batch)`
(its last example):

    >>> ids = torch.tensor([[5, 2], [6, 7], [8, 2]])
    >>> a = Rollout(ids, torch.ones_like(ids), torch.tensor([False, True, False]), texts=["x", "y", "z"])
    >>> b = a.select([2, 0])
    >>> b.completion_ids.tolist(), b.texts
    ([[8, 2], [5, 2]], ['z', 'x'])
    >>> c = Rollout.concat([b, Rollout(torch.tensor([[9]]), torch.ones(1, 1, dtype=torch.long), torch.tensor([True]),
    ...                                texts=["w"])], pad_token_id=0)
    >>> c.completion_ids.tolist(), c.completion_mask.tolist(), c.texts
    ([[8, 2], [5, 2], [9, 0]], [[1, 1], [1, 1], [1, 0]], ['z', 'x', 'w'])
    >>> c.advantages = torch.tensor([0.5, -0.5, 1.0])
    >>> part = c.rows(MicroBatch(rows=[1, 2], prompts=[0, 1], counts=[1, 1], width=1))  # width: its longest completion
    >>> part.completion_ids.tolist(), part.advantages.tolist(), part.texts
    ([[5], [9]], [-0.5, 1.0], ['x', 'w'])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields

import torch

from mmgrpo.config import RolloutConfig
from mmgrpo.data.sample import dataset_of
from mmgrpo.forward.policy import autocast
from mmgrpo.grpo.batching import MicroBatch


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


# Rollout fields by how they follow the rows: [N, T] tensors right-padded by `concat` (the value
# it pads with; None: the pad token id), [N] / [F, N] tensors, and per-row lists.
_PADDED = {"completion_ids": None, "completion_mask": 0, "logps": 0.0, "loss_mask": 0, "token_versions": 0,
           "old_logps": 0.0, "ref_logps": 0.0, "teacher_logps": 0.0, "importance_weights": 0.0}
_ROW_TENSORS = ("truncated", "rewards", "row_versions", "advantages")
_ROW_LISTS = ("completion_media", "texts", "routed_experts")


@dataclass
class Rollout:
    completion_ids: torch.Tensor  # [B * G, T] right-padded with pad_token_id
    completion_mask: torch.Tensor  # [B * G, T] 1 up to and including the EOS token
    truncated: torch.Tensor  # [B * G] bool: no EOS within max_new_tokens
    logps: torch.Tensor | None = None  # [B * G, T] the sampler's log-probs of the tokens (0 after EOS), if it gives them
    weight_version: int = 0  # the optimizer steps the sampling weights had seen (the oldest, after `concat`)
    # [B * G] each row's weight version where the rows' differ (`concat` of rounds sampled on other weights);
    # None: every row's is weight_version. `versions()` gives them either way.
    row_versions: torch.Tensor | None = None
    # [B * G, T] the weight version that sampled each token (0 after the row's end), where a row's tokens may
    # come from several versions (--partial_rollouts: a rollout paused at weight updates, continued on the
    # new weights); None: every token's is its row's.
    token_versions: torch.Tensor | None = None
    # Multi-turn episodes (mmgrpo/rollout/multiturn.py); a single-turn engine leaves these unset.
    # A completion is then the whole trajectory after the prompt: the model's turns and the tool
    # turns between them, all under completion_mask (the training forward runs them all).
    # [B * G, T] 1 on the tokens the loss counts: the model's own (not a tool turn's), and the GRPO step
    # takes truncated completions out under --mask_truncated_completions; None: all of completion_mask
    loss_mask: torch.Tensor | None = None
    completion_media: list[dict] | None = None  # per row: media tensors of the images inside its completion, in order
    texts: list[str] | None = None  # per row: what rewards score (an episode's last model turn); `score` decodes the rest
    # MoE policies sampled by the HF engine: per row, the experts its tokens were routed to, [L_r + n_r, layers, k]
    # int16 on the CPU (its L_r prompt tokens, then its completion's); replayed by --routing_replay rollout
    routed_experts: list[torch.Tensor] | None = None
    columns: dict[str, list] = field(default_factory=dict)  # per-row reward columns (trajectory, tool_calls ...)
    # The generation's own figures, logged with the step: means over its completions (tools/turns ...)
    # and totals that add up across rollouts (tools/errors, tools/seconds). `select` keeps both.
    metrics: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    # Set once by `score` (mmgrpo/rollout/rounds.py): the weighted sum of the rewards, and each reward's own.
    rewards: torch.Tensor | None = None  # [B * G] (NaN: every reward skipped the completion)
    reward_per_func: torch.Tensor | None = None  # [F, B * G] (NaN = skipped)
    # Set by the GRPO step (mmgrpo/engine.py) on the batch it trains on, for the update to read row for row.
    # Here, not in a second batch type: the rewards are here already, and select / concat / rows keep
    # every field, so a micro-batch gets all of its rows' tensors in one call and none is copied by hand.
    old_logps: torch.Tensor | None = None  # [B * G, T] under the policy that sampled (num_iterations > 1, another sampler)
    ref_logps: torch.Tensor | None = None  # [B * G, T] under the reference (beta > 0)
    teacher_logps: torch.Tensor | None = None  # [B * G, T] under --teacher_model (on-policy distillation)
    importance_weights: torch.Tensor | None = None  # [B * G, T]: the sampler correction (mmgrpo/grpo/importance.py)
    advantages: torch.Tensor | None = None  # [B * G]

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:  # [B * G]
        return self.completion_mask.sum(1)

    @property
    def scored(self) -> bool:
        return self.rewards is not None

    @property
    def model_mask(self) -> torch.Tensor:  # [B * G, T]
        """The tokens the model sampled: `loss_mask`, or all of completion_mask where it is unset."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    def versions(self) -> torch.Tensor:
        """[B * G] the weight version that sampled each row: the oldest among its tokens (what
        --max_staleness bounds) where they differ.

        >>> ids = torch.tensor([[5, 6, 2], [7, 2, 0]])
        >>> r = Rollout(ids, torch.tensor([[1, 1, 1], [1, 1, 0]]), torch.tensor([False, False]), weight_version=3,
        ...             token_versions=torch.tensor([[3, 4, 4], [3, 3, 0]]))
        >>> r.versions().tolist()
        [3, 3]
        """
        if self.row_versions is not None:
            return self.row_versions
        if self.token_versions is not None:
            newest = torch.iinfo(self.token_versions.dtype).max  # after a row's end: never the oldest (every row has a token)
            mask = self.completion_mask.to(self.token_versions.device) == 0
            return self.token_versions.masked_fill(mask, newest).min(1).values
        return torch.full((len(self),), self.weight_version, dtype=torch.long)

    def tokens_versions(self) -> torch.Tensor:
        """[B * G, T] the weight version that sampled each token: `token_versions`, or each row's version
        on all its tokens where the rollout has none."""
        if self.token_versions is not None:
            return self.token_versions
        return self.versions()[:, None].expand(self.completion_mask.shape)

    def select(self, rows: Sequence[int] | torch.Tensor, width: int | None = None) -> Rollout:
        """The completions `rows` (indices, in that order), every per-row field with them; [N, T]
        fields cut to their first `width` columns where it is given."""
        index = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        picked = index.tolist()
        on_device: dict[torch.device, torch.Tensor] = {}  # the index where each field is, moved once

        def pick(value: torch.Tensor, dim: int = 0) -> torch.Tensor:
            if value.device not in on_device:
                on_device[value.device] = index.to(value.device)
            return value.index_select(dim, on_device[value.device])

        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("weight_version", "metrics", "totals"):
                values[f.name] = value
            elif f.name == "reward_per_func":
                values[f.name] = pick(value, dim=1)
            elif f.name in _PADDED:
                values[f.name] = pick(value) if width is None else pick(value)[:, :width]
            elif f.name in _ROW_TENSORS:
                values[f.name] = pick(value)
            elif f.name in _ROW_LISTS:
                values[f.name] = [value[i] for i in picked]
            elif f.name == "columns":
                values[f.name] = {key: [column[i] for i in picked] for key, column in value.items()}
        return Rollout(**values)

    def rows(self, micro_batch: MicroBatch) -> Rollout:
        """One micro-batch's rows (mmgrpo/grpo/batching.py), every per-row field with them: what a
        log-prob forward and its share of the loss read. [N, T] fields keep the micro-batch's
        `width` columns (its longest completion: the columns beyond are padding in all its rows)."""
        return self.select(micro_batch.rows, width=micro_batch.width)

    @classmethod
    def concat(cls, rollouts: Sequence[Rollout], pad_token_id: int) -> Rollout:
        """The rows of `rollouts` one after the other; [N, T] fields right-padded to the longest.
        A field set in some parts and not in others is dropped (None), except `loss_mask`, which
        defaults to the completion mask, and `token_versions`, to each row's version. Metrics are weighted by rows, totals added."""
        if len(rollouts) == 1:
            return rollouts[0]
        width = max(r.completion_ids.shape[1] for r in rollouts)
        counts = [len(r) for r in rollouts]
        values = {"weight_version": min(r.weight_version for r in rollouts)}
        for name, pad in _PADDED.items():
            parts = [getattr(r, name) for r in rollouts]
            if name == "loss_mask" and any(p is not None for p in parts):
                parts = [r.completion_mask if p is None else p for r, p in zip(rollouts, parts)]
            if name == "token_versions" and any(p is not None for p in parts):  # a round's rows: all of their row's
                parts = [r.tokens_versions() * r.completion_mask if p is None else p for r, p in zip(rollouts, parts)]
            if any(p is None for p in parts):
                values[name] = None
                continue
            value = pad_token_id if pad is None else pad
            values[name] = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in parts])
        if len({r.weight_version for r in rollouts}) > 1 or any(r.row_versions is not None for r in rollouts):
            values["row_versions"] = torch.cat([r.versions() for r in rollouts])
        for name in _ROW_TENSORS + ("reward_per_func",):
            if name == "row_versions":
                continue
            parts = [getattr(r, name) for r in rollouts]
            values[name] = None if any(p is None for p in parts) else torch.cat(parts, dim=-1)
        for name in _ROW_LISTS:
            parts = [getattr(r, name) for r in rollouts]
            values[name] = None if any(p is None for p in parts) else [x for p in parts for x in p]
        keys = [k for r in rollouts for k in r.columns]
        values["columns"] = {key: [x for r in rollouts for x in r.columns.get(key, [None] * len(r))] for key in dict.fromkeys(keys)}
        values["metrics"] = {
            key: sum(r.metrics.get(key, 0.0) * n for r, n in zip(rollouts, counts)) / max(1, sum(counts))
            for key in dict.fromkeys(k for r in rollouts for k in r.metrics)
        }
        values["totals"] = {key: sum(r.totals.get(key, 0.0) for r in rollouts) for key in dict.fromkeys(k for r in rollouts for k in r.totals)}
        return cls(**values)

    def to_file(self) -> dict:
        """What `torch.save` writes for `from_file` (tensors and plain values: loads with weights_only=True)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_file(cls, saved: dict) -> Rollout:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in saved.items() if key in known})


@dataclass
class PartialRollout:
    """A rollout paused between chunks (--partial_rollouts; `RolloutEngine.continue_`): the decode
    steps done so far, which the next chunk feeds back teacher-forced (their K/V recomputed on the
    weights it holds then) before it samples on. Tensors only, so a checkpoint saves it as is.

    Each row of a rollout decodes in step with the others: a row that has not ended has as many
    tokens as the decode steps done (`steps`), so a chunk is a window of decode steps.
    """

    tokens: torch.Tensor  # [B * G, S] the tokens of the S decode steps done; the pad id after a row's end
    logps: torch.Tensor  # [B * G, S] the sampler's log-probs, each under the weights of the chunk that drew it
    token_versions: torch.Tensor  # [B * G, S] the weight version of the chunk that drew each token
    finished: torch.Tensor  # [B * G] bool: the row ended (EOS, or its budget)
    chunks: int = 1  # chunks decoded so far
    complete: bool = False  # every row ended, or max_new_tokens steps are done: a later chunk has nothing to decode

    @property
    def steps(self) -> int:
        return self.tokens.shape[1]

    def tag(self, rollout: Rollout, version: int) -> Rollout:
        """`rollout`, the completions this decode ran to the end, with their versions: the oldest of
        the rows' first tokens (`version` where no step was decoded) and, where the chunks came from
        several versions, each token's (0 after a row's end)."""
        rollout.weight_version = int(self.token_versions[:, 0].min()) if self.steps else version
        if self.chunks > 1:
            width = rollout.completion_ids.shape[1]
            versions = torch.nn.functional.pad(self.token_versions, (0, max(0, width - self.steps)))[:, :width]
            rollout.token_versions = versions.to(rollout.completion_mask.device) * rollout.completion_mask
        return rollout

    def to_file(self) -> dict:
        """What `torch.save` writes for `from_file` (loads with weights_only=True)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_file(cls, saved: dict) -> PartialRollout:
        return cls(**saved)


class RolloutEngine:
    """What every rollout engine is (see the module docstring); subclasses implement `generate`
    and keep these defaults where they fit: an engine on the policy's own module has no weights to
    load and nothing to close."""

    # True where the engine samples from its own copy of the weights (vLLM; an in-process engine
    # on a copy, for asynchronous rollouts): its samples may lag or differ numerically from the
    # policy, so the step recomputes their log-probs and measures the mismatch.
    separate_weights: bool = False
    weight_version: int = 0  # the version of the weights it samples from
    # True where a rollout can pause and continue on other weights (`continue_`, --partial_rollouts)
    can_pause: bool = False

    def generate(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None) -> Rollout:
        """B encoded prompts (`PromptInputs`) -> B x G completions, the G of a prompt contiguous.
        resume: a paused rollout of these prompts to finish (engines that `can_pause`)."""
        raise NotImplementedError

    def continue_(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None,
                  until: int | None = None) -> PartialRollout:
        """One chunk of a rollout: decode steps from where `resume` stopped (None: the start) to
        `until` (None: the end), on the weights the engine holds now. Engines that `can_pause`."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause a rollout (--partial_rollouts)")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Make the next `generate` sample from these weights, tagged `version`. Here, for the
        in-process engines: on the policy's own module nothing to load; on a copy of it
        (`separate_weights`, asynchronous rollouts) the tensors are copied into `self.model`."""
        if self.separate_weights:
            load_named_tensors(self.model, named_tensors)
        self.weight_version = version

    def close(self) -> None:
        """Free what the engine holds (a vLLM engine goes before the process group it uses)."""


@dataclass(frozen=True)
class RolloutSampler:
    """A rollout engine as the stages of a step call it (the rollout pipeline, its background worker,
    the extra rounds): `generate` runs the engine under the policy's autocast, the one place a
    rollout is generated. An in-process engine samples from the policy's own module, so in the
    precision of its forwards; autocast holds per thread, so the worker's thread enters it itself."""

    engine: RolloutEngine
    dtype: torch.dtype | None = None  # the policy's autocast dtype (--bf16, --fp16); None: float32
    device: torch.device = torch.device("cpu")  # the policy's, whose autocast applies
    # --sequence_parallel_size: the group leader's rollout on each of its ranks (Strategy.share_rollout)
    share: Callable[[Rollout], Rollout] | None = None

    def generate(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None = None) -> Rollout:
        """B encoded prompts (`PromptInputs`) -> B x G completions, the G of a prompt contiguous;
        resume: a paused rollout of them to finish (--partial_rollouts)."""
        resuming = {} if resume is None else {"resume": resume}  # an engine that cannot pause takes no `resume`
        with autocast(self.dtype, self.device):
            rollout = self.engine.generate(prompts, sampling, **resuming)
        return rollout if self.share is None else self.share(rollout)

    def continue_(self, prompts: list, sampling: SamplingParams, resume: PartialRollout | None, until: int) -> PartialRollout:
        """One chunk of a paused rollout (`RolloutEngine.continue_`), under the policy's autocast."""
        with autocast(self.dtype, self.device):
            return self.engine.continue_(prompts, sampling, resume, until)


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
    if rollout.token_versions is not None:
        rollout.token_versions = (rollout.token_versions * mask)[:, :width]
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


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a step's sampling and of the step itself, distinct per step and rank (seed: --seed)."""
    return seed * 100_003 + step + 1_000_003 * rank


def sampling_params(options: RolloutConfig, seed: int | None = None, samples: list | None = None,
                    completion_caps: dict[str, int] | None = None) -> SamplingParams:
    """The rollout options as the engines' SamplingParams.

    completion_caps: {dataset: its own max_completion_length} (the registry's); each of `samples`
    from such a dataset gets that budget, the others --max_completion_length.
    """
    budget, per_prompt = options.max_completion_length, None
    if samples and completion_caps:
        per_prompt = [completion_caps.get(dataset_of(sample.id), budget) for sample in samples]
        budget = max(per_prompt)
        if min(per_prompt) == budget:  # one budget for the whole batch
            per_prompt = None
    return SamplingParams(
        # two-stage generation rolls out K first (mmgrpo/rollout/rounds.py completes the groups)
        num_generations=options.first_stage_generations or options.num_generations,
        max_new_tokens=budget,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        seed=seed,
        max_new_tokens_per_prompt=per_prompt,
        suppress_eos=options.suppress_eos,
    )
