"""Rollout engines with their own copy of the weights, weight sync, and asynchronous training with
bounded staleness (--max_staleness K, --async_generate = K 1), on the tiny Qwen2-VL in one process.

The in-process engine on a copy of the model stands in for vLLM here (tests/test_vllm*.py run the
same checks against real vLLM): what is checked is the training loop's side of the contract. The
schedule is written out by hand in `scheduled_run` (step t trains a rollout sampled on the weights
of step max(0, t - 1 - K)), and `mmgrpo train`, with its background rollout thread, must give the
same losses.
"""

import copy
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_runs import metrics_of, tiny_config

from mmgrpo.engine import grpo_step, rollout_pipeline, train
from mmgrpo.errors import ConfigError
from mmgrpo.rollout import SharedPrefixRollout
from mmgrpo.rollout.base import RolloutEngine, RolloutSampler, sampling_params, step_seed
from mmgrpo.rollout.weight_sync import rollout_weights
from mmgrpo.rollout.worker import RolloutWorker, snapshot
from mmgrpo.runstate.checkpoint import MARKER
from mmgrpo.runstate.state import seed_everything
from mmgrpo.training.build import build_run


def config(tmp_path, *extra):
    return tiny_config(tmp_path, *extra)


def scheduled_run(cfg, max_staleness: int) -> list[dict]:
    """The schedule of mmgrpo/rollout/pipeline.py in one thread: once step t's rollout is taken,
    the engine gets the policy's weights (version t - 1) and generates the rollouts of steps up to
    t + K not generated yet; step t trains on its own, sampled K steps back at most."""
    run = build_run(cfg)
    seed_everything(cfg.seed)
    batches, ahead, out = run.prompt_batches(), {}, []

    def generate(step):
        prompts = next(batches)
        ahead[step] = prompts, run.rollout.generate([e for _, e in prompts], run.sampling(prompts, step_seed(cfg.seed, step, 0)))

    for step in range(1, run.total_steps + 1):
        torch.manual_seed(step_seed(cfg.seed, step, 0))
        if step not in ahead:
            run.rollout.update_weights(rollout_weights(run.model, None, run.strategy), step - 1)
            generate(step)
        prompts, rollout = ahead.pop(step)
        run.rollout.update_weights(rollout_weights(run.model, None, run.strategy), step - 1)
        for later in range(step + 1, min(step + max_staleness, run.total_steps) + 1):
            if later not in ahead:
                generate(later)
        metrics, _ = grpo_step(run, prompts, step, rollout)
        out.append(metrics)
    return out


@pytest.mark.parametrize("flags, max_staleness, staleness", [
    ((), 0, [0, 0, 0, 0]),  # async off: the rollout in step, on the weights being trained
    (("--async_generate",), 1, [0, 1, 1, 1]),  # one step off-policy (ms-swift's name) is K = 1
    (("--max_staleness", "2"), 2, [0, 1, 2, 2]),
])
def test_the_run_follows_the_schedule_and_never_trains_staler_than_k(tmp_path, flags, max_staleness, staleness):
    cfg = config(tmp_path, "--max_steps", "4", *flags)
    logged = metrics_of(train(cfg))
    assert [m["rollout/staleness"] for m in logged] == staleness
    expected = scheduled_run(cfg, max_staleness)
    assert [m["loss"] for m in logged] == pytest.approx([m["loss"] for m in expected], abs=1e-6)
    assert [m["reward"] for m in logged] == [m["reward"] for m in expected]
    if max_staleness:
        for m, k in zip(logged, staleness):  # the batch's staleness distribution: all rows k steps back here
            assert m[f"staleness/share_{k}"] == 1.0 and m["rollout/dropped_stale"] == 0
            assert sorted(key for key in m if key.startswith("staleness/share_")) == [
                f"staleness/share_{j}" for j in range(max_staleness + 1)]
        for m in logged[1:]:  # completions of older weights: measured and corrected
            assert m["sampling/logp_diff_max"] > 0 and "time/old" in m
        assert logged[1]["rollout/generate_s"] > 0  # generated in the background while step 1 trained
    if max_staleness == 2:  # the trainer/sampler gap of rows two steps back: the weights moved
        assert logged[3]["staleness/logp_diff_mean_2"] > 1e-3


