"""The entropy bonus in the chunked log-prob kernel: log-probs, entropy and their gradients against the
full-logits reference (fp32 and bf16 hidden states), and the backward's peak GPU memory with and without
the entropy's gradient (docs/algorithm.md, "Entropy bonus").

    python benchmarks/entropy_kernel.py          # cuda if there is one: V = 151,936, 512 rows
    python benchmarks/entropy_kernel.py cpu      # a small vocabulary on the CPU

The first line on a GPU includes its warm-up; compare the peaks, not that time.
"""
import sys
import time

import torch

from mmgrpo.grpo.logprobs import completion_logprobs, naive_completion_logprobs


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    V, H, B, T = (151936, 64, 8, 64) if device == "cuda" else (5000, 32, 2, 16)
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(B, T, H, generator=g) * 0.5).to(device)
    weight = (torch.randn(V, H, generator=g) * 0.05).to(device)
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    targets[-1, -5:] = -100
    up_l, up_e = torch.randn(B, T, generator=g).to(device), torch.randn(B, T, generator=g).to(device)

    def run(fn, dtype, use_entropy, **extra):
        h, w = hidden.to(dtype).clone().requires_grad_(), weight.to(dtype).clone().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        logps, ent = fn(h, w, targets, temperature=0.9, compute_entropy=True, **extra)
        loss = (logps * up_l).sum() + ((ent * up_e).sum() if use_entropy else 0.0)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
        return logps.detach(), ent.detach(), h.grad.float(), w.grad.float(), peak, time.perf_counter() - start

    for dtype in (torch.float32, torch.bfloat16):
        ref = run(naive_completion_logprobs, torch.float32 if dtype == torch.float32 else dtype, True)
        for use_entropy in (False, True):
            out = run(completion_logprobs, dtype, use_entropy, chunk_size=128)
            print(f"{device} {str(dtype):15} entropy grad {use_entropy!s:5}: peak {out[4]:8.1f} MiB, {out[5] * 1e3:7.1f} ms", end="")
            if use_entropy:
                gaps = [float((a.float() - b.float()).abs().max()) for a, b in zip(out[:4], ref[:4])]
                scale = [float(b.float().abs().max()) for b in ref[:4]]
                print(f"; max |chunked - full| logps {gaps[0]:.2e} entropy {gaps[1]:.2e} d hidden {gaps[2]:.2e} "
                      f"(of {scale[2]:.2e}) d weight {gaps[3]:.2e} (of {scale[3]:.2e}); full-logits peak {ref[4]:.1f} MiB")
            else:
                print()


if __name__ == "__main__":
    main()
