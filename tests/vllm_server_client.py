"""A one-process trainer's client of `mmgrpo rollout-server`, for tests/test_vllm_servers.py.

    python tests/vllm_server_client.py PORT die-mid-sync OUT_DIR        # SIGKILLs itself half-way through a sync
    python tests/vllm_server_client.py PORT sync-and-generate OUT_DIR   # a sync vLLM refuses, a whole one, a rollout

Weights go over the gloo weight group in buckets of 1 MB (the tiny model's sync is many buckets),
so "half-way" is between two buckets, with the server receiving.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import image_prompts  # noqa: E402


def dying(named_tensors, after: int):
    """The pairs as they are, until `after` of them went: then this process is killed."""
    for index, pair in enumerate(named_tensors):
        if index == after:
            os.kill(os.getpid(), signal.SIGKILL)
        yield pair


def main() -> None:
    from mmgrpo.models.loading import load_model, load_template
    from mmgrpo.rollout import SamplingParams
    from mmgrpo.rollout.vllm_client import RolloutServerError, VLLMServerRollout

    port, mode, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    path, _, template = load_template("tiny:qwen2-vl", None)
    model = load_model(str(path))
    engine = VLLMServerRollout([("127.0.0.1", port)], str(path), template, timeout=30, bucket_bytes=1 << 20)
    weights = ((name, parameter.detach()) for name, parameter in model.named_parameters())
    if mode == "die-mid-sync":
        engine.update_weights(dying(weights, after=len(list(model.parameters())) // 2), 0)
        raise AssertionError("still alive after the kill")
    bogus = [("model.layers.0.no_such_module.weight", torch.zeros(4))]  # a name vLLM's model does not have
    try:
        engine.update_weights(itertools.chain(weights, bogus), 0)
        refused = "no error"
    except RolloutServerError as error:
        refused = str(error)
    engine = VLLMServerRollout([("127.0.0.1", port)], str(path), template, timeout=30, bucket_bytes=1 << 20)
    engine.update_weights(((name, parameter.detach()) for name, parameter in model.named_parameters()), 0)
    rollout = engine.generate([enc for _, enc in image_prompts(template, 1)],
                              SamplingParams(num_generations=2, max_new_tokens=4, greedy=True))
    engine.close()
    (out / "client.json").write_text(json.dumps({"version": rollout.weight_version, "refused": refused,
                                                 "tokens": int(rollout.completion_mask.sum())}))


if __name__ == "__main__":
    main()
