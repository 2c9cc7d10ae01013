"""Sequence parallelism against N: the memory and time of one log-prob forward and backward of a long
video row on each rank, for N = 1, 2, 4 ranks of one sequence group (Ulysses, `--sequence_parallel_size`).

    python benchmarks/sequence_parallel.py                      # about 6 minutes on 2 cores
    python benchmarks/sequence_parallel.py --ranks 1,2 --frames 64 --completion 128
    python benchmarks/sequence_parallel.py --smoke              # tiny model, N = 1, 2: seconds
    python benchmarks/sequence_parallel.py --shared_prefix --rows 8   # the prompt once for its 8 rows

Each N is one torchrun launch (gloo, one thread per rank) of this file in worker mode. Every rank loads
the model (fp32, its own full copy: the weights are the same on every rank, FSDP2 would shard them),
encodes the same prompt (one video of --frames frames at --size x --size, the family's processor) and
G = --rows completions of --completion random tokens, and runs what a training step runs per
micro-batch: the decoder's forward (N = 1: one process; N > 1: split with `ulysses`, the log-probs
summed over the group), the backward and the group's gradient sum. The vision tower and merger are
frozen and the embeddings too, so what grows with the row is the decoder's saved activations; each
rank's tower encodes its 1/N of the clip's frames (gathered for every rank). With --shared_prefix the
prompt runs once for its G rows (N = 1: `shared_prefix_hidden`; N > 1: `split_shared_prefix_logprobs`,
the prompt and then the completions split), as the training forwards run by default.

Measured on each rank after one warm-up step, the largest over the group is printed:
  live GB      the step's tensors at their peak beyond the weights and gradients, counted storage by
               storage (`TrackedMemory`, what `mmgrpo estimate` is checked against; a third step):
               the decoder's saved activations, the tower's transient encode, the log-prob blocks
  peak GB      the process's resident anonymous memory at its highest during the timed step
  RSS act GB   that peak less the memory before the step (the allocator's cache and fragmentation
               count here, not in live GB)
  tokens       one row's tokens on a rank (the whole row / N, padded to a multiple of N)
  step s       wall seconds of the step; cpu s, its CPU seconds (ranks share the cores: read cpu s)
  a2a s        seconds in the all-to-all exchanges (attention's heads for tokens, both directions),
               and their share of the step; "sums" are the all-reduces (log-probs, gradients)
The model is `random:qwen2.5-vl-3b` at 2 decoder layers and 2 vision blocks (Qwen2.5-VL-3B's widths:
hidden 2048, 16 query heads over 2 KV heads, MLP 11008; docs/models.md), unless --model says otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "random:qwen2.5-vl-3b?num_hidden_layers=2&vision_depth=2"


def anon_gb() -> float:
    """This process's resident anonymous memory (not file pages, which the kernel may drop)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 2**20
    return 0.0


class PeakSampler:
    """The highest `anon_gb` seen while it runs (sampled every 5 ms in a thread)."""

    def __init__(self):
        self.peak, self._stop = anon_gb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_gb())
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_gb())


