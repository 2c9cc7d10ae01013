"""The chunked log-prob forward never holds [tokens, vocab] logits: peak memory, measured.

    .venv/bin/python -m pytest tests/test_memory.py -v
    .venv/bin/python tests/test_memory.py chunked|full MODEL_FOLDER   # one measurement, as JSON

A tiny Qwen2-VL with Qwen's real vocabulary (151,936) scores 4 completions of 256 tokens after
one image prompt, forward and backward, in a fresh process each way:

  chunked  Policy.completion_logprobs (shared prefix, LM head in chunks of 128 MB of logits)
  full     model(...).logits.log_softmax(-1), gathered at the completion tokens

The figure is how far the resident set grows above what it was before the forward (the model
loaded, VmHWM reset through /proc/self/clear_refs), so loading costs cancel out. Full logits
are [4, ~290, 151936] fp32 = 0.7 GB, and log_softmax and the backward hold several of those.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NUM_COMPLETIONS, COMPLETION_LENGTH, VOCAB = 4, 256, 151936


def memory_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(mode: str, model_path: str) -> dict:
    """Resident-set growth (MB) of one forward + backward over the completions."""
    import gc

    import PIL.Image
    import torch

    from mmgrpo.data.prompt_batches import PromptEncoder
    from mmgrpo.data.sample import normalize_row
    from mmgrpo.forward.policy import Policy
    from mmgrpo.models.loading import load_model, load_processor
    from mmgrpo.templates import get_template

    torch.set_num_threads(1)
    torch.manual_seed(0)
    template = get_template("qwen2-vl", load_processor(model_path))
    model = load_model(model_path).train()
    policy = Policy(model, template, shared_prefix=mode == "chunked")
    image = PIL.Image.new("RGB", (112, 112), (30, 90, 200))
    sample = normalize_row({"query": "<image>What colour is it?", "images": [image]}, dataset="memory")
    encoded = PromptEncoder(template, 4096)(sample.load_media())
    batch = policy.forward_batch([encoded], [NUM_COMPLETIONS])
    completion_ids = torch.randint(100, 1000, (NUM_COMPLETIONS, COMPLETION_LENGTH))  # [N, T]
    completion_mask = torch.ones_like(completion_ids)

    gc.collect()
    before = memory_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    if mode == "chunked":
        logps, _ = policy.completion_logprobs(batch, completion_ids, completion_mask, compute_entropy=True)
    else:
        inputs = template.forward_inputs(batch.prompts, completion_ids, completion_mask)
        logits = model(**inputs, use_cache=False).logits  # [N, P + T, V]
        prompt_len = batch.prompts["input_ids"].shape[1]
        log_probs = logits[:, prompt_len - 1 : -1].log_softmax(-1)  # [N, T, V]
        logps = log_probs.gather(-1, completion_ids[..., None]).squeeze(-1)  # [N, T]
    logps.sum().backward()
    return {"mode": mode, "growth_mb": memory_mb("VmHWM") - before, "logp_mean": float(logps.mean())}


def run_measurement(mode: str, model_path: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, __file__, mode, model_path], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak RSS")
def test_chunked_logprobs_stay_far_below_full_logits():
    from mmgrpo.models.tiny import build_tiny

    model_path = str(build_tiny("qwen2-vl", vocab_size=VOCAB))
    chunked = run_measurement("chunked", model_path)
    full = run_measurement("full", model_path)
    # the same log-probs (same weights, same tokens) both ways
    assert chunked["logp_mean"] == pytest.approx(full["logp_mean"], abs=1e-4)
    full_logits_mb = NUM_COMPLETIONS * COMPLETION_LENGTH * VOCAB * 4 / 2**20  # one [N, T, V] fp32 block: 593 MB
    assert full["growth_mb"] > 2 * full_logits_mb, full
    assert chunked["growth_mb"] < 0.25 * full["growth_mb"], (chunked, full)
    assert chunked["growth_mb"] < full_logits_mb, (chunked, full)


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2])))
