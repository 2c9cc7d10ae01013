"""Per-dataset completion budgets: a registry entry's `max_completion_length`.

In a mixture each prompt's completions stop at its own dataset's budget (the others at
--max_completion_length), in every in-process rollout engine, in multi-turn episodes and in the
training step; a budget that cannot work is a start-up error naming the dataset.
"""

import json

import pytest
import torch

from mmgrpo.config import TrainConfig
from mmgrpo.data.catalog import mix_datasets, read_registry_file
from mmgrpo.engine import train
from mmgrpo.errors import ConfigError
from mmgrpo.rollout.base import Rollout, SamplingParams, cut_to_budgets, sampling_params
from mmgrpo.training.build import build_run

REGISTRY = """\
datasets:
  - name: short-color
    synthetic: shapes-color
    synthetic_args: {{train_size: 40, test_size: 8}}
    reward_funcs: [answer_format]
    max_completion_length: {short}
  - name: long-count
    synthetic: shapes-count
    synthetic_args: {{train_size: 40, test_size: 8}}
    reward_funcs: [answer_format]
"""


def registry(tmp_path, short=3):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "budgets.yaml"
    path.write_text(REGISTRY.format(short=short))
    return path


def config(tmp_path, *extra, short=3, longest=10, shared_prefix=True):
    return TrainConfig.from_args([
        "--model", "tiny:qwen2-vl", "--dataset", "short-color", "long-count",
        "--dataset_registry", str(registry(tmp_path, short)),
        "--num_generations", "2", "--per_device_train_batch_size", "16",  # 8 prompts a step
        "--max_completion_length", str(longest), "--shared_prefix", str(shared_prefix).lower(),
        "--dataloader_num_workers", "0", "--beta", "0", "--max_steps", "1", "--report_to", "none",
        "--output_dir", str(tmp_path / "run"), *extra,
    ])  # fmt: skip


def test_registry_key_and_mixture_caps(tmp_path):
    entries = {e.name: e for e in read_registry_file(registry(tmp_path, short=7))}
    assert entries["short-color"].max_completion_length == 7
    assert entries["long-count"].max_completion_length is None
    mix = mix_datasets(["short-color", "long-count"], extra_files=[registry(tmp_path, short=7)])
    assert mix.completion_caps == {"short-color": 7}
    assert mix.sources[0].max_completion_length == 7


@pytest.mark.parametrize("value", ["0", "-4", "'64'", "true", "2.5"])
def test_bad_registry_value_names_file_entry_and_key(tmp_path, value):
    path = tmp_path / "broken.yaml"
    path.write_text(f"datasets:\n  - {{name: x, synthetic: shapes-color, max_completion_length: {value}}}\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml.*'x'.*'max_completion_length'.*positive"):
        read_registry_file(path)


def test_sampling_params_give_each_prompt_its_dataset_budget(tmp_path):
    cfg = config(tmp_path, short=3, longest=10)
    run = build_run(cfg)
    prompts = next(run.prompt_batches())
    sampling = run.sampling(prompts, seed=5)
    datasets = [sample.id.split("/")[0] for sample, _ in prompts]
    assert set(datasets) == {"short-color", "long-count"}  # the seed's batch holds both
    assert sampling.max_new_tokens == 10 and sampling.seed == 5
    assert sampling.max_new_tokens_per_prompt == [3 if d == "short-color" else 10 for d in datasets]
    # one dataset in the batch: one budget, no per-prompt list
    only_short = [p for p, d in zip(prompts, datasets) if d == "short-color"]
    one = sampling_params(cfg.rollout, None, [s for s, _ in only_short], {"short-color": 3})
    assert one.max_new_tokens == 3 and one.max_new_tokens_per_prompt is None


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["shared-prefix", "hf-generate"])
def test_engines_stop_each_prompt_at_its_budget(tmp_path, shared_prefix):
    """The random tiny model rarely ends early: rows run to their budget and count as truncated.
    The first tokens do not depend on the budget: a row's tokens equal the uncapped rollout's."""
    run = build_run(config(tmp_path, short=3, longest=10, shared_prefix=shared_prefix))
    prompts = next(run.prompt_batches())
    encoded = [enc for _, enc in prompts]
    capped = run.sampling(prompts, seed=11)
    assert capped.max_new_tokens_per_prompt is not None
    uncapped = SamplingParams(num_generations=2, max_new_tokens=10, seed=11)
    a = run.rollout.generate(encoded, capped)
    b = run.rollout.generate(encoded, uncapped)
    budgets = capped.row_budgets()
    lengths = a.completion_mask.sum(1)
    assert bool((lengths <= budgets).all())
    assert bool((lengths[budgets == 3] == 3).any())  # a short row reached its budget
    for row in range(len(budgets)):
        n = int(lengths[row])
        assert torch.equal(a.completion_ids[row, :n], b.completion_ids[row, :n]), row
        ended = bool(b.completion_mask[row].sum() <= budgets[row]) and not bool(b.truncated[row])
        assert bool(a.truncated[row]) == (not ended), row  # truncated: no EOS within its budget
    if a.logps is not None:  # the shared-prefix sampler's log-probs: the same, 0 after the end
        assert torch.allclose(a.logps, (b.logps[:, : a.logps.shape[1]] * a.completion_mask), atol=1e-6)


