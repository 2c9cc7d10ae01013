"""The demo's SFT start: shipped in the package, checked before use, rebuilt by its stages on request.

    python -m mmgrpo.demo.shipped_start --seed 0 --output_dir runs/demo-start         # build it (about 30 min on 2 cores)
    python -m mmgrpo.demo.shipped_start --seed 0 --output_dir runs/demo-start --ship  # ... and replace the shipped one

Every machine starts the demo's GRPO stage from the same weights: mmgrpo/demo/start/ holds the
checkpoint (about 4 MB) and `manifest.json`, the sha256 of each of its files, how it was built and
its own accuracies. `mmgrpo demo` checks the files against the manifest before it loads them; a
missing or changed file stops it with one line naming the file and the command that rebuilds it.

The start is three SFT stages (mmgrpo/demo/configs/), each from the model the one before wrote:

1. `start_count.yaml`: counting alone from `tiny:qwen2-vl?vision_init_gain=3&rope_theta=10`
   until held-out counting (validation split) reads 0.30;
2. `start_boxes.yaml`: boxes on 40,000 images with counting mixed in, until the model localises;
3. `start_colour.yaml`: the three tasks together until held-out colour reads 0.40, which leaves
   GRPO room to show a lift.

Building takes far longer than the demo's GRPO stage (the boxes stage above all), which is why it
is shipped rather than run by every `mmgrpo demo`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

from mmgrpo.errors import CheckpointError
from mmgrpo.runstate.runlog import console

HERE = Path(__file__).resolve().parent
SHIPPED = HERE / "start"
MANIFEST = "manifest.json"
REGISTRY = HERE / "datasets.yaml"
STAGES = [HERE / "configs" / name for name in ("start_count.yaml", "start_boxes.yaml", "start_colour.yaml")]
STAGE_NAMES = ["count", "boxes", "colour"]
BUILD_MINUTES = 30  # 25 CPU minutes with one torch thread, 2,500 of them the boxes stage (docs/benchmarks.md, "Demo")
REBUILD = "mmgrpo demo --from_scratch"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checked_start(folder: Path | None = None) -> Path:
    """`folder` (default: the shipped start) if every file its manifest lists is there with the
    listed sha256, else one CheckpointError naming the first missing or changed file and the
    command that rebuilds it."""
    folder = Path(folder or SHIPPED)
    fix = (f"rebuild it with `{REBUILD}` (about {BUILD_MINUTES} minutes on 2 cores), "
           f"or restore it from git (`git checkout -- {folder}`)")
    manifest_path = folder / MANIFEST
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except FileNotFoundError:
        raise CheckpointError(f"the demo's start {manifest_path} is missing: {fix}") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"the demo's start {manifest_path} is corrupt (not a manifest): {fix}") from None
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"the demo's start {path} is missing: {fix}")
        if file_sha256(path) != expected:
            raise CheckpointError(f"the demo's start {path} is corrupt (its sha256 differs from {MANIFEST}): {fix}")
    return folder


def read_manifest(folder: Path | None = None) -> dict:
    return json.loads((Path(folder or SHIPPED) / MANIFEST).read_text())


def stage_argv(config: Path, output_dir: Path, seed: int, torch_threads: int, steps: int | None) -> list[str]:
    """The `mmgrpo sft` flags of one stage of the start."""
    return ["--config", str(config), "--dataset_registry", str(REGISTRY), "--output_dir", str(output_dir),
            "--seed", str(seed), "--torch_threads", str(torch_threads)] + (["--max_steps", str(steps)] if steps else [])


def build_start(output_dir: Path, *, seed: int, torch_threads: int = 1, steps: int | None = None,
                eval_limit: int | None = None) -> Path:
    """Run the start's SFT stages into output_dir/<stage>/; returns the last stage's model folder.
    steps / eval_limit shrink every stage (a smoke run)."""
    from mmgrpo.config import SFTConfig
    from mmgrpo.sft import sft

    output_dir = Path(output_dir)
    console.print(f"building the demo's start from scratch (seed {seed}): {len(STAGES)} SFT stages, "
                  f"about {BUILD_MINUTES} minutes on 2 cores")
    started, model = time.perf_counter(), None
    for number, (config, name) in enumerate(zip(STAGES, STAGE_NAMES), 1):
        console.rule(f"start, stage {number} of {len(STAGES)}: {config.name}")
        cfg = SFTConfig.from_args(stage_argv(config, output_dir / name, seed, torch_threads, steps))
        if model is not None:
            cfg.model.model = str(model)
        if eval_limit and cfg.eval.eval_dataset:
            cfg.eval.eval_limit = min(eval_limit, cfg.eval.eval_limit or eval_limit)
        model = sft(cfg)
    minutes = (time.perf_counter() - started) / 60
    console.print(f"the start took {minutes:.1f} minutes to build: {model}")
    return model


def ship(model: Path, destination: Path | None = None, **record) -> Path:
    """Copy a built start's files into `destination` (default: the shipped start's folder) with a
    manifest of their sha256 and `record`."""
    model, destination = Path(model), Path(destination or SHIPPED)
    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir(parents=True)
    files = {}
    for path in sorted(model.iterdir()):
        if path.is_file():
            shutil.copy2(path, destination / path.name)
            files[path.name] = file_sha256(path)
    (destination / MANIFEST).write_text(json.dumps({**record, "files": files}, indent=1) + "\n")
    return destination


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m mmgrpo.demo.shipped_start", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="Seed of every stage.")
    parser.add_argument("--output_dir", default="runs/demo-start", help="Where the stages write their folders.")
    parser.add_argument("--torch_threads", type=int, default=1, help="torch threads of every stage.")
    parser.add_argument("--ship", action="store_true", help=f"Replace the shipped start ({SHIPPED}) with the one built.")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = build_start(Path(args.output_dir), seed=args.seed, torch_threads=args.torch_threads)
    if args.ship:
        from mmgrpo.demo import TASKS, evaluate_all

        minutes = round((time.perf_counter() - started) / 60, 1)
        scores = evaluate_all(str(model), Path(args.output_dir) / "eval_test", None)
        record = {"built_by": f"python -m mmgrpo.demo.shipped_start --seed {args.seed} --ship", "seed": args.seed,
                  "build_minutes": minutes,
                  "test_accuracy": {name: {metric: round(scores[name]["metrics"][metric], 4)}
                                    for name, metric, _ in TASKS}}
        console.print(f"shipped: {ship(model, **record)}")
    return model


if __name__ == "__main__":
    main()
