"""Multi-turn rollouts with the zoom tool on the tiny Qwen2-VL: the trajectory's log-probs under
the training forward equal the sampler's (tool images inside), only the model's tokens are
trained, --max_turns ends every episode, and a short GRPO run uses the tool and trains.

The tiny random model never writes a tool call by itself: a module fixture warm-starts it with
a few SFT steps on conversations whose answer is a zoom call (mmgrpo sft, real checkpoint).
"""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mmgrpo.config import SFTConfig, TrainConfig
from mmgrpo.data.catalog import resolve_dataset
from mmgrpo.data.synthetic_zoom import _shapes_zoom, tool_call
from mmgrpo.engine import train
from mmgrpo.forward.policy import Policy
from mmgrpo.models import load_model, load_processor
from mmgrpo.rollout import MultiTurnRollout, SharedPrefixRollout, build_rollout_engine
from mmgrpo.rollout.base import SamplingParams
from mmgrpo.sft import sft
from mmgrpo.templates import get_template
from mmgrpo.templates.turns import ToolTurn, extend_prompt

ZOOM = "image_zoom_in_tool"
# the warm start is a 200-step SFT shared by the module's tests: one xdist worker runs them all
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multiturn")]
PIXELS = ["--min_pixels", "3136", "--max_pixels", "3136"]  # every image (and crop) as 56 x 56: 4 visual tokens


@pytest.fixture(scope="module")
def zoom_data(tmp_path_factory):
    """24 shapes-zoom rows (224 x 224 images) whose assistant turn is the zoom call on the named cell."""
    folder = tmp_path_factory.mktemp("zoom")
    rng = np.random.default_rng(0)
    with open(folder / "train.jsonl", "w") as rows:
        for index in range(24):
            image, row = _shapes_zoom(rng, 224)
            image.save(folder / f"{index}.png")
            row["images"] = [f"{index}.png"]
            row["messages"].append({"role": "assistant", "content": tool_call(row["zoom_box"])})
            rows.write(json.dumps(row) + "\n")
    return folder / "train.jsonl"


@pytest.fixture(scope="module")
def tool_caller(zoom_data, tmp_path_factory):
    """The tiny Qwen2-VL after 200 SFT steps on zoom calls: it now writes them."""
    out = tmp_path_factory.mktemp("sft")
    cfg = SFTConfig.from_args(["--model", "tiny:qwen2-vl", "--dataset", str(zoom_data), *PIXELS, "--max_steps", "200",
                               "--learning_rate", "5e-3", "--warmup_ratio", "0.1", "--per_device_train_batch_size", "8",
                               "--dataloader_num_workers", "0", "--output_dir", str(out), "--seed", "0"])  # fmt: skip
    return str(sft(cfg))


def prompts_of(template, data, count):
    view = resolve_dataset(str(data))
    return [template.encode_prompt(view[i].load_media()) for i in range(count)]


