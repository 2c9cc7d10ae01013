"""Media preparation at real sizes: the share of a GRPO step that waits on decoding and processing
media, mmgrpo (with its DataLoader workers, and without) against TRL 1.16, in one invocation.

    python benchmarks/media_prep.py                 # 5 to 8 minutes on 2 busy cores
    python benchmarks/media_prep.py --smoke         # small media, one step per run: under a minute
    python benchmarks/media_prep.py --steps 4 --work_dir /tmp/media_prep

Results and how to read them: docs/benchmarks.md, "Media preparation at real sizes".

The data, written once into the work folder:
  images  4 images of 1280 x 720 per prompt (two PNG, two JPEG, noisy gradients with shapes, so the
          files are the size photos and screenshots are), a question about them and an answer;
  video   one 8-frame 448 x 448 clip per prompt (an MPEG-4 file written with PyAV, 4 fps), read with
          `--video_nframes 8`. mmgrpo only: TRL 1.16's GRPOTrainer takes images, not videos.
The processor is Qwen2.5-VL's with its published settings (min_pixels 3136, max_pixels 12,845,056,
patch 14, merge 2, temporal patch 2; the video processor the same budget): a 1280 x 720 image
becomes 1288 x 728 pixels, 4,784 patches (18 MB of float32 pixel values) and 1,196 tokens, so a
prompt carries 19,136 patches and about 4,800 tokens; a clip becomes 4,096 patches and 1,024 tokens.
mmgrpo's own bound (`--max_pixels`, by default 1280 x 28 x 28 for Qwen2.5-VL) leaves these sizes as
they are; `--max_pixels` / `--min_pixels` / `--video_nframes` given here go to mmgrpo as its flags.

The model: the tiny random Qwen2.5-VL (`tiny:qwen2.5-vl`, hidden 128, 2 + 2 layers) with that
processor. Media preparation does not depend on the model; the step does, and a short step makes
the share of it spent waiting on media LARGER, so the shares here are upper bounds for a real model.
At the 3B width a step over 4,800-token prompts takes minutes on this CPU and TRL's, which runs the
tower over 8 copies of every image, more memory than the shared machine allows (docs/benchmarks.md,
"Against TRL on the CPU"). G=8, one prompt per step, 16 completion tokens, fixed length, fp32, one
torch thread; everything else as benchmarks/vs_trl.py sets both systems (its `mmgrpo_flags` and
`run_trl`, reused here), except the DataLoader workers.

Measured per run after a warm-up step (each run in its own process; the workers, if any, its children):
  media on the critical path, s/step
        mmgrpo: `time/data`, the loop waiting for the step's prompts (metrics.jsonl). With 2 workers
        (the default) it is the wait for a batch prepared ahead of time; with 0 the training process
        decodes and processes the prompts itself (the in-process reference).
        TRL: its data loading (`get_batch_samples`, where `datasets` decodes the image files) plus
        every call of its processor inside the step, measured by wrapping both from outside.
  share of the step   that over seconds per step
  media prep per prompt, off the critical path   decoding + the processor + prompt encoding of one
        prompt as a worker does it (`_EncodedDataset[i]`), timed in the driver, one thread
  trainer peak memory   its peak RSS on the CPU; on a GPU the device's max allocated
  workers' peak memory   the largest sum of the workers' unique memory (USS: pages not shared with
        the trainer), sampled by the driver every second; the prefetch holds at most
        workers x prefetch_factor batches
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402  (its mmgrpo flags, TRL worker, reward wrapper, step clock, worker launcher)

QWEN2_5_VL_PIXELS = (3136, 12845056)  # Qwen2.5-VL's preprocessor_config.json: min_pixels, max_pixels
SETTINGS = {
    "full": dict(image_size=(1280, 720), images_per_prompt=4, frames=8, frame_size=448, num_generations=8,
                 max_completion_length=16, warmup=1, steps=3, rows=16, prep_prompts=4),
    "smoke": dict(image_size=(224, 126), images_per_prompt=2, frames=4, frame_size=112, num_generations=2,
                  max_completion_length=4, warmup=0, steps=1, rows=4, prep_prompts=1),
}  # fmt: skip
# (label, system, DataLoader workers, row set)
RUNS = (("mmgrpo, 2 workers", "mmgrpo", 2, "images"), ("mmgrpo, in-process", "mmgrpo", 0, "images"),
        ("TRL 1.16", "trl", 0, "images"),
        ("mmgrpo, 2 workers", "mmgrpo", 2, "video"), ("mmgrpo, in-process", "mmgrpo", 0, "video"))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Inputs: the model with Qwen2.5-VL's processor, the two row sets
# ---------------------------------------------------------------------------------------------


def prepare_model(work: Path, name: str = "tiny:qwen2.5-vl") -> Path:
    """The model `name` (a `tiny:` or `random:` Qwen2.5-VL, weights linked) with Qwen2.5-VL's published
    pixel budget for images and video."""
    from mmgrpo.models.tiny import resolve_model_path

    built = Path(resolve_model_path(name))
    model = work / f"model-{built.name}-qwen-pixels"
    if not (model / "config.json").exists():
        shutil.copytree(
            built,
            model,
            copy_function=lambda s, t: os.symlink(s, t) if s.endswith(".safetensors") else shutil.copy2(s, t),
        )
        processor_file = model / "processor_config.json"
        config = json.loads(processor_file.read_text())
        for part in ("image_processor", "video_processor"):
            config[part]["size"] = {
                "shortest_edge": QWEN2_5_VL_PIXELS[0],
                "longest_edge": QWEN2_5_VL_PIXELS[1],
            }
            for key in ("min_pixels", "max_pixels"):
                config[part].pop(key, None)
        processor_file.write_text(json.dumps(config, indent=2))
    return model


def photo_like(rng, width: int, height: int):
    """A PIL image whose file is as large as a photo's: a colour gradient, a few shapes, sensor-like noise."""
    import numpy as np
    import PIL.Image
    import PIL.ImageDraw

    x, y = np.meshgrid(np.linspace(0, 1, width), np.linspace(0, 1, height))
    base = np.stack(
        [x * rng.uniform(80, 255), y * rng.uniform(80, 255), (1 - x) * rng.uniform(80, 255)], axis=-1
    )
    image = PIL.Image.fromarray(base.astype(np.uint8))
    draw = PIL.ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.integers(0, width - width // 8), rng.integers(0, height - height // 8)
        size = int(rng.integers(width // 16, width // 6))
        draw.ellipse((x0, y0, x0 + size, y0 + size), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    noisy = np.asarray(image, dtype=np.int16) + rng.normal(0, 12, (height, width, 3)).astype(np.int16)
    return PIL.Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def prepare_images(work: Path, settings: dict) -> Path:
    """`rows` prompts of `images_per_prompt` images each (PNG and JPEG in turn), which one is brightest."""
    import numpy as np

    width, height = settings["image_size"]
    folder = work / f"images-{width}x{height}x{settings['images_per_prompt']}-{settings['rows']}"
    if not (folder / "train.jsonl").exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        with open(folder / "train.jsonl", "w") as out:
            for row in range(settings["rows"]):
                names = []
                for k in range(settings["images_per_prompt"]):
                    names.append(f"{row}_{k}.{'png' if k % 2 == 0 else 'jpg'}")
                    photo_like(rng, width, height).save(
                        folder / names[-1], **({} if k % 2 == 0 else {"quality": 90})
                    )
                text = (
                    "<image>" * len(names)
                    + f"Which of these {len(names)} pictures is the brightest? Answer with its number."
                )
                out.write(
                    json.dumps(
                        {
                            "messages": [{"role": "user", "content": text}],
                            "images": names,
                            "solution": str(int(rng.integers(1, len(names) + 1))),
                        }
                    )
                    + "\n"
                )
    return folder / "train.jsonl"


def prepare_videos(work: Path, settings: dict) -> Path:
    """`rows` prompts with one clip of `frames` frames of `frame_size` pixels square each (mp4), a disc moving right or left."""
    import numpy as np

    from mmgrpo.data.synthetic_av import write_mp4

    frames, side = settings["frames"], settings["frame_size"]
    folder = work / f"video-{frames}x{side}-{settings['rows']}"
    if not (folder / "train.jsonl").exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        with open(folder / "train.jsonl", "w") as out:
            for row in range(settings["rows"]):
                direction = "right" if rng.random() < 0.5 else "left"
                clip = []
                for t in range(frames):
                    image = np.asarray(photo_like(rng, side, side)).copy()
                    centre = side // 4 + (side // 2) * t // (frames - 1)
                    centre = centre if direction == "right" else side - centre
                    image[
                        side // 2 - side // 10 : side // 2 + side // 10,
                        max(centre - side // 10, 0) : centre + side // 10,
                    ] = 255
                    clip.append(image)
                write_mp4(folder / f"{row}.mp4", np.stack(clip), fps=4)
                out.write(
                    json.dumps(
                        {
                            "messages": [
                                {"role": "user", "content": "<video>Which way does the white square move?"}
                            ],
                            "videos": [f"{row}.mp4"],
                            "solution": direction,
                        }
                    )
                    + "\n"
                )
    return folder / "train.jsonl"


def media_flags(args, settings: dict) -> list[str]:
    """mmgrpo's media flags for this run (`--video_nframes` the clip's frame count unless given)."""
    flags = ["--video_nframes", str(args.video_nframes or settings["frames"])]
    for name in ("max_pixels", "min_pixels"):
        if getattr(args, name):
            flags += [f"--{name}", str(getattr(args, name))]
    return flags


def prep_cost(model: Path, data: Path, flags: list[str], prompts: int) -> dict:
    """Seconds and pixel-value MB per prompt of what a worker does for one prompt (decode, processor,
    encode), here in this process on one thread; the first prompt (lazy imports) is left out when there are more."""
    import torch

    from mmgrpo.config import TrainConfig
    from mmgrpo.data.catalog import mix_datasets
    from mmgrpo.data.prompt_batches import PromptEncoder, _EncodedDataset, media_options
    from mmgrpo.models.loading import load_template, template_options

    torch.set_num_threads(1)
    cfg = TrainConfig.from_args(
        ["--model", str(model), "--model_type", "qwen2.5-vl", "--dataset", str(data), *flags]
    )
    _, _, template = load_template(
        cfg.model.model, cfg.model.model_type, **template_options(cfg.model)
    )  # as `train` does
    dataset = mix_datasets([str(data)], split="train", seed=0)
    encoded = _EncodedDataset(dataset, PromptEncoder(template, 1 << 20), media_options(template, cfg.model))
    seconds, sizes, tokens = [], [], []
    for index in range(prompts + (prompts > 1)):
        start = time.perf_counter()
        _, prompt = encoded[index]
        seconds.append(time.perf_counter() - start)
        media = [v for k, v in prompt.mm.items() if k.startswith("pixel_values")]
        sizes.append(sum(t.numel() * t.element_size() for t in media) / 2**20)
        tokens.append(prompt.prompt_ids.shape[-1])
    seconds = seconds[1:] if prompts > 1 else seconds
    return {
        "s_per_prompt": statistics.mean(seconds),
        "pixel_mb": statistics.mean(sizes),
        "prompt_tokens": statistics.mean(tokens),
    }


# ---------------------------------------------------------------------------------------------
# Workers (each run in its own process: `vs_trl.run_worker(..., script=__file__)`)
# ---------------------------------------------------------------------------------------------


class WorkerMemory:
    """Samples, every `interval` s on a thread of the driver, the summed USS of the driver's
    grandchildren, the DataLoader workers of the run in progress: memory they hold that is not
    shared with the trainer they were forked from. Reading a process's USS walks its page tables
    (20 ms for a torch process); the driver does it, so the trainer's time does not include it."""

    def __init__(self, interval: float = 1.0):
        import psutil

        self.me, self.interval, self.peak_mb = psutil.Process(), interval, 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import psutil

        while not self.done.wait(self.interval):
            total = 0
            for process in self.me.children(recursive=True):
                try:
                    if process.ppid() != self.me.pid:  # not the run itself: one of its workers
                        total += process.memory_full_info().uss
                except psutil.Error:  # a worker that just ended
                    pass
            self.peak_mb = max(self.peak_mb, total / 2**20)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def count_processor_calls() -> list[int]:
    """Counts, in this process only, the calls of mmgrpo's image and video processing (the one place
    its templates call Qwen's processors): forked DataLoader workers count in their own copy."""
    from mmgrpo.templates import hooks

    calls = [0]
    for medium in (hooks.QwenImages, hooks.QwenVideos):

        def counted(self, items, _process=medium.process):
            calls[0] += 1
            return _process(self, items)

        medium.process = counted
    return calls


def run_mmgrpo(spec: dict) -> dict:
    """A plain `train()` run with `spec["workers"]` DataLoader workers; time/data per timed step beside vs_trl's figures."""
    import torch

    from mmgrpo.config import TrainConfig
    from mmgrpo.engine import train

    torch.set_num_threads(1)
    flags = vs_trl.mmgrpo_flags(spec, spec["warmup"] + spec["steps"])
    # a later flag wins over vs_trl's (0 workers, prompts up to 4096 tokens)
    flags += ["--dataloader_num_workers", str(spec["workers"]), "--max_prompt_length", "16384", *spec["media_flags"]]  # fmt: skip
    calls = count_processor_calls()
    out = train(TrainConfig.from_args(flags))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = vs_trl.mmgrpo_summary(rows, spec["warmup"])
    result["media_s"] = statistics.mean(r["time/data"] for r in rows[spec["warmup"] :])
    result["processor_calls"] = calls[0] / len(rows)  # in this (the trainer's) process
    return result


def run_trl(spec: dict) -> dict:
    """vs_trl's TRL run, with its processor's calls timed too: media = data loading + processor, per step."""

    def instrument(trainer, seconds):
        from transformers import TrainerCallback

        processor_class = type(trainer.processing_class)
        call = processor_class.__call__
        depth = [0]  # a processor call made inside another (apply_chat_template's) counts once

        def timed_call(self, *args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return call(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    seconds["processor"] = seconds.get("processor", 0.0) + time.perf_counter() - start
                    seconds["processor_calls"] = seconds.get("processor_calls", 0) + 1

        processor_class.__call__ = timed_call  # in this worker process only
        figures = {"media_steps": [], "processor_calls": []}

        class MediaClock(TrainerCallback):  # runs before vs_trl's clock clears `seconds`
            def on_step_end(self, args, state, control, **kwargs):
                figures["media_steps"].append(seconds.get("data", 0.0) + seconds.get("processor", 0.0))
                figures["processor_calls"].append(seconds.get("processor_calls", 0))

        trainer.add_callback(MediaClock())
        return figures

    result = vs_trl.run_trl(spec, instrument=instrument)
    result["media_s"] = statistics.mean(result.pop("media_steps")[spec["warmup"] :])
    result["processor_calls"] = statistics.mean(result["processor_calls"][spec["warmup"] :])
    return result


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def report(results: dict, prep: dict, settings: dict, spec: dict) -> None:
    width, height = settings["image_size"]
    names = {
        "images": f"{settings['images_per_prompt']} images of {width}x{height} per prompt",
        "video": f"one {settings['frames']}-frame {settings['frame_size']}-px clip per prompt",
    }
    for rows in ("images", "video"):
        runs = [(label, r) for (label, _, _, kind), r in results.items() if kind == rows]
        if not runs:
            continue
        print(
            f"\n{names[rows]}: {prep[rows]['prompt_tokens']:.0f} prompt tokens, {prep[rows]['pixel_mb']:.1f} MB of pixel "
            f"values; G={spec['num_generations']}, {spec['max_completion_length']} completion tokens"
        )
        print(f"{'':<38}" + "".join(f"{label:>20}" for label, _ in runs))
        lines = [("media on the critical path, s/step", lambda r: f"{r['media_s']:.3f}"),
                 ("s/step", lambda r: f"{r['s_per_step']:.3f}"),
                 ("share of the step", lambda r: f"{100 * r['media_s'] / r['s_per_step']:.1f}%"),
                 ("processor calls in the trainer, /step", lambda r: f"{r['processor_calls']:.0f}"),
                 ("trainer peak memory, MB", lambda r: f"{r['peak_rss_mb']:.0f}"),
                 ("workers' peak USS, MB", lambda r: f"{r['workers_peak_mb']:.0f}" if r["workers_peak_mb"] else "-")]  # fmt: skip
        for label, cell in lines:
            print(f"{label:<38}" + "".join(f"{cell(r):>20}" for _, r in runs))
        print(
            f"media prep per prompt off the critical path (decode + processor + encode, one thread): "
            f"{prep[rows]['s_per_prompt']:.3f} s"
        )
        by_label = dict(runs)
        workers, inline, trl = (by_label.get(k) for k in ("mmgrpo, 2 workers", "mmgrpo, in-process", "TRL 1.16"))
        if workers and inline:
            print(f"critical-path media s/step, 2 workers / in-process: {workers['media_s'] / inline['media_s']:.3f}")
        if workers and trl:
            print(f"critical-path media s/step, mmgrpo 2 workers / TRL: {workers['media_s'] / trl['media_s']:.4f}"
                  + (f"; in-process / TRL: {inline['media_s'] / trl['media_s']:.3f}" if inline else ""))
        if workers:
            share = 100 * workers["media_s"] / workers["s_per_step"]
            print(f"goal: under 5% of a step with workers: {'met' if share < 5 else 'NOT met'} ({share:.1f}%)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--smoke", action="store_true", help="small media, G=2, one step per run (a test of the script)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 3; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1; smoke 0)")
    parser.add_argument(
        "--max_pixels", type=int, default=None, help="mmgrpo's --max_pixels (default: its own bound)"
    )
    parser.add_argument("--min_pixels", type=int, default=None, help="mmgrpo's --min_pixels")
    parser.add_argument(
        "--video_nframes", type=int, default=None, help="mmgrpo's --video_nframes (default: the clip's 8)"
    )
    parser.add_argument("--work_dir", default=None, help="model, data and logs (default: a temporary folder)")
    parser.add_argument("--_worker", choices=vs_trl.SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._worker:
        spec = json.loads(Path(args._spec).read_text())
        result = (run_mmgrpo if args._worker == "mmgrpo" else run_trl)(spec)
        Path(args._result).write_text(json.dumps(result))
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = dict(SETTINGS["smoke" if args.smoke else "full"])
    settings.update({key: getattr(args, key) for key in ("warmup", "steps") if getattr(args, key) is not None})
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mmgrpo-media-prep-"))
    if not args.work_dir:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = RUNS[:4] if args.smoke else RUNS  # the smoke run leaves out the in-process clips (its time limit)
    results, prep, spec = measure(work, settings, media_flags(args, settings), runs)
    report(results, prep, settings, spec)
    print(
        f"\ntotal {time.perf_counter() - started:.0f} s; python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        "1 torch thread per run and per worker"
    )


def measure(work: Path, settings: dict, flags: list[str], runs=RUNS, model: str = "tiny:qwen2.5-vl",
            training: dict | None = None, deadline: float = float("inf")) -> tuple[dict, dict, dict]:
    """(results by run, prep cost by row set, the runs' spec): each of `runs` in its own process on
    `model` with Qwen2.5-VL's pixel budget, `training` the vs_trl.RUN_DEFAULTS it changes (device,
    bf16, ...: benchmarks/gpu_suite.py); a run that would end after `deadline` (perf_counter) is not started."""
    model = prepare_model(work, model)
    data = {rows: (prepare_images if rows == "images" else prepare_videos)(work, settings)
            for rows in dict.fromkeys(kind for *_, kind in runs)}  # fmt: skip
    prep = {rows: prep_cost(model, path, flags, settings["prep_prompts"]) for rows, path in data.items()}
    spec = {"model": str(model), "model_type": "qwen2.5-vl", "num_generations": settings["num_generations"],
            "prompts_per_step": 1, "max_completion_length": settings["max_completion_length"],
            "warmup": settings["warmup"], "steps": settings["steps"], "suppress_ids": vs_trl.suppressed_ids(model, "qwen2.5-vl"),
            "use_vllm": False, "count_flops": False, "media_flags": flags, **(training or {})}  # fmt: skip
    print(
        f"media prep at real sizes: G={spec['num_generations']}, 1 prompt/step, {spec['max_completion_length']} completion "
        f"tokens, {spec['warmup']} warm-up + {spec['steps']} timed steps per run; work dir {work}",
        flush=True,
    )
    results, expected = {}, 60.0
    for index, (label, system, workers, rows) in enumerate(runs):
        if time.perf_counter() + expected > deadline:
            print(f"  {rows:<6} {label:<20} not started: the time budget would be passed", flush=True)
            continue
        with WorkerMemory() as memory:
            result = vs_trl.run_worker(
                system, {**spec, "data": str(data[rows]), "workers": workers}, work, index, script=__file__
            )
        result["workers_peak_mb"] = memory.peak_mb
        results[(label, system, workers, rows)] = result
        expected = max(expected, result["run_s"])
        print(
            f"  {rows:<6} {label:<20} {result['s_per_step']:.3f} s/step, media {result['media_s']:.3f} s/step "
            f"({result['run_s']:.0f} s with start-up)",
            flush=True,
        )
    return results, prep, spec


if __name__ == "__main__":
    main()