class CollectiveTimer:
    """Seconds spent in torch.distributed's all_to_all_single and all_reduce while it is entered
    (the calls are looked up on the module at call time, so wrapping them there times them all)."""

    def __init__(self):
        self.seconds = {"all_to_all_single": 0.0, "all_reduce": 0.0}

    def __enter__(self):
        import torch.distributed as dist

        self._saved = {name: getattr(dist, name) for name in self.seconds}
        for name, call in self._saved.items():
            setattr(dist, name, self._timed(name, call))
        return self

    def _timed(self, name, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, call in self._saved.items():
            setattr(dist, name, call)


def release_freed_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the system, so the next peak is the step's
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


def worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from mmgrpo.data.sample import LoadedSample
    from mmgrpo.forward.sequence_parallel import (
        new_sequence_group,
        sequence_parallel_logprobs,
        split_shared_prefix_logprobs,
        sum_gradients,
        ulysses,
    )
    from mmgrpo.forward.shared_prefix import shared_prefix_hidden
    from mmgrpo.grpo.logprobs import completion_logprobs
    from mmgrpo.models import load_model
    from mmgrpo.models.loading import load_template
    from mmgrpo.parallel.tracked_memory import TrackedMemory
    from mmgrpo.processors.video import Video

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    pixels = args.size * args.size  # every frame at --size x --size: the clip's tokens are what the table says
    path, _, template = load_template(args.model, None, video_min_pixels=pixels, video_max_pixels=pixels)
    model = load_model(path, dtype=torch.float32, template=template)
    for part in ("vision", "aligner"):
        if template.components.get(part):
            model.get_submodule(template.components[part]).requires_grad_(False)
    model.get_input_embeddings().requires_grad_(False)  # tied to the head in the 3B: the decoder layers train
    backbone = model.get_submodule(template.components["backbone"])
    head = model.get_output_embeddings().weight

    frames = np.random.RandomState(0).randint(0, 256, (args.frames, args.size, args.size, 3), dtype=np.uint8)
    metadata = {"fps": 2.0, "total_num_frames": args.frames, "frames_indices": list(range(args.frames)),
                "duration": args.frames / 2.0, "width": args.size, "height": args.size}  # fmt: skip
    sample = LoadedSample(id="clip/0", messages=[{"role": "user", "content": "<video>What happens in this clip?"}],
                          videos=[Video(frames=frames, metadata=metadata)])  # fmt: skip
    batch = template.collate([template.encode_prompt(sample)])
    prompt_len = batch["input_ids"].shape[1]
    ids = torch.randint(0, 1000, (args.rows, args.completion), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    inputs = template.forward_inputs(template.repeat_rows(batch, args.rows), ids, mask, model=model)
    group = new_sequence_group(size) if size > 1 else None

    def step() -> int:
        if args.shared_prefix:  # the tokens a rank runs: its share of the prompt, then of each row's completion
            if group is None:
                logps, _ = completion_logprobs(shared_prefix_hidden(model, template, batch, ids, mask, args.rows), head, ids)
            else:
                logps, _ = split_shared_prefix_logprobs(model, template, group, batch, ids, mask, [args.rows], head)
            tokens = -(-prompt_len // size) + args.rows * -(-max(args.completion - 1, 1) // size)
        elif group is None:
            hidden = backbone(**inputs, use_cache=False).last_hidden_state[:, prompt_len - 1 : -1]
            logps, _ = completion_logprobs(hidden, head, ids)
            tokens = prompt_len + args.completion
        else:
            with ulysses(model, template, group) as split:
                local = backbone(**inputs, use_cache=False).last_hidden_state
                logps, _ = sequence_parallel_logprobs(local, head, split, prompt_len, ids)
            tokens = split.end - split.start
        (logps * mask).sum().backward()
        if group is not None:
            sum_gradients(model, group)
        model.zero_grad(set_to_none=False)  # the gradients stay allocated: "before" holds them
        return tokens

    step()  # warm-up: gradients allocated, kernels and the attention interface set up
    release_freed_memory()
    before = anon_gb()
    dist.barrier()
    with PeakSampler() as sampler, CollectiveTimer() as timer:
        start, cpu = time.perf_counter(), time.process_time()
        tokens = step()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tracked = TrackedMemory(model)  # a third step, counted tensor by tensor (slower: not the timed one)
    kept = tracked.current_bytes  # weights, buffers, gradients
    with tracked:
        step()
    live = tracked.peak_bytes - kept
    result = {"rank": dist.get_rank(), "ranks": size, "prompt_tokens": prompt_len, "row_tokens": prompt_len + args.completion,
              "tokens": tokens, "before_gb": before, "peak_gb": sampler.peak, "act_gb": sampler.peak - before,
              "live_gb": live / 2**30, "step_s": wall, "cpu_s": cpu, "a2a_s": timer.seconds["all_to_all_single"],
              "sums_s": timer.seconds["all_reduce"]}  # fmt: skip
    results = [None] * size
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The launches and the table
# ---------------------------------------------------------------------------------------------


def launch(ranks: int, args, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), __file__,
               "--worker", "--out", str(out), "--model", args.model, "--frames", str(args.frames), "--size", str(args.size),
               "--rows", str(args.rows), "--completion", str(args.completion),
               *(["--shared_prefix"] if args.shared_prefix else [])]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"N = {ranks} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


HEADER = ("| N | tokens per rank | live GB per rank | live vs first N | peak GB | RSS act GB | step s | cpu s "
          "| a2a s (share) | sums s |\n|---|---|---|---|---|---|---|---|---|---|")


def row(n: int, ranks: list[dict], base: float) -> str:
    """One N's line of the table: the largest figure over the group's ranks."""
    worst = max(ranks, key=lambda r: r["peak_gb"])
    live, act = max(r["live_gb"] for r in ranks), max(r["act_gb"] for r in ranks)
    step, cpu = max(r["step_s"] for r in ranks), max(r["cpu_s"] for r in ranks)
    a2a, sums = max(r["a2a_s"] for r in ranks), max(r["sums_s"] for r in ranks)
    return (f"| {n} | {worst['tokens']:,} | {live:.2f} | {live / base:.2f} (1/N = {1 / n:.2f}) | {worst['peak_gb']:.2f} "
            f"| {act:.2f} | {step:.1f} | {cpu:.1f} | {a2a:.2f} ({a2a / step:.0%}) | {sums:.2f} |")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4", help="comma-separated N (default 1,2,4)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--frames", type=int, default=24, help="video frames (default 24: 12 x 256 tokens at 448 px)")
    p.add_argument("--size", type=int, default=448, help="frame width and height in pixels (default 448)")
    p.add_argument("--rows", type=int, default=2, help="completions of the prompt, G (default 2)")
    p.add_argument("--completion", type=int, default=32, help="completion tokens (default 32)")
    p.add_argument("--shared_prefix", action="store_true", help="the prompt once for its rows (the group-shared prefix)")
    p.add_argument("--smoke", action="store_true", help="tiny:qwen2.5-vl, 4 frames of 56 px, N = 1, 2")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.frames, args.size, args.ranks, args.completion = "tiny:qwen2.5-vl", 4, 56, "1,2", 8
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker:
        return worker(args)
    print(f"model {args.model}, a video of {args.frames} frames at {args.size} x {args.size}, {args.rows} rows, "
          f"N = {args.ranks}, {'the prompt once for its rows (shared prefix)' if args.shared_prefix else 'each row whole'}, "
          f"{os.cpu_count()} cores", flush=True)
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.ranks.split(",")):  # each N's line as soon as it is measured
            start = time.perf_counter()
            ranks = launch(n, args, Path(tmp) / f"n{n}.json")
            if base is None:
                first = ranks[0]
                print(f"one row: {first['prompt_tokens']} prompt + {first['row_tokens'] - first['prompt_tokens']} "
                      f"completion tokens, x {args.rows} rows; tokens per rank: "
                      f"{'the group' if args.shared_prefix else 'one row'}\n{HEADER}", flush=True)
                base = max(max(r["live_gb"] for r in ranks), 1e-6)
            print(row(n, ranks, base) + f"   ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