def test_cut_to_budgets_keeps_rows_that_ended_in_time():
    ids = torch.tensor([[4, 2, 0, 0], [4, 5, 6, 2], [4, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    rollout = Rollout(ids, mask, torch.tensor([False, False, True]), logps=torch.ones(3, 4) * mask)
    cut = cut_to_budgets(rollout, SamplingParams(1, 4, max_new_tokens_per_prompt=[2, 2, 4]), pad_token_id=0)
    assert cut.completion_ids.tolist() == [[4, 2, 0, 0], [4, 5, 0, 0], [4, 5, 6, 7]]
    assert cut.truncated.tolist() == [False, True, True]  # row 0 ended with EOS at 2; row 1 was cut
    assert cut.logps.sum(1).tolist() == [2.0, 2.0, 4.0]


PROBE = """
import json, os

def length_probe(completions, completion_ids, sample_id, **columns):
    with open(os.environ["LENGTH_PROBE"], "a") as f:
        for i, ids in zip(sample_id, completion_ids):
            f.write(json.dumps([i, len(ids)]) + "\\n")
    return [float(len(ids) % 2) for ids in completion_ids]
"""


def test_a_training_step_respects_the_budgets(tmp_path, monkeypatch):
    """The rewards see each completion's tokens: short-color's stop at 2, long-count's run to 12."""
    plugin, probe = tmp_path / "probe.py", tmp_path / "lengths.jsonl"
    plugin.write_text(PROBE)
    monkeypatch.setenv("LENGTH_PROBE", str(probe))
    out = train(config(tmp_path, "--reward_funcs", f"{plugin}:length_probe", "--max_steps", "2", short=2, longest=12))
    lengths = [json.loads(line) for line in probe.read_text().splitlines()]
    short = [n for i, n in lengths if i.startswith("short-color/")]
    long = [n for i, n in lengths if i.startswith("long-count/")]
    assert short and long, "the steps drew prompts of both datasets"
    assert max(short) <= 2 and max(long) <= 12 and max(long) > 2  # the random model rarely stops early
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["completion_length_max"] <= 12 for m in metrics)


def test_budget_above_the_run_longest_is_a_startup_error(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset 'short-color' \(.*budgets\.yaml\).*above --max_completion_length 10"):
        build_run(config(tmp_path, short=50, longest=10))


def test_budget_beyond_the_model_context_is_a_startup_error(tmp_path):
    # the tiny models' context is 4096 positions (max_position_embeddings)
    with pytest.raises(ConfigError, match=r"dataset 'short-color'.*max_completion_length 4096 exceeds the model's context of 4096"):
        build_run(config(tmp_path, short=4096, longest=5000))
    with pytest.raises(ConfigError, match=r"--max_completion_length 5000 leaves no room"):
        build_run(config(tmp_path / "flag", short=8, longest=5000))
