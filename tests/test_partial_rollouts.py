"""Partial rollouts (--partial_rollouts with --max_staleness K): a rollout generated in chunks, paused
at each weight update and continued on the new weights (mmgrpo/rollout/pipeline.py).

The key property: on weights that never change, the chunks give the uninterrupted rollout token for
token (the forced steps draw their uniforms as the first decode did), so a run with
--partial_rollouts --learning_rate 0 logs what the same run without it logs. With a real learning
rate a completion's later tokens come from newer weights, each tagged with its version.
"""

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_runs import REWARDS, metrics_of, tiny_config

from mmgrpo.config import TrainConfig
from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError
from mmgrpo.models import load_model, load_processor
from mmgrpo.rollout.base import SamplingParams
from mmgrpo.rollout.shared_prefix_engine import SharedPrefixRollout
from mmgrpo.templates import get_template

# ---- the engine: a rollout continued in chunks ------------------------------------------------------


def _prompts(template):
    """Two prompts: two images of other sizes, and a video."""
    rng = np.random.RandomState(0)

    def image(width, height):
        return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))

    frames = rng.randint(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    metadata = {"fps": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3], "duration": 2.0, "width": 56, "height": 56}
    samples = [
        LoadedSample(id="s/0", messages=[{"role": "user", "content": "Which is red, <image> or <image>?"}],
                     images=[image(140, 112), image(56, 56)]),
        LoadedSample(id="s/1", messages=[{"role": "user", "content": "What happens? <video>"}],
                     videos=[Video(frames=frames, metadata=metadata)]),
    ]
    return [template.encode_prompt(sample) for sample in samples]


@pytest.fixture(scope="module")
def model_and_template(tiny_qwen2_vl_path):
    model = load_model(tiny_qwen2_vl_path, dtype=torch.float32).eval()
    return model, get_template("qwen2-vl", load_processor(tiny_qwen2_vl_path))


def _engine(model, template, lean=True):
    # about one token in 9 of the tiny vocabulary ends a row, so rows end at different lengths; a
    # check every 2 steps lets prompts whose rows all ended leave the batch during the forced steps
    return SharedPrefixRollout(model, template, eos_token_ids=list(range(0, 1500, 9)), check_every=2, lean=lean,
                               separate_weights=True)


@pytest.fixture
def engine_and_prompts(model_and_template):
    model, template = model_and_template
    return _engine(model, template), _prompts(template)


@pytest.mark.parametrize("cuts, lean", [((5,), True), ((3, 9), True), ((3, 9), False)],
                         ids=["two_chunks", "three_chunks", "three_chunks_transformers_steps"])
def test_a_rollout_continued_in_chunks_equals_one_uninterrupted_generate(model_and_template, cuts, lean):
    model, template = model_and_template
    engine, prompts = _engine(model, template, lean), _prompts(template)
    assert (engine.lean is not None) == lean
    sampling = SamplingParams(num_generations=3, max_new_tokens=14, temperature=0.9, top_k=300, seed=11)
    engine.weight_version = 0
    whole = engine.generate(prompts, sampling)
    lengths = whole.lengths.tolist()
    assert len(set(lengths)) > 2 and min(lengths) < cuts[0] < max(lengths)  # rows end before, and after, the first cut

    partial = None
    for chunk, until in enumerate(cuts):
        engine.weight_version = chunk  # the weights are the same; only their tag moves
        partial = engine.continue_(prompts, sampling, partial, until=until)
        assert partial.steps == until and partial.chunks == chunk + 1 and not partial.complete
    engine.weight_version = len(cuts)
    rollout = engine.generate(prompts, sampling, resume=partial)
    assert torch.equal(rollout.completion_ids, whole.completion_ids)
    assert torch.equal(rollout.completion_mask, whole.completion_mask)
    assert torch.equal(rollout.truncated, whole.truncated)
    assert torch.equal(rollout.logps, whole.logps)  # exactly: the same operations on the same rows
    # each token carries the version of the chunk that drew it; a row's own is its oldest
    bounds = (0, *cuts, rollout.completion_ids.shape[1])
    for chunk, (start, end) in enumerate(zip(bounds, bounds[1:])):
        tagged = rollout.token_versions[:, start:end][rollout.completion_mask[:, start:end].bool()]
        assert (tagged == chunk).all()
    assert rollout.weight_version == 0 and rollout.versions().tolist() == [0] * len(rollout)
    spans = (rollout.token_versions * rollout.completion_mask).amax(1)
    assert spans.max() == len(cuts) and spans.min() == 0  # rows ended in the first chunk are not continued