def test_trajectory_logprobs_under_the_training_forward_equal_the_samplers(tool_caller, zoom_data):
    model = load_model(tool_caller, dtype=torch.float32).eval()
    template = get_template("qwen2-vl", load_processor(tool_caller), min_pixels=3136, max_pixels=3136)
    policy = Policy(model, template)
    engine = build_rollout_engine(policy, max_turns=3, tools=[ZOOM], tool_timeout=30)
    assert isinstance(engine, MultiTurnRollout) and isinstance(engine.inner, SharedPrefixRollout)
    prompts = prompts_of(template, zoom_data, 4)
    group = 2
    with torch.no_grad():  # greedy: the log-probs are those of temperature 1, compared to 1e-5
        rollout = engine.generate(prompts, SamplingParams(num_generations=group, max_new_tokens=400, greedy=True))
    ids, mask, loss_mask = rollout.completion_ids, rollout.completion_mask, rollout.loss_mask  # [N, T]
    # the episodes did call the tool and got crops back: media inside the completion
    assert rollout.metrics["tools/calls_per_completion"] > 0.5, rollout.columns["trajectory"]
    with_crops = [row for row, media in enumerate(rollout.completion_media) if media]
    assert with_crops, rollout.columns["trajectory"]
    vision_start = template.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    for row in with_crops:
        tool_tokens = ids[row][(mask[row] == 1) & (loss_mask[row] == 0)]
        assert (tool_tokens == vision_start).sum() == rollout.completion_media[row]["image_grid_thw"].shape[0]
    assert ((loss_mask == 1) <= (mask == 1)).all() and (loss_mask < mask).any()
    # --max_turns ends every episode: at most 3 model turns, and a call in the third is not run
    assert max(rollout.columns["turns"]) <= 3
    assert all(calls <= 2 for calls in rollout.columns["tool_calls"])

    with torch.no_grad():
        batch = policy.forward_batch(prompts, [group] * len(prompts), rollout.completion_media)
        assert not batch.shared  # rows with crops after the prompt run prompt + trajectory each
        logps, _ = policy.completion_logprobs(batch, ids, mask)
    # 1. The trajectory forward sees what the sampler saw: for an episode with a crop, its last
    # turn's log-probs equal those of a forward over that turn's own prompt (the prompt, turn 1,
    # the tool turn with the crop: encoded by the template as the sampler got it), to 1e-5.
    for row in with_crops[:2]:
        own = loss_mask[row].nonzero().flatten().tolist()
        last = [t for t in own if t > own[0] and loss_mask[row, t - 1] == 0][0]  # first token of the last model turn
        first_turn_end = next(t for t in range(len(own)) if own[t] != t)  # turn 1 is columns 0 .. first_turn_end - 1
        tool = ToolTurn(ids[row, first_turn_end:last], rollout.completion_media[row], "")
        turn_prompt = extend_prompt(template, prompts[row // group], ids[row, :first_turn_end], tool)
        end = int(mask[row].sum())
        with torch.no_grad():
            alone, _ = policy.completion_logprobs(policy.forward_batch([turn_prompt], [1]), ids[row : row + 1, last:end],
                                                  mask[row : row + 1, last:end])  # fmt: skip
        assert (logps[row, last:end] - alone[0]).abs().max() < 1e-5
    # 2. ... and the sampler's log-probs of every model token. Its turn-2 batch pads prompts of
    # different lengths (a crop, an error message) on the left, which moves fp32 sums by up to
    # ~4e-5 here (the same turn sampled alone: 1e-5), hence 1e-4.
    difference = (logps - rollout.logps).abs()[loss_mask.bool()]
    assert difference.max() < 1e-4, difference.max()


@pytest.mark.parametrize("resampling", [[], ["--dynamic_sample", "--max_resample_times", "1", "--first_stage_generations", "2"]],
                         ids=["plain", "resampled"])
def test_a_short_multi_turn_run_uses_the_zoom_tool_and_changes_the_weights(tool_caller, zoom_data, tmp_path, resampling):
    plugin = tmp_path / "length.py"
    plugin.write_text("def length(completions, **columns):\n"
                      "    return [len(c) / 100 + t for c, t in zip(completions, columns['tool_calls'])]\n")  # fmt: skip
    out = train(TrainConfig.from_args([
        "--model", tool_caller, "--model_type", "qwen2-vl", "--dataset", str(zoom_data), *PIXELS,
        "--max_turns", "3", "--tools", ZOOM, "--reward_funcs", f"{plugin}:length", "--num_generations", "4",
        "--per_device_train_batch_size", "16", "--max_completion_length", "400", "--max_steps", "1",
        "--temperature", "1.5",  # the warm start is near-deterministic: hotter sampling so that groups differ
        "--learning_rate", "1e-3", "--beta", "0", "--dataloader_num_workers", "0", "--output_dir", str(tmp_path / "run"),
        *resampling,
    ]))  # fmt: skip
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    if resampling:  # the extra rounds are episodes too, and the batch keeps them whole
        assert metrics["dynamic/rounds"] >= 1 and "two_stage/prompts" in metrics
    assert metrics["tools/calls_per_completion"] > 0.5 and metrics["tools/turns"] > 1.5, metrics
    for key in ("tools/errors", "tools/max_turns_reached", "tools/model_tokens", "tools/tool_tokens"):
        assert key in metrics
    # the log keeps whole episodes: the tool's replies sit inside the recorded trajectories (a row sampled
    # at temperature 1.5 may garble its call, so look across the step's rows)
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    trajectories = [t for record in records for t in record["trajectories"]]
    assert sum("<tool_response>" in t for t in trajectories) >= len(trajectories) / 4
    before, after = load_file(f"{tool_caller}/model.safetensors"), load_file(str(out / "checkpoint-1" / "model.safetensors"))
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed and any("visual" in name for name in changed)  # the crops went through the vision tower
