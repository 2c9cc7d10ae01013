"""Rollout tokens/s of the three engines on the same prompts: HF generate, mmgrpo's shared-prefix
sampler with lean decode steps, and vLLM colocated; alternating A B C per repeat, in one process.

    .venv-vllm/bin/python benchmarks/rollout_engines.py                       # both presets, tiny + ~100M
    .venv-vllm/bin/python benchmarks/rollout_engines.py --preset small --models tiny --repeats 5

Presets: image-heavy (448 x 448 images, G=8, 2 prompts) and small (64 x 64, G=4, 2 prompts); models:
the tiny Qwen2-VL (hidden 128, vocabulary 1.5K) and a ~100M-parameter one with Qwen's 151,936
vocabulary (hidden 320, head_dim 32). Completions have a fixed length (EOS never sampled in any
engine), so every engine writes the same number of tokens. Printed per engine: median tokens/s
(wall) and CPU seconds per rollout, and the ratios against HF generate. One torch thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

PRESETS = {
    "image-heavy": dict(image_size=448, num_generations=8, prompts=2),
    "small": dict(image_size=64, num_generations=4, prompts=2),
}
MODELS = {
    "tiny": {},
    "100m": dict(hidden_size=320, intermediate_size=1280, num_attention_heads=10, num_key_value_heads=2,
                 vocab_size=151936),
}


def engines(path: str, template, model, max_new_tokens: int) -> dict:
    from mmgrpo.rollout import HFRollout, SharedPrefixRollout
    from mmgrpo.rollout.vllm_colocate import VLLMColocateRollout

    no_eos = sorted({*template.suppress_token_ids, *template.eos_token_ids})  # fixed-length completions
    vllm_engine = VLLMColocateRollout(path, template, max_model_len=2048, kv_cache_memory_bytes=256 << 20)
    return {
        "hf": HFRollout(model, template, suppress_token_ids=no_eos),
        "lean": SharedPrefixRollout(model, template, suppress_token_ids=no_eos),
        "vllm": vllm_engine,
    }


def run(model_name: str, preset: str, repeats: int, max_new_tokens: int) -> dict:
    from mmgrpo.data.sample import LoadedSample
    from mmgrpo.models import load_model, load_processor
    from mmgrpo.models.tiny import build_tiny
    from mmgrpo.rollout import SamplingParams
    from mmgrpo.templates import get_template

    spec = PRESETS[preset]
    path = str(build_tiny("qwen2-vl", **MODELS[model_name]))
    model = load_model(path).eval()
    side = spec["image_size"]
    template = get_template("qwen2-vl", load_processor(path), max_pixels=side * side, min_pixels=min(side * side, 3136))
    pixels = np.random.RandomState(0).randint(0, 256, (side, side, 3), dtype=np.uint8)
    prompts = [template.encode_prompt(LoadedSample(id=f"bench/{i}", messages=[
        {"role": "user", "content": f"<image>How many red circles are there, number {i}?"}],
        images=[Image.fromarray(pixels)])) for i in range(spec["prompts"])]
    params = SamplingParams(num_generations=spec["num_generations"], max_new_tokens=max_new_tokens, seed=0)
    by_engine = engines(path, template, model, max_new_tokens)
    by_engine["vllm"].template = _NoEOS(template)  # vLLM: no stop ids either
    params_count = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"\n{model_name} ({params_count:.0f}M parameters), {preset}: {spec['prompts']} prompts of "
          f"{prompts[0].prompt_ids.numel()} tokens, G={spec['num_generations']}, {max_new_tokens} new tokens")
    results = {name: {"wall": [], "cpu": [], "tokens": 0} for name in by_engine}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, engine in by_engine.items():
            wall, cpu = time.perf_counter(), time.process_time()
            rollout = engine.generate(prompts, params)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if repeat:
                results[name]["wall"].append(wall)
                results[name]["cpu"].append(cpu)
                results[name]["tokens"] = int(rollout.completion_mask.sum())
    by_engine["vllm"].close()
    base = statistics.median(results["hf"]["wall"])
    for name, result in results.items():
        wall = statistics.median(result["wall"])
        print(f"  {name:<5} {result['tokens'] / wall:9.0f} tokens/s  {wall:7.3f} s/rollout  "
              f"cpu {statistics.median(result['cpu']):7.3f} s  x{base / wall:5.2f} vs hf")
    return results


class _NoEOS:
    """The template as vLLM's sampling sees it: EOS ids suppressed and never stopping (fixed length)."""

    def __init__(self, template):
        self._template = template
        self.eos_token_ids = []
        self.suppress_token_ids = sorted({*template.suppress_token_ids, *template.eos_token_ids})

    def __getattr__(self, name):
        return getattr(self._template, name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    for model_name in args.models:
        for preset in presets:
            run(model_name, preset, args.repeats, args.max_new_tokens)


if __name__ == "__main__":
    main()