def test_a_chunk_on_new_weights_keeps_the_earlier_tokens_and_samples_on_under_the_new_weights(model_and_template):
    """The weights move between two chunks: the first chunk's tokens and log-probs stay; each later
    token's log-prob is its log-prob under the new weights given the whole prefix (the forced
    tokens' K/V recomputed on them), as the training forward computes it."""
    from mmgrpo.forward.shared_prefix import shared_prefix_hidden
    from mmgrpo.grpo.logprobs import completion_logprobs

    model, template = model_and_template
    engine, prompts = _engine(copy.deepcopy(model), template), _prompts(template)
    sampling = SamplingParams(num_generations=3, max_new_tokens=14, temperature=0.9, seed=11)
    whole = engine.generate(prompts, sampling)
    partial = engine.continue_(prompts, sampling, until=5)
    moved = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # an optimizer step, as far as the engine can tell
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    engine.update_weights(moved.named_parameters(), version=1)
    rollout = engine.generate(prompts, sampling, resume=partial)
    assert torch.equal(rollout.completion_ids[:, :5], whole.completion_ids[:, :5])
    assert torch.equal(rollout.logps[:, :5], whole.logps[:, :5])
    assert not torch.equal(rollout.completion_ids, whole.completion_ids)  # sampled on under other weights
    ids, mask = rollout.completion_ids, rollout.completion_mask
    batch = template.collate(prompts)
    with torch.no_grad():
        expected = {}
        for name, weights in (("old", model), ("new", moved)):
            hidden = shared_prefix_hidden(weights, template, batch, ids, mask, 3)
            expected[name] = completion_logprobs(hidden, weights.lm_head.weight, ids, temperature=0.9)[0] * mask
    assert torch.allclose(rollout.logps[:, 5:], expected["new"][:, 5:], atol=1e-5)
    assert torch.allclose(rollout.logps[:, :5], expected["old"][:, :5], atol=1e-5)
    assert not torch.allclose(expected["old"][:, 5:], expected["new"][:, 5:], atol=1e-3)


def test_a_rollout_that_ended_in_its_first_chunk_is_not_continued(engine_and_prompts):
    engine, prompts = engine_and_prompts
    sampling = SamplingParams(num_generations=3, max_new_tokens=14, temperature=0.9, seed=11)
    engine.weight_version = 0
    partial = engine.continue_(prompts, sampling, until=14)
    assert partial.complete
    engine.weight_version = 1
    assert engine.continue_(prompts, sampling, partial, until=20) is partial  # nothing decoded again
    rollout = engine.generate(prompts, sampling, resume=partial)
    assert rollout.token_versions is None and rollout.weight_version == 0


def test_a_row_of_a_round_without_token_versions_gets_its_rows_version_in_concat():
    from mmgrpo.rollout.base import Rollout

    ids, mask = torch.tensor([[5, 6, 2]]), torch.ones(1, 3, dtype=torch.long)
    chunked = Rollout(ids, mask, torch.tensor([False]), weight_version=1, token_versions=torch.tensor([[1, 2, 2]]))
    round_ = Rollout(ids[:, :2], mask[:, :2], torch.tensor([True]), weight_version=3)  # an extra round, newest weights
    both = Rollout.concat([chunked, round_], pad_token_id=0)
    assert both.token_versions.tolist() == [[1, 2, 2], [3, 3, 0]] and both.versions().tolist() == [1, 3]


# ---- the run: `mmgrpo train --max_staleness 2 --partial_rollouts` -------------------------------------

