"""Which answers can GRPO separate? A checkpoint's answer distribution, class by class.

    python benchmarks/answer_distribution.py --model mmgrpo/demo/start --dataset shapes-color
    python benchmarks/answer_distribution.py --model mmgrpo/demo/start --dataset shapes-count --limit 400

For each of the first --limit rows of the --split (test unless told), the model scores every candidate answer of the dataset
(each class, written as --answer_format) after the row's prompt, teacher-forced, and the scores
are normalised over the candidates. The table averages these distributions over the rows of each
true class: row = the class shown, column = the answer given. Two rows that are the same mean that
the model answers those classes alike, whatever the image shows. GRPO then gives such a cluster one
answer and does not split it: its groups reward the answer the image holds, but the policy gradient
of a shared answer distribution favours whichever answer is already more likely, and it collapses
onto it before the model learns to tell the two apart (docs/benchmarks.md, "Demo"). Rows that
differ a little are enough for GRPO to pull them apart. The closest pairs are printed with their
total variation distance.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from mmgrpo.data.catalog import resolve_dataset
from mmgrpo.forward.policy import Policy
from mmgrpo.models.loading import load_model, load_template
from mmgrpo.runstate.runlog import console, progress_bar
from mmgrpo.sft import encode_targets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from feature_probe import label_of  # noqa: E402  (a row's class: its solution, or the annotators' majority)


def closest_pairs(means: np.ndarray, classes: list[str], count: int = 3) -> list[tuple[str, str, float]]:
    """The `count` pairs of classes whose mean answer distributions are nearest (total variation).

    >>> closest_pairs(np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.1, 0.9]]), ["a", "b", "c"], 2)
    [('a', 'b', 0.0), ('a', 'c', 0.9)]
    """
    pairs = [(classes[i], classes[j], round(0.5 * float(np.abs(means[i] - means[j]).sum()), 4))
             for i, j in itertools.combinations(range(len(classes)), 2)]
    return sorted(pairs, key=lambda pair: pair[2])[:count]


@torch.no_grad()
def distributions(model_path: str, dataset: str, limit: int, answer_format: str, split: str = "test"):
    """[rows, classes] answer probabilities over the candidates, the true class of each row, the classes."""
    path, _, template = load_template(model_path, None)
    model = load_model(path, dtype=torch.float32, template=template).eval()
    policy = Policy(model, template)
    view = resolve_dataset(dataset, split)
    rows = min(limit, len(view))
    labels = [label_of(view[i].columns["solution"]) for i in range(rows)]
    classes = sorted(set(labels), key=lambda c: (len(c), c))
    ids, mask = encode_targets([answer_format.format(c) for c in classes], template.tokenizer, template.eos_token_ids[0])
    probabilities, true_total = [], 0.0
    with progress_bar(rows, f"answers {view.name}:{view.split}", shown="p(true)") as bar:
        for index in range(rows):
            started = time.perf_counter()
            encoded = template.encode_prompt(view[index].load_media())
            logps, _ = policy.completion_logprobs(policy.forward_batch([encoded], [len(classes)]), ids, mask)
            probabilities.append(torch.softmax((logps * mask).sum(-1), 0).numpy())
            true_total += probabilities[-1][classes.index(labels[index])]
            bar.advance({"p(true)": true_total / (index + 1), "time/step": time.perf_counter() - started})
    return np.array(probabilities), np.array([classes.index(label) for label in labels]), classes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder or tiny:<family>")
    parser.add_argument("--dataset", default="shapes-color", help="registry dataset")
    parser.add_argument("--split", default="test", help="the split whose rows are scored (validation: judge a start unseen by test)")
    parser.add_argument("--limit", type=int, default=200, help="rows of the split")
    parser.add_argument("--answer_format", default="<answer>{}</answer>", help="how a candidate answer is written")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    probabilities, truth, classes = distributions(args.model, args.dataset, args.limit, args.answer_format, args.split)
    means = np.array([probabilities[truth == k].mean(0) for k in range(len(classes))])
    table = Table(title=f"{args.model} on {args.dataset}:{args.split}: mean probability of each answer (columns) by true class (rows)")
    table.add_column("true class")
    for name in classes:
        table.add_column(name, justify="right")
    table.add_column("rows", justify="right")
    for k, name in enumerate(classes):
        table.add_row(name, *(f"{v:.2f}" for v in means[k]), str(int((truth == k).sum())))
    console.print(table)
    correct = probabilities[np.arange(len(truth)), truth]
    console.print(f"mean p(true answer) {correct.mean():.3f}; the most likely answer is right for "
                  f"{(probabilities.argmax(1) == truth).mean():.3f} of {len(truth)} rows")
    console.print("closest pairs (total variation of their mean rows; near 0: answered alike): " +
                  ", ".join(f"{a}/{b} {d:.3f}" for a, b, d in closest_pairs(means, classes)))


if __name__ == "__main__":
    main()
