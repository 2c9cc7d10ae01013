"""Synthetic datasets: sizes, splits, answers that match the pictures, byte-identical regeneration."""

import json
import multiprocessing

import numpy as np
import PIL.Image
import pytest

from mmgrpo.data.catalog import resolve_dataset
from mmgrpo.data.synthetic import COLOURS, GENERATORS, generate, synthetic_dataset_dir
from mmgrpo.errors import ConfigError
from mmgrpo.processors.audio import load_audio
from mmgrpo.processors.video import load_video
from mmgrpo.tools import zoom

IMAGE_GENERATORS = ["shapes-color", "shapes-count", "shapes-ground"]
AV_GENERATORS = {  # name -> (modality, train rows, test rows of the built-in entry, files per row)
    "shapes-motion": ("video", 400, 200, 1),
    "shapes-motion-frames": ("video", 400, 200, 8),
    "tones-pitch": ("audio", 400, 200, 1),
    "tones-count": ("audio", 400, 200, 1),
}
SPLITS = ("train", "test", "validation")
ZOOM_GENERATORS = ["shapes-zoom", "shapes-zoom-sft"]  # one image per row; sft: a second (the crop) in most (KIND_WEIGHTS)


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


def test_every_generator_is_tested():
    assert sorted(GENERATORS) == sorted(IMAGE_GENERATORS + list(AV_GENERATORS) + ZOOM_GENERATORS)


@pytest.mark.parametrize("name", IMAGE_GENERATORS)
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
    files_per_row = AV_GENERATORS.get(name, (None, 0, 0, 1))[3]
    media = (40 + 20 + 10) * files_per_row  # the validation split: half the test size
    if name in ZOOM_GENERATORS:
        media = sum(len(row["images"]) for split in SPLITS for row in read_jsonl(first / f"{split}.jsonl"))
    assert len(first_bytes) == media + 4 and first_bytes == second_bytes  # 3 jsonl + info.json
    assert [len(read_jsonl(first / f"{split}.jsonl")) for split in SPLITS] == [40, 20, 10]
    other = synthetic_dataset_dir(name, train_size=40, test_size=20, seed=1, cache_dir=tmp_path / "a")
    assert other != first and folder_bytes(other)["train.jsonl"] != first_bytes["train.jsonl"]


def test_the_validation_split_is_its_own_and_leaves_train_and_test_as_they_were(tmp_path):
    with_validation = synthetic_dataset_dir("shapes-count", train_size=40, test_size=20, validation_size=30, cache_dir=tmp_path)
    generate("shapes-count", tmp_path / "none", train_size=40, test_size=20, validation_size=0)
    for split in ("train", "test"):
        assert (with_validation / f"{split}.jsonl").read_bytes() == (tmp_path / "none" / f"{split}.jsonl").read_bytes()
    validation = read_jsonl(with_validation / "validation.jsonl")
    assert len(validation) == 30 and read_jsonl(tmp_path / "none" / "validation.jsonl") == []
    images = {split: {(with_validation / row["images"][0]).read_bytes() for row in read_jsonl(with_validation / f"{split}.jsonl")}
              for split in ("test", "validation")}
    assert len(images["validation"] & images["test"]) < 3  # drawn apart (an identical image by chance is rare)


def test_registry_entries_have_a_validation_split(tmp_path, cache):
    registry = tmp_path / "extra.yaml"
    registry.write_text("datasets:\n  - name: small-count\n    synthetic: shapes-count\n"
                        "    synthetic_args: {train_size: 30, test_size: 10, validation_size: 6}\n")
    assert len(resolve_dataset("small-count:validation", extra_files=[registry])) == 6
    assert len(resolve_dataset("shapes-color:validation")) == 200
    with pytest.raises(ConfigError, match="has no split 'dev'; it has train, test, validation"):
        resolve_dataset("shapes-color:dev")


def _generate(cache_dir):
    return str(synthetic_dataset_dir("shapes-color", train_size=200, test_size=50, cache_dir=cache_dir))


def test_racing_processes_share_one_complete_copy(tmp_path):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        folders = pool.map(_generate, [tmp_path, tmp_path])
    assert folders[0] == folders[1]
    assert [p.name for p in tmp_path.iterdir()] == [folders[0].rsplit("/", 1)[1]]  # no temporary folder left
    assert len(read_jsonl(tmp_path / folders[0] / "train.jsonl")) == 200