def test_the_mismatch_is_masked_and_measured_per_modality(tmp_path):
    """IcePop's two-sided token band and off-policy sequence masking on stale rows: the masked shares are
    logged, and the gap per modality of the mixture's rows (shapes-color: image, shapes-motion: video)."""
    cfg = config(tmp_path, "--max_staleness", "2", "--max_steps", "4", "--dataset", "shapes-color", "shapes-motion",
                 "--vllm_importance_sampling_mode", "token_mask", "--vllm_importance_sampling_floor", "0.9",
                 "--vllm_importance_sampling_cap", "1.1", "--opsm_delta", "0")
    logged = metrics_of(train(cfg))
    stale = logged[2:]  # rows two steps back: the weights moved twice
    assert all(0 < m["sampling/masked_frac"] < 1 and m["sampling/kl"] > 0 for m in stale)
    assert any(m["sampling/opsm_masked_frac"] > 0 for m in stale)  # delta 0: a drifted negative-advantage row
    modalities = {key.split("/")[1] for m in stale for key in m if key.startswith("mismatch/")}
    assert modalities == {"image", "video"}
    for m in stale:
        for modality in {key.split("/")[1] for key in m if key.startswith("mismatch/")}:
            assert m[f"mismatch/{modality}/logp_diff_max"] >= m[f"mismatch/{modality}/logp_diff_mean"] > 0
            assert m[f"mismatch/{modality}/masked_frac"] >= 0 and m[f"mismatch/{modality}/kl"] > 0


@pytest.mark.parametrize("flags, match", [
    (("--vllm_importance_sampling_floor", "4"), "floor 4.0 is above --vllm_importance_sampling_cap 3.0"),
    (("--vllm_importance_sampling_mode", "icepop"), "choose one of token_truncate, token_mask, .*geometric_mask"),
    (("--opsm_delta", "-1"), "--opsm_delta -1.0"),
])
def test_a_mismatch_setting_that_cannot_work_is_one_line(tmp_path, flags, match):
    from mmgrpo.training.startup_checks import check_train_flags

    with pytest.raises(ConfigError, match=match):
        check_train_flags(config(tmp_path, *flags))


def test_max_staleness_must_be_at_least_one(tmp_path):
    for value in ("0", "-1"):
        with pytest.raises(ConfigError, match=f"--max_staleness {value}: give K >= 1"):
            train(config(tmp_path, "--max_staleness", value))


class SlowEngine(RolloutEngine):
    """The run's engine, each rollout taking `delay` seconds longer (a rollout server under load),
    recording which thread loads its weights."""

    separate_weights = True

    def __init__(self, inner, delay: float):
        self.inner, self.delay, self.loaded_in = inner, delay, []

    @property
    def weight_version(self):
        return self.inner.weight_version

    def generate(self, prompts, sampling):
        time.sleep(self.delay)
        return self.inner.generate(prompts, sampling)

    def update_weights(self, named_tensors, version):
        self.loaded_in.append(threading.current_thread().name)
        self.inner.update_weights(named_tensors, version)


def test_rollouts_behind_the_trainer_get_their_weights_from_a_copy(tmp_path):
    """With generation slower than training the worker is still busy when the next rollout is asked:
    the trainer hands it a copy of the weights, loaded between rollouts; the run is the schedule's."""
    cfg = config(tmp_path, "--max_staleness", "2", "--max_steps", "5")
    run = build_run(cfg)
    seed_everything(cfg.seed)
    engine = SlowEngine(run.rollout, delay=1.0)
    run = dataclasses.replace(run, rollout=engine)
    pipeline = rollout_pipeline(run, run.prompt_batches())
    losses = []
    try:
        for step in range(1, 6):
            torch.manual_seed(step_seed(cfg.seed, step, 0))
            batch = pipeline.next_batch(step)
            metrics, _ = grpo_step(run, batch.prompts, step, batch.rollout)
            pipeline.policy_updated(step)
            losses.append(metrics["loss"])
            assert metrics["rollout/staleness"] == min(step - 1, 2)
    finally:
        pipeline.close()
    assert "rollout-worker" in engine.loaded_in  # at least one version went through a copy
    expected = scheduled_run(cfg, 2)
    assert losses == pytest.approx([m["loss"] for m in expected], abs=1e-6)


