"""Synthetic datasets: sizes, splits, answers that match the pictures, byte-identical regeneration."""

import json
import multiprocessing

import numpy as np
import PIL.Image
import pytest

from mmgrpo.data.registry import resolve_dataset
from mmgrpo.data.synthetic import COLOURS, GENERATORS, synthetic_dataset_dir


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def folder_bytes(folder):
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        root = tmp_path_factory.mktemp("mmgrpo-cache")
        patch.setenv("MMGRPO_CACHE", str(root))
        yield root


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_builtin_synthetic_datasets_have_their_splits(cache, name):
    train, test = resolve_dataset(name), resolve_dataset(f"{name}:test")
    assert (len(train), len(test)) == (2000, 400)
    assert synthetic_dataset_dir(name).parent == cache / "datasets"
    sample = test[0]
    assert sample.id == f"{name}/test/0" and sample.modality == "image"
    assert sample.messages[0] == {"role": "system", "content": "Answer inside <answer></answer>."}
    assert sample.messages[-1]["role"] == "user" and sample.messages[-1]["content"].startswith("<image>")
    assert sample.load_media().images[0].size == (64, 64)
    assert train.reward_funcs


def test_answers_match_the_pictures(cache):
    folder = synthetic_dataset_dir("shapes-color")
    for row in read_jsonl(folder / "test.jsonl")[:50]:
        answers = row["solution"]
        assert len(answers) == 10 and answers.count(row["colour"]) >= 7
        assert row["messages"][-1]["content"] == f"<answer>{row['colour']}</answer>"
        pixels = np.asarray(PIL.Image.open(folder / row["images"][0])).reshape(-1, 3).astype(int)
        palette = np.array(list(COLOURS.values()))  # [colours, 3]
        distance = np.abs(pixels[:, None, :] - palette[None]).sum(-1)  # [pixels, colours]
        shape_pixels = distance.min(1) <= 45
        nearest = np.bincount(distance[shape_pixels].argmin(1), minlength=len(COLOURS)).argmax()
        assert list(COLOURS)[nearest] == row["colour"]

    folder = synthetic_dataset_dir("shapes-ground")
    for row in read_jsonl(folder / "test.jsonl")[:50]:
        x1, y1, x2, y2 = row["solution"]
        assert 0 <= x1 < x2 <= 64 and 0 <= y1 < y2 <= 64
        assert f"the {row['colour']} {row['shape']} as [x1, y1, x2, y2]" in row["messages"][0]["content"]
        image = np.asarray(PIL.Image.open(folder / row["images"][0])).astype(int)
        target = np.abs(image - np.array(COLOURS[row["colour"]])).sum(-1) <= 45  # [64, 64]
        inside = target[y1:y2, x1:x2]
        assert inside.any(axis=0).all() and inside.any(axis=1).all()  # the box is tight on the shape

    counts = [row["solution"] for row in read_jsonl(synthetic_dataset_dir("shapes-count") / "train.jsonl")]
    assert set(counts) == {"1", "2", "3", "4", "5", "6"}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generation_is_deterministic(tmp_path, name):
    first = synthetic_dataset_dir(name, train_size=40, test_size=20, cache_dir=tmp_path / "a")
    second = synthetic_dataset_dir(name, train_size=40, test_size=20, cache_dir=tmp_path / "b")
    assert first.name == second.name
    first_bytes, second_bytes = folder_bytes(first), folder_bytes(second)
    assert len(first_bytes) == 40 + 20 + 3 and first_bytes == second_bytes
    assert len(read_jsonl(first / "train.jsonl")) == 40
    other = synthetic_dataset_dir(name, train_size=40, test_size=20, seed=1, cache_dir=tmp_path / "a")
    assert other != first and folder_bytes(other)["train.jsonl"] != first_bytes["train.jsonl"]


def _generate(cache_dir):
    return str(synthetic_dataset_dir("shapes-color", train_size=200, test_size=50, cache_dir=cache_dir))


def test_racing_processes_share_one_complete_copy(tmp_path):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        folders = pool.map(_generate, [tmp_path, tmp_path])
    assert folders[0] == folders[1]
    assert [p.name for p in tmp_path.iterdir()] == [folders[0].rsplit("/", 1)[1]]  # no temporary folder left
    assert len(read_jsonl(tmp_path / folders[0] / "train.jsonl")) == 200
