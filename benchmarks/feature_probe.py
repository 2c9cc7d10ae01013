"""Is the answer in the image features? A linear probe on a model's visual tokens.

    python benchmarks/feature_probe.py --model tiny:qwen2-vl --dataset shapes-count
    python benchmarks/feature_probe.py --model mmgrpo/demo/start --dataset shapes-count

For each image of the dataset's train split (the first --train_rows) and test split (the first
--test_rows), the model's vision tower and merger turn the image into visual tokens, as the
language model receives them. A logistic regression (full-batch Adam, L2) is fitted on the train
features and scored on the test images, with two readouts: the mean of the visual tokens
(position-free) and all of them side by side. The label is the `solution` column (shapes-count:
the count; shapes-color: the majority answer). Chance is printed beside it. If the probe reads the
label well above chance but the trained model answers at chance, the information reached the
language model and it did not use it (docs/benchmarks.md, "Demo").
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from mmgrpo.data.catalog import resolve_dataset
from mmgrpo.models.loading import load_model, load_template
from mmgrpo.runstate.runlog import console, progress_bar


def label_of(solution) -> str:
    """The class of a row: the solution, or the majority of several answers."""
    if isinstance(solution, (list, tuple)):
        return str(Counter(map(str, solution)).most_common(1)[0][0])
    return str(solution)


@torch.no_grad()
def visual_tokens(model, template, view, rows: int) -> tuple[torch.Tensor, list[str]]:
    """[N, tokens, dim] visual tokens of the first `rows` images of `view`, and their labels."""
    features, labels = [], []
    count = min(rows, len(view))
    with progress_bar(count, f"features {view.name}:{view.split}") as bar:
        for index in range(count):
            sample = view[index]
            encoded = template.encode_prompt(sample.load_media())
            # the merged visual tokens of each image (transformers 5: the output's pooler_output)
            tokens = model.model.get_image_features(encoded.mm["pixel_values"], encoded.mm["image_grid_thw"]).pooler_output[0]
            features.append(tokens.float())
            labels.append(label_of(sample.columns["solution"]))
            bar.advance({"reward": float("nan"), "time/step": float("nan")})
    return torch.stack(features), labels


def probe(train_x, train_y, test_x, test_y, steps: int = 500, l2: float = 1e-3) -> tuple[float, float]:
    """Train and test accuracy of a logistic regression on standardised features.

    >>> _ = torch.manual_seed(0); x = torch.randn(200, 3); y = (x[:, 0] > 0).long()
    >>> train, test = probe(x[:100], y[:100], x[100:], y[100:])
    >>> test > 0.9
    True
    """
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    classes = int(max(train_y.max(), test_y.max())) + 1
    weight = torch.zeros(train_x.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=1e-2)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(train_x @ weight + bias, train_y) + l2 * weight.pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        train_acc = ((train_x @ weight + bias).argmax(1) == train_y).float().mean().item()
        test_acc = ((test_x @ weight + bias).argmax(1) == test_y).float().mean().item()
    return train_acc, test_acc


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default="tiny:qwen2-vl", help="A checkpoint folder or tiny:<family> (untrained).")
    p.add_argument("--model_type", default=None, help="The template (default: what the checkpoint recorded).")
    p.add_argument("--dataset", default="shapes-count", help="A registry name with a `solution` column.")
    p.add_argument("--train_rows", type=int, default=1500)
    p.add_argument("--test_rows", type=int, default=400)
    p.add_argument("--pixels", type=int, default=12544, help="min = max pixels of each image (12544: 112 x 112, as the demo).")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    path, processor, template = load_template(args.model, args.model_type, min_pixels=args.pixels, max_pixels=args.pixels)
    model = load_model(path, dtype=torch.float32, template=template).eval()
    train_x, train_labels = visual_tokens(model, template, resolve_dataset(f"{args.dataset}:train"), args.train_rows)
    test_x, test_labels = visual_tokens(model, template, resolve_dataset(f"{args.dataset}:test"), args.test_rows)
    names = sorted(set(train_labels) | set(test_labels))
    train_y = torch.tensor([names.index(v) for v in train_labels])
    test_y = torch.tensor([names.index(v) for v in test_labels])
    majority = Counter(test_labels).most_common(1)[0][1] / len(test_labels)
    console.print(f"{args.model} on {args.dataset}: {train_x.shape[1]} visual tokens of {train_x.shape[2]} per image, "
                  f"{len(names)} classes, majority class {majority:.3f} of the test rows")
    for readout, reduce in (("mean of the visual tokens", lambda x: x.mean(1)), ("all visual tokens", lambda x: x.flatten(1))):
        train_acc, test_acc = probe(reduce(train_x), train_y, reduce(test_x), test_y)
        console.print(f"  {readout:<26} probe accuracy: test {test_acc:.3f}  (train {train_acc:.3f})")


if __name__ == "__main__":
    main()
