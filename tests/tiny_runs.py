"""The short `mmgrpo train` runs several test files start: the tiny Qwen2-VL on shapes-color, G = 4
over 2 prompts, 8 tokens, a plugin reward written next to the run, and its metrics read back.

    cfg = tiny_config(tmp_path, "--max_staleness", "2", learning_rate="5e-2", max_steps=4)
    rows = metrics_of(tmp_path / "run")
"""

from __future__ import annotations

import json
from pathlib import Path

from mmgrpo.config import TrainConfig

# Rewards that vary a little with the text (digits) or not at all (flat), as plugins `name:function`.
REWARDS = {
    "digits": "def digits(completions, **columns):\n"
              "    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]\n",
    "flat": "def flat(completions, **columns):\n    return [0.0 for _ in completions]\n",
}


def tiny_config(tmp_path: Path, *extra: str, reward: str = "digits", learning_rate: str = "2e-2",
                max_steps: int | None = 3) -> TrainConfig:
    """The run's config, its output in tmp_path / "run"; `extra` flags come last (they override)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    plugin = tmp_path / f"{reward}.py"
    plugin.write_text(REWARDS[reward])
    steps = [] if max_steps is None else ["--max_steps", str(max_steps)]
    return TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", f"{plugin}:{reward}",
        "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
        "--dataloader_num_workers", "0", "--learning_rate", learning_rate, "--beta", "0", *steps,
        "--report_to", "none", "--output_dir", str(tmp_path / "run"), *extra,
    ])


def metrics_of(out: Path) -> list[dict]:
    """metrics.jsonl of a run folder, a dict per step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