VARYING = ("time/", "cpu/", "samples_per_s", "memory/", "rollout/generate_s", "partial/")


def config(tmp_path, *extra):
    return tiny_config(tmp_path, *extra, max_steps=4)


def strip(rows, keep_partial=False):
    """The rows without wall-clock figures (and without partial/*, which one of two runs compared lacks)."""
    varying = tuple(v for v in VARYING if not (keep_partial and v == "partial/"))
    return [{k: v for k, v in row.items() if not k.startswith(varying)} for row in rows]


def test_on_weights_that_do_not_move_partial_rollouts_are_the_same_run(tmp_path, monkeypatch):
    """--learning_rate 0 (refused on the command line, where a GRPO run must move; allowed here): every
    version holds the same weights, so the chunks continued on each give the whole rollouts of the run
    without --partial_rollouts, and the same losses and rewards, step for step; and the synchronous
    run's (K = 0): the same completions and rewards, the loss equal but for the importance weights'
    rounding (the sampler's log-probs against the training forward's, both of the same weights)."""
    from mmgrpo.config import checks
    from mmgrpo.config.domains import at_least

    monkeypatch.setattr(checks, "GRPO_LEARNING_RATE", at_least(0))
    runs = {}
    for name, extra in (("whole", ("--max_staleness", "2")), ("partial", ("--max_staleness", "2", "--partial_rollouts")),
                        ("sync", ())):
        runs[name] = metrics_of(train(config(tmp_path / name, "--learning_rate", "0", *extra)))
    assert strip(runs["partial"]) == strip(runs["whole"])
    for partial, sync in zip(runs["partial"], runs["sync"], strict=True):
        for key in ("reward", "reward_std", "completion_length"):  # the same completions
            assert partial[key] == sync[key], key
        for key in ("loss", "grad_norm", "entropy"):
            assert partial[key] == pytest.approx(sync[key], rel=1e-4, abs=1e-6), key
    assert [m["partial/continued_frac"] for m in runs["partial"]] == [0.0, 0.0, 1.0, 1.0]  # steps 3, 4: two chunks
    assert "partial/continued_frac" not in runs["whole"][0]


def test_with_a_learning_rate_completions_span_two_versions_and_stay_within_k(tmp_path):
    """K = 2, C = 4 of 8 tokens: from step 3 on a rollout's first 4 tokens come from version t - 3 and
    the rest from t - 2, so its tokens are fresher than the rollout's staleness (its oldest, 2)."""
    logged = metrics_of(train(config(tmp_path, "--max_staleness", "2", "--partial_rollouts")))
    assert [m["rollout/staleness"] for m in logged] == [0, 1, 2, 2]
    for m in logged[2:]:
        assert m["partial/continued_frac"] > 0.5 and m["staleness/share_2"] == 1.0
        assert 1 < m["partial/token_staleness_mean"] < 2  # tokens 2 and 1 steps stale, never more than K
        assert m["sampling/logp_diff_max"] > 0  # the sampler's per-token log-probs against the policy's
    assert all(m["partial/token_staleness_mean"] <= 2 for m in logged)


# ---- what cannot work: one line naming the flag ----------------------------------------------------------


@pytest.mark.parametrize("flags, match", [
    (("--max_staleness", "1"), "--partial_rollouts with --max_staleness 1 .*use --max_staleness 2 or more"),
    (("--async_generate",), "--partial_rollouts with --max_staleness 1 \\(or --async_generate\\)"),
    ((), "--partial_rollouts needs asynchronous training: add --max_staleness 2"),
])
def test_partial_rollouts_that_cannot_work_are_one_line(tmp_path, flags, match):
    from mmgrpo.training.startup_checks import check_train_flags

    with pytest.raises(ConfigError, match=match) as error:
        check_train_flags(config(tmp_path, "--partial_rollouts", *flags))
    assert "\n" not in str(error.value)


def test_partial_rollout_tokens_without_the_flag_is_one_line(tmp_path):
    from mmgrpo.training.startup_checks import check_train_flags

    with pytest.raises(ConfigError, match="--partial_rollout_tokens 3 needs --partial_rollouts"):
        check_train_flags(config(tmp_path, "--max_staleness", "2", "--partial_rollout_tokens", "3"))


