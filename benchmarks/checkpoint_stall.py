"""How long a checkpoint save stalls training: written in the foreground, or copied and written by a
background thread (mmgrpo/runstate/state.py, `background=True`).

    python benchmarks/checkpoint_stall.py                      # tiny and ~100M-parameter Qwen2-VL, ~3 minutes
    python benchmarks/checkpoint_stall.py --sizes tiny --repeats 5

For each model, the same few training steps (forward + backward + fused AdamW, fp32, one torch
thread) are timed three ways, alternating (none, foreground, background, none, ...):
  none        no save
  foreground  a full training checkpoint (weights, optimizer state, scheduler, RNGs, state JSON;
              fsynced, marked complete, renamed) saved after the first step, training waits for it
  background  the same checkpoint: weights and optimizer state are copied, then a thread writes
              them while the next steps run; the last step waits for the thread (as a run's end does)
The stall is a variant's wall time minus `none`'s: what the save costs the run. Also printed: how
long the save call blocks, the thread's write time, and CPU seconds (all threads).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmgrpo.models.loading import load_model, load_processor
from mmgrpo.models.tiny import build_tiny
from mmgrpo.runstate.state import TrainState
from mmgrpo.training.resume import CheckpointContents, save_training_checkpoint

SIZES = {  # build_tiny overrides
    "tiny": {},
    "100M": {"hidden_size": 320, "num_attention_heads": 10, "num_key_value_heads": 5, "vocab_size": 151936},
}


def train_step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(mode, model, processor, optimizer, ids, steps, folder: Path) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    call = write = 0.0
    pending = None
    for step in range(1, steps + 1):
        train_step(model, optimizer, ids)
        if step == 1 and mode != "none":
            start = time.perf_counter()
            state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            contents = CheckpointContents(model=model, processor=processor, state_dict=state_dict, optimizer=optimizer)
            pending = save_training_checkpoint(folder / "checkpoint-1", contents, TrainState(step=1),
                                               background=mode == "background")
            call = time.perf_counter() - start
    if pending is not None:
        pending.wait()
        write = pending.seconds
    result = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "call": call, "write": write}
    shutil.rmtree(folder / "checkpoint-1", ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of (none, foreground, background) (default 3)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per timing, the save after the first (default 4)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="mmgrpo-checkpoint-stall-"))
    try:
        for size in args.sizes:
            path = str(build_tiny("qwen2-vl", **SIZES[size]))
            model, processor = load_model(path).train(), load_processor(path)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            params = sum(p.numel() for p in model.parameters())
            ids = torch.randint(10, 1000, (2, 64))
            train_step(model, optimizer, ids)  # optimizer state exists from here on
            results: dict[str, list[dict]] = {"none": [], "foreground": [], "background": []}
            for _ in range(args.repeats):
                for mode in results:  # alternating: load on the shared machine hits all alike
                    results[mode].append(timed(mode, model, processor, optimizer, ids, args.steps, folder))
            base = statistics.median(r["wall"] for r in results["none"])
            print(f"\n{size}: {params / 1e6:.1f}M parameters, {args.steps} steps of 2 x 64 tokens, median of {args.repeats}")
            print(f"{'variant':<12}{'wall s':>9}{'stall s':>9}{'call s':>9}{'write s':>9}{'CPU s':>9}")
            for mode, runs in results.items():
                wall = statistics.median(r["wall"] for r in runs)
                line = [wall, wall - base, *(statistics.median(r[k] for r in runs) for k in ("call", "write", "cpu"))]
                print(f"{mode:<12}" + "".join(f"{v:>9.3f}" for v in line))
            stall_fg = statistics.median(r["wall"] for r in results["foreground"]) - base
            stall_bg = statistics.median(r["wall"] for r in results["background"]) - base
            print(f"background / foreground stall: {stall_bg / stall_fg:.2f}" if stall_fg > 0 else "")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
