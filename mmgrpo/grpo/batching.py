"""Micro-batches of the log-prob forwards: fixed row counts, or packed under a token budget.

The old, reference and update forwards of a step run over micro-batches of completion rows.
Each forward is padded: its prompts to the longest prompt in it, its completions to the longest
completion in it. With fixed micro-batches (`--per_device_train_batch_size` rows each) a
micro-batch that holds one long completion pads every other row to that length.

With `--max_tokens_per_microbatch` the rows are packed instead: prompts are sorted by their
longest completion, and whole prompt groups are added to a micro-batch while its padded size

    shared prefix:  prompts x longest prompt + rows x longest completion   (a prompt runs once)
    naive:          rows x (longest prompt + longest completion)

stays within the budget. A group is split (its rows sorted by length) only when it alone is
over the budget, and a single row over the budget gets a micro-batch of its own. The rows of a
prompt stay together and in order inside a micro-batch: the shared-prefix forward needs them
grouped by prompt (`num_generations` = the count of each prompt's rows).

    >>> # three prompts of 20 tokens, G = 2; prompt 1's completions are long
    >>> plan = pack_micro_batches([20, 20, 20], [5, 3, 40, 38, 6, 2], 2, max_tokens=100)
    >>> [mb.rows for mb in plan], [mb.width for mb in plan]
    ([[0, 1, 4, 5], [2, 3]], [6, 40])
    >>> round(pad_fraction(plan, [20, 20, 20], [5, 3, 40, 38, 6, 2]), 3)  # 10 of 164 tokens
    0.061

Every micro-batch keeps only `width` completion columns (its longest completion): the columns
beyond are padding in all of its rows, so dropping them changes no log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    """Completion rows of one forward, grouped by prompt, and the prompts they belong to."""

    rows: list[int]  # completion rows, the rows of each prompt contiguous and in prompt order
    prompts: list[int]  # the prompts of those rows, in order
    counts: list[int]  # rows of each prompt; sum = len(rows)
    width: int  # completion columns kept: the longest completion among the rows

    def __len__(self) -> int:
        return len(self.rows)



def _micro_batch(rows: list[int], num_generations: int, completion_lengths: list[int]) -> MicroBatch:
    prompts, counts = [], []
    for row in rows:
        prompt = row // num_generations
        if prompts and prompts[-1] == prompt:
            counts[-1] += 1
        else:
            prompts.append(prompt)
            counts.append(1)
    width = max(1, max(completion_lengths[r] for r in rows))
    return MicroBatch(list(rows), prompts, counts, width)


def fixed_micro_batches(completion_lengths: list[int], num_generations: int, size: int) -> list[MicroBatch]:
    """Consecutive runs of `size` rows (`--per_device_train_batch_size`), as without a budget.

    >>> [(mb.prompts, mb.counts) for mb in fixed_micro_batches([4] * 12, 4, 5)]
    [([0, 1], [4, 1]), ([1, 2], [3, 2]), ([2], [2])]
    """
    return [
        _micro_batch(list(range(start, min(start + size, len(completion_lengths)))), num_generations, completion_lengths)
        for start in range(0, len(completion_lengths), size)
    ]


def forward_tokens(prompt_lengths: list[int], completion_lengths: list[int], *, shared_prefix: bool = True) -> int:
    """Padded tokens of one forward over these prompts (one length each) and completion rows."""
    rows = len(completion_lengths)
    longest = max(completion_lengths)
    prompt_rows = len(prompt_lengths) if shared_prefix else rows
    return prompt_rows * max(prompt_lengths) + rows * longest


def pack_micro_batches(
    prompt_lengths: list[int],
    completion_lengths: list[int],
    num_generations: int,
    max_tokens: int,
    *,
    shared_prefix: bool = True,
) -> list[MicroBatch]:
    """Pack the rows of B prompts x G completions into micro-batches of at most `max_tokens`
    padded tokens each (see the module docstring); every row is in exactly one micro-batch.

    prompt_lengths: [B] tokens of each prompt (media placeholders included).
    completion_lengths: [B * G] tokens of each completion (EOS included); row r is prompt r // G's.
    """
    groups = {p: list(range(p * num_generations, (p + 1) * num_generations)) for p in range(len(prompt_lengths))}
    order = sorted(groups, key=lambda p: (max(completion_lengths[r] for r in groups[p]), p))

    def size(parts: list[tuple[int, list[int]]]) -> int:
        return forward_tokens(
            [prompt_lengths[p] for p, _ in parts],
            [completion_lengths[r] for _, rows in parts for r in rows],
            shared_prefix=shared_prefix,
        )

    packed: list[list[tuple[int, list[int]]]] = []
    current: list[tuple[int, list[int]]] = []
    for prompt in order:
        rows = groups[prompt]
        if size(current + [(prompt, rows)]) <= max_tokens:
            current.append((prompt, rows))
            continue
        if current:
            packed.append(current)
        if size([(prompt, rows)]) <= max_tokens:
            current = [(prompt, rows)]
            continue
        # The group alone is over the budget: split it, shortest rows first. The last piece may
        # share its micro-batch with the next groups; rows stay in row order within a piece.
        chunk: list[int] = []
        for row in sorted(rows, key=lambda r: (completion_lengths[r], r)):
            if chunk and size([(prompt, chunk + [row])]) > max_tokens:
                packed.append([(prompt, sorted(chunk))])
                chunk = []
            chunk.append(row)
        current = [(prompt, sorted(chunk))]
    if current:
        packed.append(current)
    return [
        _micro_batch([r for _, rows in parts for r in rows], num_generations, completion_lengths) for parts in packed
    ]


def pad_fraction(
    micro_batches: list[MicroBatch], prompt_lengths: list[int], completion_lengths: list[int], *, shared_prefix: bool = True
) -> float:
    """Padding tokens / all tokens of the forwards over these micro-batches."""
    padded = real = 0
    for mb in micro_batches:
        lengths = [prompt_lengths[p] for p in mb.prompts]
        prompt_rows = lengths if shared_prefix else [n for n, count in zip(lengths, mb.counts) for _ in range(count)]
        padded += len(prompt_rows) * max(lengths) + len(mb) * mb.width
        real += sum(prompt_rows) + sum(completion_lengths[r] for r in mb.rows)
    return (padded - real) / max(padded, 1)


def scatter_rows(parts: list[torch.Tensor], micro_batches: list[MicroBatch], shape: tuple[int, int]) -> torch.Tensor:
    """Per-micro-batch [n, width] results put back in row order: [N, T], zero elsewhere.

    >>> plan = fixed_micro_batches([1, 2, 2, 1], 2, 2)
    >>> scatter_rows([torch.ones(2, 2), torch.ones(2, 2) * 2], plan, (4, 3)).tolist()
    [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [2.0, 2.0, 0.0], [2.0, 2.0, 0.0]]
    """
    out = parts[0].new_zeros(shape)
    for part, mb in zip(parts, micro_batches):
        out[mb.rows, : mb.width] = part
    return out
