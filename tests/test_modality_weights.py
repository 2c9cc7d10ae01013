"""`--modality_weights image=1.0 video=0.5`: each completion's advantage times its sample's modality weight.

- bad names and numbers are ConfigErrors at start-up;
- a weight of 0 takes a modality's rows out of the policy gradient (beta 0: their gradient is zero);
- in a GRPO step on an image + video mixture, image=0 zeroes the logged advantages of image prompts.
"""

import json

import pytest
import torch

from mmgrpo.config import TrainConfig
from mmgrpo.config.checks import parse_modality_weights
from mmgrpo.errors import ConfigError
from mmgrpo.grpo import LossConfig, policy_loss


def test_parse():
    assert parse_modality_weights(["image=1.0", "video=0.5", "audio=0"]) == {"image": 1.0, "video": 0.5, "audio": 0.0}
    assert parse_modality_weights({"text": 2}) == {"text": 2.0}  # as a YAML mapping
    cfg = TrainConfig.from_args(["--modality_weights", "image=1", "mixed=0.25"])
    cfg.validate()
    assert cfg.algo.modality_weights == ["image=1", "mixed=0.25"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [("picture=1", "one of text, image, video, audio, mixed"), ("image", "NAME=WEIGHT"), ("image=x", "finite number"),
     ("image=-1", ">= 0"), ("video=nan", "finite"), ("video=inf", "finite")],
)  # fmt: skip
def test_bad_weights_are_config_errors_at_start_up(spec, message):
    cfg = TrainConfig.from_args(["--modality_weights", spec])
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_a_zero_weight_zeroes_the_gradient_of_its_rows():
    torch.manual_seed(0)
    G, T = 2, 5
    modalities = ["image", "video", "image", "text"]  # one per prompt; rows 2p, 2p+1 are prompt p's
    rewards_adv = torch.tensor([1.0, -1.0, 0.7, -0.7, 1.0, -1.0, 0.5, -0.5])  # [N]
    weights = parse_modality_weights(["image=0", "video=0.5"])
    # the engine's scaling: row i is a completion of prompt i // G
    advantages = rewards_adv * torch.tensor([weights.get(modalities[i // G], 1.0) for i in range(len(rewards_adv))])
    logps = (torch.randn(len(advantages), T) - 1).requires_grad_()  # [N, T]
    mask = torch.ones(len(advantages), T)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        logps.grad = None
        loss, _ = policy_loss(logps, logps.detach(), None, advantages, mask, LossConfig(loss_type=loss_type, max_completion_length=T))
        loss.backward()
        image_rows = torch.tensor([modalities[i // G] == "image" for i in range(len(advantages))])
        assert torch.all(logps.grad[image_rows] == 0)
        assert torch.all(logps.grad[~image_rows].abs() > 0)


def test_a_grpo_step_scales_the_advantages_by_modality(tmp_path):
    from mmgrpo.cli import main

    out = tmp_path / "run"
    main(["train", "--model", "tiny:qwen2-vl", "--dataset", "shapes-color:1", "shapes-motion:1", "--modality_weights",
          "image=0", "--reward_funcs", "answer_format", "vqa_accuracy", "--max_steps", "1", "--num_generations", "2",
          "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--beta", "0", "--log_completions", "4",
          "--dataloader_num_workers", "0", "--logging_steps", "100", "--output_dir", str(out)])  # fmt: skip
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    image = [r for r in records if r["sample_id"].startswith("shapes-color/")]
    assert image and len(image) < len(records)  # both modalities in the step
    assert all(a == 0 for r in image for a in r["advantage"])
