"""Partial rollouts on vLLM (`--partial_rollouts` with `--use_vllm`, colocated or servers): a rollout
decoded in chunks, each on the weights the engine holds when it runs (mmgrpo/rollout/pipeline.py
has the schedule, `PartialRollout` in mmgrpo/rollout/base.py the state between chunks).

    requests = chunk_requests(len(prompts), sampling, resume, until)   # what this chunk asks vLLM
    replies = [...]                       # per request, its completions' new {"ids", "logps"}
    partial = chunk_result(requests, replies, sampling, resume, version, pad_id, eos_ids)
    rollout = rollout_of_partial(partial, sampling, template)          # once every completion ended

The first chunk asks each prompt for its G samples, up to decode step `until`. A later chunk asks
each completion that has not ended for its next tokens, one request per completion: the prompt as
token ids (vLLM's own tokenization of the prompt text, whose media placeholders vLLM expands as it
does for the text) followed by the completion's tokens so far. vLLM prefills them again on the
weights it holds now (the K/V of the earlier chunks dropped: the prefix cache is reset at every
sync); the earlier tokens keep their log-probs and versions. A continued completion draws from a
seed of its own per chunk, so a run is as reproducible as vLLM's seeded sampling; unlike the
in-process engine's, a rollout in chunks is not the draws of one uninterrupted generate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmgrpo.rollout.base import PartialRollout, Rollout, SamplingParams
from mmgrpo.rollout.vllm_requests import rollout_from_completions, sampling_options

CHUNK_SEED_STRIDE = 1_000_003  # a continued completion's seed: the rollout's seed + its row + this per chunk


@dataclass
class ChunkRequest:
    """One vLLM request of a chunk, for prompt `prompt` (its index in the batch)."""

    prompt: int
    rows: list[int]  # the completions it gives, in order (the first chunk: the prompt's G)
    max_tokens: int  # new tokens at most
    tokens: list[int] | None = None  # a later chunk: the completion so far, appended to the prompt's ids
    seed: int | None = None  # a later chunk: its own seed (the first chunk's are `sampling_options`' per prompt)


def chunk_requests(num_prompts: int, sampling: SamplingParams, resume: PartialRollout | None,
                   until: int | None) -> list[ChunkRequest]:
    """The requests of the chunk that decodes from `resume`'s end (None: the start) to decode step
    `until` (None: each completion's budget).

    >>> sampling = SamplingParams(num_generations=2, max_new_tokens=6, seed=10, max_new_tokens_per_prompt=[6, 3])
    >>> [(r.prompt, r.rows, r.max_tokens) for r in chunk_requests(2, sampling, None, until=4)]
    [(0, [0, 1], 4), (1, [2, 3], 3)]
    >>> paused = PartialRollout(torch.tensor([[5, 6, 7, 8], [5, 2, 0, 0], [1, 1, 1, 0], [1, 2, 0, 0]]),
    ...                         torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.long),
    ...                         finished=torch.tensor([False, True, True, True]))
    >>> [(r.prompt, r.rows, r.max_tokens, r.tokens, r.seed) for r in chunk_requests(2, sampling, paused, until=None)]
    [(0, [0], 2, [5, 6, 7, 8], 1000013)]
    """
    group = sampling.num_generations
    stop = sampling.max_new_tokens if until is None else min(until, sampling.max_new_tokens)
    if resume is None:
        return [ChunkRequest(b, list(range(b * group, (b + 1) * group)), min(stop, sampling.budget(b)))
                for b in range(num_prompts)]
    requests = []
    for row in (~resume.finished).nonzero().flatten().tolist():
        b = row // group
        left = min(stop, sampling.budget(b)) - resume.steps
        if left > 0:
            seed = None if sampling.seed is None else int(sampling.seed) + row + resume.chunks * CHUNK_SEED_STRIDE
            requests.append(ChunkRequest(b, [row], left, resume.tokens[row].tolist(), seed))
    return requests


def chunk_options(request: ChunkRequest, sampling: SamplingParams, template, suppress: bool = True) -> dict:
    """The vllm.SamplingParams keywords of one request of a chunk (`sampling_options`, its budget
    this chunk's), with "copies" (greedy's one sample standing for G) and, continuing a completion,
    "continue_ids": its tokens so far, which the engine appends to the prompt (`continued_prompt`)."""
    options = sampling_options(sampling, template, request.prompt, suppress=suppress)
    options["max_tokens"] = request.max_tokens
    if request.tokens is None:
        options["copies"] = sampling.num_generations if sampling.greedy else 1
        return options
    options.update(n=1, copies=1, continue_ids=list(request.tokens))
    options.pop("seed", None)
    if request.seed is not None:
        options["seed"] = request.seed
    return options


def chunk_result(requests: list[ChunkRequest], replies: list[list[dict]], sampling: SamplingParams,
                 resume: PartialRollout | None, version: int, pad_id: int, eos_ids: list[int]) -> PartialRollout:
    """The rollout after this chunk: `replies[i]` holds request i's completions, {"ids", "logps"} of
    their new tokens each; the rows no request asked for (ended earlier) keep what they had. A row
    ends at an EOS or at its budget; the others have as many tokens as the decode steps done.

    >>> sampling = SamplingParams(num_generations=2, max_new_tokens=4)
    >>> requests = [ChunkRequest(0, [0, 1], 2)]
    >>> first = chunk_result(requests, [[{"ids": [5, 6], "logps": [-1.0, -1.0]}, {"ids": [2], "logps": [-0.5]}]],
    ...                      sampling, None, version=3, pad_id=0, eos_ids=[2])
    >>> first.tokens.tolist(), first.finished.tolist(), first.complete
    ([[5, 6], [2, 0]], [False, True], False)
    >>> last = chunk_result([ChunkRequest(0, [0], 2, [5, 6])], [[{"ids": [7, 8], "logps": [-2.0, -2.0]}]],
    ...                     sampling, first, version=4, pad_id=0, eos_ids=[2])
    >>> last.tokens.tolist(), last.token_versions[0].tolist(), last.finished.tolist(), last.complete, last.chunks
    ([[5, 6, 7, 8], [2, 0, 0, 0]], [3, 3, 4, 4], [True, True], True, 2)
    """
    rows = len(resume.finished) if resume is not None else sum(len(r.rows) for r in requests)
    done = 0 if resume is None else resume.steps
    new = {row: reply for request, got in zip(requests, replies, strict=True) for row, reply in zip(request.rows, got, strict=True)}
    steps = max([done, *(done + len(reply["ids"]) for reply in new.values())])
    tokens = torch.full((rows, steps), pad_id, dtype=torch.long)  # [N, S]
    logps = torch.zeros(rows, steps, dtype=torch.float32)  # [N, S]
    versions = torch.full((rows, steps), version, dtype=torch.long)  # [N, S]
    finished = torch.zeros(rows, dtype=torch.bool)  # [N]
    if resume is not None:
        tokens[:, :done], logps[:, :done], versions[:, :done] = resume.tokens, resume.logps, resume.token_versions
        finished |= resume.finished
    budgets = torch.tensor([sampling.budget(row // sampling.num_generations) for row in range(rows)])  # [N]
    for row, reply in new.items():
        end = done + len(reply["ids"])
        tokens[row, done:end] = torch.tensor(reply["ids"], dtype=torch.long)
        logps[row, done:end] = torch.tensor(reply["logps"], dtype=torch.float32)
        versions[row, done:] = version
        ended = any(token in eos_ids for token in reply["ids"]) or end >= int(budgets[row])
        finished[row] = ended
    complete = bool(finished.all()) or steps >= sampling.max_new_tokens
    return PartialRollout(tokens, logps, versions, finished, chunks=1 + (resume.chunks if resume is not None else 0),
                          complete=complete)


def rollout_of_partial(partial: PartialRollout, sampling: SamplingParams, template) -> Rollout:
    """The Rollout of a chunked decode that ran to the end: each completion up to its first EOS (or
    its budget), with every token's version where the tokens came from more than one chunk."""
    eos = torch.tensor(template.eos_token_ids)
    rows = []
    for row in range(len(partial.finished)):
        ids = partial.tokens[row]
        is_eos = torch.isin(ids, eos).nonzero().flatten()
        budget = min(sampling.budget(row // sampling.num_generations), partial.steps)
        length = min(int(is_eos[0]) + 1, budget) if len(is_eos) else budget
        rows.append({"ids": ids[:length].tolist(), "logps": partial.logps[row, :length].tolist()})
    return partial.tag(rollout_from_completions(rows, template, sampling.max_new_tokens, 0), version=0)
