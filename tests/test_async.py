"""Rollout engines with their own copy of the weights, weight sync after every step, and
asynchronous (one-step off-policy) rollouts, on the tiny Qwen2-VL in one process.

The in-process engines on a copy of the model stand in for vLLM here (tests/test_vllm*.py run the
same checks against real vLLM): what is checked is the training loop's side of the contract.
"""

import copy
import dataclasses
import json

import pytest

from mmgrpo.config import TrainConfig
from mmgrpo.engine import grpo_step, train
from mmgrpo.rollout import SharedPrefixRollout
from mmgrpo.rollout.base import sampling_params
from mmgrpo.rollout.pipeline import RolloutPipeline
from mmgrpo.rollout.weight_sync import rollout_weights
from mmgrpo.training.run import build_run

REWARD = '''
def digits(completions, **columns):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]
'''


def config(tmp_path, *extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    plugin = tmp_path / "digits.py"
    plugin.write_text(REWARD)
    return TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", f"{plugin}:digits",
        "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
        "--dataloader_num_workers", "0", "--learning_rate", "2e-2", "--beta", "0", "--max_steps", "3",
        "--report_to", "none", "--output_dir", str(tmp_path / "run"), *extra,
    ])


def metrics_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_async_rollouts_are_exactly_one_step_stale(tmp_path):
    out = train(config(tmp_path, "--async_generate", "--max_steps", "4"))
    metrics = metrics_of(out)
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1, 1]
    for m in metrics[1:]:  # completions of other weights: measured and corrected
        assert m["sampling/logp_diff_max"] > 0 and m["sampling/is_ratio_max"] > 0
        assert "time/old" in m  # log-probs recomputed by the policy
    assert all(m["time/weight_sync"] >= 0 for m in metrics)
    assert metrics[1]["rollout/generate_s"] > 0  # the next rollout, generated while this step trained


def _copy_engine(run):
    """The run's engine on its own copy of the model (as vLLM holds one)."""
    rollout_model = copy.deepcopy(run.model).eval().requires_grad_(False)
    return SharedPrefixRollout(rollout_model, run.template, separate_weights=True)


def test_a_copy_synced_every_step_equals_the_policy_engine(tmp_path):
    """--async_generate off on an engine with its own weights: the same completions and losses as
    the engine on the policy's module, the copy reloaded after every step (else stale)."""
    losses = {}
    for name in ("policy", "copy"):
        run = build_run(config(tmp_path / name))
        if name == "copy":
            run = dataclasses.replace(run, rollout=_copy_engine(run))
        pipeline = RolloutPipeline(run.rollout, lambda run=run: rollout_weights(run.model, None, run.strategy))
        batches = run.prompt_batches()
        losses[name] = []
        for step in (1, 2, 3):
            pipeline.sync_weights()
            pipeline.start(next(batches), sampling_params(run.cfg, seed=step))
            prompts, rollout = pipeline.result()
            assert rollout.weight_version == step - 1
            metrics, _ = grpo_step(run, prompts, step, rollout)
            pipeline.policy_updated(step)
            losses[name].append(metrics["loss"])
            if name == "copy":  # the copy's sampling log-probs are the policy's, to float rounding
                assert metrics["sampling/logp_diff_max"] < 1e-4
    assert losses["copy"] == pytest.approx(losses["policy"], abs=1e-5)


def test_a_skipped_sync_is_detected(tmp_path):
    """If the engine's copy is not reloaded after each step, its samples come from the starting
    weights: the version tag and the trainer/sampler log-prob gap both show it."""
    gaps, staleness = {}, {}
    for synced in (True, False):
        run = build_run(config(tmp_path / str(synced)))
        run = dataclasses.replace(run, rollout=_copy_engine(run))
        batches = run.prompt_batches()
        for step in (1, 2, 3):
            if synced:
                run.rollout.update_weights(rollout_weights(run.model, None, run.strategy), step - 1)
            prompts = next(batches)
            rollout = run.rollout.generate([enc for _, enc in prompts], sampling_params(run.cfg, seed=step))
            metrics, _ = grpo_step(run, prompts, step, rollout)
        gaps[synced], staleness[synced] = metrics["sampling/logp_diff_max"], metrics["rollout/staleness"]
    assert staleness == {True: 0, False: 2}
    assert gaps[True] < 1e-4 and gaps[False] > 1e-2, gaps


def test_the_pipeline_never_samples_stale_weights_by_accident(tmp_path):
    run = build_run(config(tmp_path))
    run = dataclasses.replace(run, rollout=_copy_engine(run))
    pipeline = RolloutPipeline(run.rollout, lambda: rollout_weights(run.model, None, run.strategy))
    pipeline.policy_updated(1)  # a step was taken, the engine was not reloaded
    with pytest.raises(RuntimeError, match="version 0.*policy's are 1.*sync_weights"):
        pipeline.start(next(run.prompt_batches()), sampling_params(run.cfg))
    pipeline.sync_weights()
    pipeline.start(next(run.prompt_batches()), sampling_params(run.cfg))
    assert pipeline.result()[1].weight_version == 1
