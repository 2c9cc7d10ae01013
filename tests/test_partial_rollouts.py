"""Partial rollouts (--partial_rollouts with --max_staleness K): a rollout generated in chunks, paused
at each weight update and continued on the new weights (mmgrpo/rollout/pipeline.py).

The key property: on weights that never change, the chunks give the uninterrupted rollout token for
token (the forced steps draw their uniforms as the first decode did), so a run with
--partial_rollouts --learning_rate 0 logs what the same run without it logs. With a real learning
rate a completion's later tokens come from newer weights, each tagged with its version.
"""


import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.data.sample import LoadedSample, Video
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