def test_an_engine_that_cannot_pause_is_named(tmp_path):
    """Transformers' generate (HFRollout, where a model's prefix cannot be shared) generates a rollout
    in one call: the pipeline refuses it before the first step."""
    from types import SimpleNamespace

    from mmgrpo.rollout.hf import HFRollout
    from mmgrpo.rollout.pipeline import RolloutPipeline

    engine = HFRollout.__new__(HFRollout)  # no model needed: the refusal comes first
    engine.separate_weights = True
    setup = SimpleNamespace(options=config(tmp_path, "--max_staleness", "2", "--partial_rollouts").rollout,
                            sampler=SimpleNamespace(engine=engine))
    with pytest.raises(ConfigError, match="--partial_rollouts: the rollout engine HFRollout cannot pause") as error:
        RolloutPipeline(setup, batches=iter(()), policy_weights=list, total_steps=4)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("changes, partial, match", [
    ({"partial_rollouts": (True, False)}, False, "--partial_rollouts dropped: .*resume with --partial_rollouts"),
    ({"partial_rollouts": (False, True)}, True, "--partial_rollouts given: .*resume without --partial_rollouts"),
    ({"max_staleness": (3, 2)}, True, "--max_staleness 3 -> 2 with --partial_rollouts: .*resume with --max_staleness 3"),
])
def test_a_resume_that_changes_partial_rollouts_is_refused_naming_the_flag(changes, partial, match):
    from mmgrpo.training.resume_flags import check_changes

    with pytest.raises(ConfigError, match=match) as error:
        check_changes(changes, "out/checkpoint-2", step=2, in_flight=2, staleness=2, partial=partial)
    assert "\n" not in str(error.value)


# ---- killed with rollouts paused in flight, and resumed ------------------------------------------------


def _command_flags(tmp_path, out):
    plugin = tmp_path / "digits.py"
    plugin.write_text(REWARDS["digits"])
    return ["--model", "tiny:qwen2-vl", "--dataset", "shapes-color", "--reward_funcs", f"{plugin}:digits",
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "8",
            "--dataloader_num_workers", "0", "--learning_rate", "2e-2", "--beta", "0", "--max_steps", "6",
            "--save_steps", "2", "--max_staleness", "2", "--partial_rollouts", "--report_to", "none", "--output_dir", str(out)]


@pytest.mark.slow
def test_a_run_killed_with_rollouts_paused_in_flight_resumes_exactly(tmp_path):
    """SIGKILL after the first checkpoint (its rollouts in flight: step 3's finished, step 4's paused
    after its first chunk), then `--resume_from_checkpoint latest`: the resumed run continues the
    paused rollouts with their next chunks and logs what the uninterrupted run logs."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from mmgrpo.runstate.checkpoint import latest_checkpoint

    whole = metrics_of(train(TrainConfig.from_args(_command_flags(tmp_path, tmp_path / "whole"))))
    assert [m["partial/continued_frac"] > 0 for m in whole] == [False, False, True, True, True, True]

    out = tmp_path / "killed"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))

    def start(*extra):
        return subprocess.Popen([sys.executable, "-m", "mmgrpo", "train", *_command_flags(tmp_path, out), *extra], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    process = start()
    while latest_checkpoint(out) is None:
        assert process.poll() is None, process.stderr.read()[-3000:]
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)  # at once: the run is at step 3 at most, rollouts paused in flight
    process.wait()
    checkpoint = latest_checkpoint(out)
    saved = torch.load(checkpoint / "rollouts_in_flight_0.pt", weights_only=True)
    assert [("partial" in record, record["chunks"]) for record in saved] == [(False, 2), (True, 1)]
    assert saved[1]["partial"]["token_versions"].unique().tolist() == [int(checkpoint.name.split("-")[1]) - 1]

    _, stderr = (resumed := start("--resume_from_checkpoint", "latest")).communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert strip(metrics_of(out), keep_partial=True) == strip(whole, keep_partial=True)
