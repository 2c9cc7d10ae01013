"""A decode step's projections on the CPU: one GEMM against the same product in blocks of the weight's rows.

    python benchmarks/wide_linear.py                         # the heads and MLPs of Qwen2.5-VL-3B and -7B: ~2 min
    python benchmarks/wide_linear.py --shapes head-3b --rows 8

A rollout's decode step multiplies a few rows (the batch's completions, [rows, hidden]) by each weight.
Through a weight with many more outputs than inputs (the LM head: [151,936, 2048] in Qwen2.5-VL-3B, the
SwiGLU gate and up projections) one GEMM of 8 rows takes several times a one-row product on the CPU,
though both read the same weights once; `wide_linear` (mmgrpo/rollout/lean_decode.py) runs it in blocks
of about 8 MB of the weight's rows. Per shape and row count: the best of --repeats timed calls of each
(one thread, fp32), their ratio, and the largest difference between the two results (0: the same
numbers). The narrowing down projection is shown too: `wide_linear` leaves it to one GEMM.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

from mmgrpo.rollout.lean_decode import wide_linear

SHAPES = {  # name -> (outputs, inputs) of the weight
    "head-3b": (151936, 2048), "gate-3b": (11008, 2048), "down-3b": (2048, 11008),
    "head-7b": (152064, 3584), "gate-7b": (18944, 3584),
}  # fmt: skip


def best_ms(call, repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="1,8,16,64", help="rows per product, comma-separated (default 1,8,16,64)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls of each (default 7; the best is shown)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| weight | shape | rows | one GEMM, ms | in blocks, ms | speed-up | largest difference |\n|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        outputs, inputs = SHAPES[name]
        weight = torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(0)) * inputs**-0.5
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(1))
            plain = best_ms(partial(F.linear, x, weight), args.repeats)
            blocked = best_ms(partial(wide_linear, x, weight), args.repeats)
            difference = float((F.linear(x, weight) - wide_linear(x, weight)).abs().max())
            print(f"| {name} | {outputs:,} x {inputs:,} | {rows} | {plain:.1f} | {blocked:.1f} | {plain / blocked:.2f}x "
                  f"| {difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