@pytest.mark.parametrize("name", sorted(AV_GENERATORS))
def test_builtin_video_and_audio_datasets_have_their_splits(cache, name):
    modality, train_size, test_size, _ = AV_GENERATORS[name]
    train, test = resolve_dataset(name), resolve_dataset(f"{name}:test")
    assert (len(train), len(test)) == (train_size, test_size)
    sample = test[0]
    assert sample.id == f"{name}/test/0" and sample.modality == modality
    assert sample.messages[-1]["content"].startswith(f"<{modality}>")
    assert sample.columns["reference_response"] == f"<answer>{sample.columns['solution']}</answer>"
    assert train.reward_funcs == ["answer_format", "vqa_accuracy"]
    loaded = sample.load_media()
    if modality == "video":
        # the mp4: 8 frames at 4 fps, sampled at 2 fps; frames given as a list are a clip at video_fps: all 8
        frames = 8 if name.endswith("-frames") else 4
        assert loaded.videos[0].frames.shape == (frames, 64, 64, 3)
    else:
        assert loaded.audios[0].dtype == np.float32 and loaded.audios[0].ndim == 1


def _centre(frame: np.ndarray, background: np.ndarray) -> np.ndarray:
    """(x, y) centre of the pixels that differ from the background colour."""
    ys, xs = np.nonzero(np.abs(frame.astype(int) - background).sum(-1) > 60)
    return np.array([xs.mean(), ys.mean()])


def test_video_and_audio_answers_match_the_media(cache):
    for name in ("shapes-motion", "shapes-motion-frames"):
        folder = synthetic_dataset_dir(name, train_size=400, test_size=200)
        rows = read_jsonl(folder / "test.jsonl")[:40]
        assert {row["solution"] for row in rows} == {"left", "right", "up", "down"}
        for row in rows:
            video = load_video(row["videos"][0], nframes=8, media_root=folder)  # mp4 or a list of PNG frames
            assert video.frames.shape == (8, 64, 64, 3)
            background = video.frames[0, 0, 0].astype(int)  # the shape never covers every corner
            if (np.abs(video.frames[0].astype(int) - background).sum(-1) > 60).mean() > 0.5:
                background = video.frames[0, -1, -1].astype(int)
            dx, dy = _centre(video.frames[-1], background) - _centre(video.frames[0], background)
            moved = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            assert moved == row["solution"] and max(abs(dx), abs(dy)) > 10

    folder = synthetic_dataset_dir("tones-pitch", train_size=400, test_size=200)
    rows = read_jsonl(folder / "test.jsonl")[:40]
    assert {row["solution"] for row in rows} == {"low", "high"}
    for row in rows:
        wave = load_audio(row["audios"][0], 16000, folder)
        assert wave.shape == (16000,)  # 1 s
        peak_hz = np.abs(np.fft.rfft(wave)).argmax()  # 1 Hz per bin over 1 s
        assert abs(peak_hz - row["frequency"]) <= 2
        assert row["solution"] == ("high" if peak_hz > 500 else "low")

    folder = synthetic_dataset_dir("tones-count", train_size=400, test_size=200)
    rows = read_jsonl(folder / "test.jsonl")[:40]
    assert {row["solution"] for row in rows} == {"1", "2", "3", "4"}
    for row in rows:
        loud = np.abs(load_audio(row["audios"][0], 16000, folder)) > 0.05  # [24000]
        windows = loud[: len(loud) // 160 * 160].reshape(-1, 160).any(1)  # 10 ms windows
        beeps = int(windows[0]) + int((windows[1:] & ~windows[:-1]).sum())
        assert str(beeps) == row["solution"]


def test_shapes_zoom_boxes_hold_the_shape_and_the_crop_shows_its_colour(tmp_path):
    folder = synthetic_dataset_dir("shapes-zoom-sft", train_size=30, test_size=1, image_size=448, cache_dir=tmp_path)
    rows = read_jsonl(folder / "train.jsonl")
    kinds = [row["kind"] for row in rows]
    assert set(kinds) == {"answer", "call", "after_call"} and kinds.count("after_call") > len(kinds) / 2
    for row in rows:
        image = np.asarray(PIL.Image.open(folder / row["images"][0]), dtype=int)
        x1, y1, x2, y2 = (round(v * 448 / 1000) for v in row["zoom_box"])  # 0-1000 -> pixels
        background = image[0, 0]
        shape = np.abs(image - background).sum(-1) > 60  # [H, W] pixels of the shape
        inside = shape[y1:y2, x1:x2].sum()
        assert inside > 0 and inside == shape.sum()  # the whole shape lies in the named cell
        assert row["cell"] == [y1 // 112 + 1, x1 // 112 + 1]
        if row["kind"] == "after_call":
            crop = np.asarray(PIL.Image.open(folder / row["images"][1]), dtype=int)
            assert crop.shape == (112, 112, 3)
            tool = zoom(PIL.Image.open(folder / row["images"][0]).convert("RGB"), [x1, y1, x2, y2], max_pixels=112 * 112)
            assert (np.asarray(tool, dtype=int) == crop).all()  # what the tool returns at rollout, pixel for pixel
            colours = crop.reshape(-1, 3)[np.abs(crop - background).sum(-1).reshape(-1) > 60]
            nearest = min(COLOURS, key=lambda name: np.abs(colours.mean(0) - COLOURS[name]).sum())
            assert nearest == row["solution"]