def test_a_rollout_staler_than_k_is_dropped_and_generated_again(tmp_path):
    """Resumed with a smaller K, the rollouts a checkpoint saved in flight would be too stale: each is
    dropped (counted) and generated again on the newest weights. Resumed with the same K, the run
    continues exactly."""
    whole = metrics_of(train(config(tmp_path / "whole", "--max_staleness", "3", "--max_steps", "5", "--save_steps", "2")))
    assert [m["rollout/staleness"] for m in whole] == [0, 1, 2, 3, 3]
    checkpoint = tmp_path / "whole" / "run" / "checkpoint-2"
    state = json.loads((checkpoint / "training_state.json").read_text())
    assert state["rollout_in_flight"] == 3  # steps 3, 4, 5, sampled on versions 0, 0, 1

    for k, name in ((3, "same"), (1, "smaller")):
        out = tmp_path / "resumed" / name
        copy_checkpoint(checkpoint, out)
        # the same --reward_funcs file: another path is another reward, refused on resume (training/resume_flags.py)
        logged = metrics_of(train(config(tmp_path / "whole", "--max_staleness", str(k), "--max_steps", "5",
                                         "--save_steps", "2", "--output_dir", str(out),
                                         "--resume_from_checkpoint", "latest")))
        if k == 3:
            assert strip(logged) == strip(whole)
        else:
            assert [m["rollout/staleness"] for m in logged[2:]] == [0, 0, 0]  # regenerated on the newest weights
            assert [m["rollout/dropped_stale"] for m in logged[2:]] == [8, 8, 8]  # B x G completions each


def copy_checkpoint(checkpoint, out):
    import shutil

    out.mkdir(parents=True)
    shutil.copytree(checkpoint, out / checkpoint.name)
    for name in ("metrics.jsonl", "completions.jsonl"):  # the logs up to the checkpoint's step
        lines = (checkpoint.parent / name).read_text().splitlines(keepends=True)
        (out / name).write_text("".join(line for line in lines if json.loads(line)["step"] <= 2))


def strip(rows):
    varying = ("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s")
    return [{k: v for k, v in row.items() if not k.startswith(varying)} for row in rows]


def _copy_engine(run):
    """The run's engine on its own copy of the model (as vLLM holds one)."""
    rollout_model = copy.deepcopy(run.model).eval().requires_grad_(False)
    return SharedPrefixRollout(rollout_model, run.template, separate_weights=True)


def test_a_copy_synced_every_step_equals_the_policy_engine(tmp_path):
    """Async off on an engine with its own weights: the same completions and losses as the engine
    on the policy's module, the copy reloaded after every step (else stale)."""
    losses = {}
    for name in ("policy", "copy"):
        run = build_run(config(tmp_path / name))
        if name == "copy":
            run = dataclasses.replace(run, rollout=_copy_engine(run))
        pipeline = rollout_pipeline(run, run.prompt_batches())
        losses[name] = []
        for step in (1, 2, 3):
            batch = pipeline.next_batch(step)
            assert batch.rollout.weight_version == step - 1
            metrics, _ = grpo_step(run, batch.prompts, step, batch.rollout)
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
            rollout = run.rollout.generate([enc for _, enc in prompts], sampling_params(run.cfg.rollout, seed=step))
            metrics, _ = grpo_step(run, prompts, step, rollout)
        gaps[synced], staleness[synced] = metrics["sampling/logp_diff_max"], metrics["rollout/staleness"]
    assert staleness == {True: 0, False: 2}
    assert gaps[True] < 1e-4 and gaps[False] > 1e-2, gaps


