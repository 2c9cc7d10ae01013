"""Per-component learning rates and fusion modules on 2 real ranks (torchrun, gloo): FSDP2 with LoRA
(a group per component's adapters) and ZeRO-3 with full training, each with --vit_lr, --aligner_lr
and a gated cross-attention module. A 2-step run saving every step, then a run resumed from its
checkpoint-1: the resumed run ends with the same weights (the sharded optimizer's groups restored),
and each group's rate follows the schedule from its own peak."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_distributed import launch  # noqa: E402  (torchrun with 2 ranks, DeepSpeed's op cached)

REWARD = "def length(completions, **columns):\n    return [len(c) % 7 / 6 for c in completions]\n"
TRAIN_TYPE = {"fsdp2": ["--train_type", "lora", "--target_modules", "all-linear"], "zero3": ["--train_type", "full"]}
WEIGHTS = {"fsdp2": "adapter_model.safetensors", "zero3": "model.safetensors"}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("parallel", ["fsdp2", "zero3"])
def test_component_rates_and_fusion_modules_resume_exactly_on_two_ranks(parallel, tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    argv = ["-m", "mmgrpo", "train", "--parallel", parallel, "--model", "tiny:qwen2-vl", "--dataset", "shapes-color",
            "--reward_funcs", f"{tmp_path / 'reward.py'}:length", "--num_generations", "2", "--per_device_train_batch_size", "4",
            "--max_completion_length", "4", "--max_steps", "2", "--save_steps", "1", "--dataloader_num_workers", "0",
            "--learning_rate", "1e-3", "--vit_lr", "1e-4", "--aligner_lr", "3e-4", "--fusion_lr", "2e-3", "--lr_scheduler_type", "linear",
            "--fusion_module", "gated_xattn", "--fusion_layers", "1", "--report_to", "none", *TRAIN_TYPE[parallel]]
    whole = tmp_path / "whole"
    done = launch([*argv, "--output_dir", str(whole)], timeout=900)  # DeepSpeed's first start compiles its op
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoint-1", resumed / "checkpoint-1")
    done = launch([*argv, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"], timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    for name in (WEIGHTS[parallel], "fusion_modules.safetensors"):
        a, b = load_file(str(whole / "checkpoint-2" / name)), load_file(str(resumed / "checkpoint-2" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    first = load_file(str(whole / "checkpoint-1" / WEIGHTS[parallel]))
    last = load_file(str(whole / "checkpoint-2" / WEIGHTS[parallel]))
    for part in ("visual.blocks.", "visual.merger.", "layers."):  # every group trained (saved names: HF's legacy keys)
        assert any(not torch.equal(first[k], last[k]) for k in first if part in k), part
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    # linear decay over 2 steps: the peak, then half of it, in every group
    for key, peak in (("learning_rate", 1e-3), ("learning_rate/vit", 1e-4), ("learning_rate/aligner", 3e-4),
                      ("learning_rate/fusion", 2e-3)):
        assert [row[key] for row in rows] == pytest.approx([peak, peak / 2]), key
    resumed_rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert resumed_rows[-1]["learning_rate/vit"] == pytest.approx(0.5e-4)