def test_the_worker_loads_each_rollouts_weights_between_rollouts_and_never_guesses(tmp_path):
    """Requests run in order; one of another version loads the copy it carries first; one that
    carries none while the engine holds other weights is refused (a rollout is never stale by accident)."""
    run = build_run(config(tmp_path))
    engine = _copy_engine(run)
    prompts = [enc for _, enc in next(run.prompt_batches())]
    sampling = sampling_params(run.cfg.rollout, seed=1)
    worker = RolloutWorker(RolloutSampler(engine))
    try:
        start = worker.submit(prompts, sampling, version=0)
        with torch.no_grad():  # the policy moves on (as an optimizer step would), then a copy is taken
            for p in run.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        moved = snapshot(rollout_weights(run.model, None, run.strategy))
        after = [worker.submit(prompts, sampling, version=1, weights=moved), worker.submit(prompts, sampling, version=1)]
        assert start.result().weight_version == 0
        assert [r.result().weight_version for r in after] == [1, 1]
        assert torch.equal(after[0].result().completion_ids, after[1].result().completion_ids)  # same weights, seed
        assert not torch.equal(after[0].result().completion_ids, start.result().completion_ids)
        with pytest.raises(RuntimeError, match="version 2 came with no weights.*holds version 1"):
            worker.submit(prompts, sampling, version=2).result()
    finally:
        worker.close()


def test_a_checkpoint_of_the_earlier_one_rollout_layout_resumes_exactly(tmp_path):
    """Checkpoints written before K > 1 kept one rollout (rollout_in_flight.pt) and the stream's
    position before its prompts: they resume into the same run."""
    whole = metrics_of(train(config(tmp_path / "whole", "--async_generate", "--max_steps", "4", "--save_steps", "2")))
    out = tmp_path / "earlier"
    copy_checkpoint(tmp_path / "whole" / "run" / "checkpoint-2", out)
    checkpoint = out / "checkpoint-2"
    [record] = torch.load(checkpoint / "rollouts_in_flight_0.pt", weights_only=True)
    torch.save(record["rollout"], checkpoint / "rollout_in_flight.pt")
    (checkpoint / "rollouts_in_flight_0.pt").unlink()
    state = json.loads((checkpoint / "training_state.json").read_text())
    state["data"]["epoch"], state["data"]["batch"] = record["position"]
    state["rollout_in_flight"] = True
    (checkpoint / "training_state.json").write_text(json.dumps(state))
    manifest = json.loads((checkpoint / MARKER).read_text())  # the sizes the checkpoint is checked against
    manifest["files"] = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.is_file() and p.name != MARKER}
    manifest.pop("sha256", None)  # the earlier layout predates the checksums
    (checkpoint / MARKER).write_text(json.dumps(manifest))
    logged = metrics_of(train(config(tmp_path / "whole", "--async_generate", "--max_steps", "4", "--save_steps", "2",
                                     "--output_dir", str(out), "--resume_from_checkpoint", "latest")))
    assert strip(logged) == strip(whole)


@pytest.mark.slow
def test_the_async_benchmark_runs_and_reports_each_modes_staleness():
    """benchmarks/async_rollout.py --smoke: one short `mmgrpo train` per mode, and the table docs/benchmarks.md shows."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import async_rollout

    lines = async_rollout.main(["--smoke", "--partial"])
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [(row[0], row[8]) for row in rows] == [("sync", "0"), ("K=1", "1"), ("K=2", "2"), ("K=2 partial", "2")]  # mode, staleness
    assert all(float(row[1]) > 0 for row in rows)  # samples/s
    token_staleness = {row[0]: float(row[9]) for row in rows}
    assert token_staleness["sync"] == 0 and 0 < token_staleness["K=1"] <= 1
    assert 0 < token_staleness["K=2 partial"] < 2  # its later chunks' tokens are fresher than its first
