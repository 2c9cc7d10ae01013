"""Box-aware augmentation (mmgrpo/data/augment.py) and the registry's `augment:` block.

- a filled rectangle and its box go through flips, small rotations and crops: the moved box
  matches the bounding box of the moved rectangle (IoU > 0.9);
- (seed, epoch, index) fixes the draw: same triple, same output; another index or epoch, another;
- every frame of a video gets the image's transform; audio noise and gain have the asked stats;
- a bad `augment:` key or value is a ConfigError naming the file, the entry and the key;
- a registry entry with an `augment:` block trains a step, and completions.jsonl records the
  parameters and the moved box.
"""

import json

import numpy as np
import pytest
from PIL import Image

from mmgrpo.data.augment import Augment, parse_augment
from mmgrpo.data.catalog import mix_datasets, read_registry_file, resolve_dataset
from mmgrpo.data.prompt_batches import cycle, make_prompt_loader
from mmgrpo.data.sample import LoadedSample, Video
from mmgrpo.errors import ConfigError, DataError
from mmgrpo.rewards.iou import box_iou

WIDTH, HEIGHT, BOX = 120, 80, [30, 20, 70, 50]  # x2, y2 exclusive, as shapes-ground's solutions


def rectangle_image() -> Image.Image:
    pixels = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    x1, y1, x2, y2 = BOX
    pixels[y1:y2, x1:x2] = 255
    return Image.fromarray(pixels)


def mask_box(image) -> list[float]:
    """The bounding box [x1, y1, x2, y2) of the bright pixels."""
    mask = np.asarray(image)[..., 0] > 127
    ys, xs = np.nonzero(mask)
    return [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


def sample_with(**media) -> LoadedSample:
    return LoadedSample(id="toy/train/0", messages=[], columns={"solution": list(BOX), "colour": "white"}, **media)


@pytest.mark.parametrize(
    "augment",
    [Augment(hflip=1.0), Augment(vflip=1.0), Augment(rotate=10), Augment(crop=0.6),
     Augment(hflip=0.5, vflip=0.5, rotate=8, crop=0.7, color_jitter=0.2)],
    ids=["hflip", "vflip", "rotate", "crop", "all"],
)  # fmt: skip
def test_the_box_moves_with_the_image(augment):
    for index in range(6):
        out = augment(sample_with(images=[rectangle_image()]), seed=0, epoch=0, index=index)
        image, box = out.images[0], out.columns["solution"]
        assert box_iou(box, mask_box(image)) > 0.9, (out.columns["augment"], box, mask_box(image))
        width, height = image.size
        assert 0 <= box[0] <= box[2] <= width and 0 <= box[1] <= box[3] <= height  # clamped to the image
        assert out.columns["colour"] == "white"  # other columns pass through


def test_exact_flip_and_crop_values():
    out = Augment(hflip=1.0)(sample_with(images=[rectangle_image()]), seed=0, epoch=0, index=0)
    assert out.columns["solution"] == [WIDTH - 70.0, 20.0, WIDTH - 30.0, 50.0]
    assert out.columns["augment"] == {"hflip": True}
    out = Augment(crop=0.5)(sample_with(images=[rectangle_image()]), seed=0, epoch=0, index=3)
    left, top, width, height = out.columns["augment"]["crop"]
    assert out.images[0].size == (round(width * WIDTH), round(height * HEIGHT))  # not resized
    shift = [round(left * WIDTH), round(top * HEIGHT)] * 2
    assert out.columns["solution"] == [float(v - s) for v, s in zip(BOX, shift)]  # the box fits: kept whole


def test_the_draw_is_fixed_by_seed_epoch_and_index():
    augment = Augment(hflip=0.5, rotate=10, crop=0.8, color_jitter=0.3, audio_noise=0.01)
    sample = sample_with(images=[rectangle_image()], audios=[np.zeros(1600, np.float32)])

    def run(seed, epoch, index):
        out = augment(sample, seed=seed, epoch=epoch, index=index)
        return out.columns["augment"], np.asarray(out.images[0]), out.audios[0]

    first, again = run(0, 0, 5), run(0, 0, 5)
    assert first[0] == again[0]
    assert np.array_equal(first[1], again[1]) and np.array_equal(first[2], again[2])
    for other in (run(0, 0, 6), run(0, 1, 5), run(1, 0, 5)):
        assert other[0] != first[0]
        assert not np.array_equal(other[2], first[2])
    assert sample.columns["solution"] == BOX and "augment" not in sample.columns  # the input is untouched


def test_every_video_frame_gets_the_images_transform():
    image = rectangle_image()
    frames = np.stack([np.asarray(image)] * 4)  # [4, H, W, 3]
    video = Video(frames=frames, metadata={"fps": 2.0, "width": WIDTH, "height": HEIGHT}, audio=None)
    augment = Augment(hflip=0.5, rotate=10, crop=0.7, color_jitter=0.3)
    for index in range(4):
        out = augment(sample_with(images=[image], videos=[video]), seed=0, epoch=0, index=index)
        moved = out.videos[0]
        assert moved.frames.dtype == np.uint8 and moved.frames.shape[0] == 4
        for frame in moved.frames:
            assert np.array_equal(frame, np.asarray(out.images[0]))
        assert (moved.metadata["width"], moved.metadata["height"]) == out.images[0].size
    # a video-only sample: the box follows the frames
    out = augment(sample_with(videos=[video]), seed=0, epoch=0, index=1)
    assert box_iou(out.columns["solution"], mask_box(out.videos[0].frames[0])) > 0.9


def test_audio_noise_and_gain():
    rng = np.random.default_rng(0)
    clip = (0.5 * np.sin(np.linspace(0, 200 * np.pi, 16000))).astype(np.float32)
    out = Augment(audio_noise=0.02)(sample_with(audios=[np.zeros(16000, np.float32)]), seed=0, epoch=0, index=0)
    noise = out.audios[0]
    assert noise.dtype == np.float32 and abs(noise.std() - 0.02) < 0.001 and abs(noise.mean()) < 0.001
    assert out.columns["augment"] == {"audio_noise": 0.02}
    gains = []
    for index in range(20):
        track = rng.uniform(-0.5, 0.5, 800).astype(np.float32)
        video = Video(frames=np.zeros((2, 8, 8, 3), np.uint8), metadata={}, audio=track)
        out = Augment(audio_gain=(0.8, 1.2))(sample_with(audios=[clip], videos=[video]), seed=0, epoch=0, index=index)
        gain = out.columns["augment"]["audio_gain"]
        np.testing.assert_allclose(out.audios[0], clip * gain, rtol=1e-6)
        np.testing.assert_allclose(out.videos[0].audio, track * gain, rtol=1e-6)  # the sound track too
        gains.append(gain)
    assert 0.8 <= min(gains) < 0.9 and 1.1 < max(gains) <= 1.2


def test_boxes_in_text_cannot_be_moved():
    sample = LoadedSample(id="toy/train/1", messages=[], images=[rectangle_image()], columns={"solution": "[1, 2, 3, 4]"})
    with pytest.raises(DataError, match="toy/train/1.*augmentation cannot move"):
        Augment(hflip=1.0)(sample, seed=0, epoch=0, index=0)
    out = Augment(color_jitter=0.2)(sample, seed=0, epoch=0, index=0)  # no geometry: nothing to move
    assert out.columns["solution"] == "[1, 2, 3, 4]"
    vqa = LoadedSample(id="toy/train/2", messages=[], images=[rectangle_image()], columns={"solution": ["red"] * 10})
    assert Augment(hflip=1.0)(vqa, seed=0, epoch=0, index=0).columns["solution"] == ["red"] * 10


@pytest.mark.parametrize(
    ("block", "key"),
    [({"hflip": 0.5, "blur": 1}, "augment.blur"), ({"hflip": 2}, "augment.hflip"), ({"crop": 0}, "augment.crop"),
     ({"rotate": "10"}, "augment.rotate"), ({"audio_gain": [1.2, 0.8]}, "augment.audio_gain"),
     ({"color_jitter": True}, "augment.color_jitter"), ([0.5], "augment")],
)  # fmt: skip
def test_a_bad_augment_block_is_a_config_error(block, key, tmp_path):
    path = tmp_path / "reg.yaml"
    path.write_text(json.dumps({"datasets": [{"name": "aug-x", "synthetic": "shapes-ground", "augment": block}]}))
    with pytest.raises(ConfigError) as err:
        read_registry_file(path)
    assert str(path) in str(err.value) and "'aug-x'" in str(err.value) and f"key '{key}'" in str(err.value)


def test_parse_and_mixture_route(tmp_path):
    assert parse_augment({"hflip": 0.5, "audio_gain": [0.8, 1.2]}, "x") == Augment(hflip=0.5, audio_gain=(0.8, 1.2))
    path = tmp_path / "reg.yaml"
    path.write_text(
        "datasets:\n"
        "  - {name: aug-a, synthetic: shapes-ground, augment: {hflip: 1.0}}\n"
        "  - {name: plain-b, synthetic: shapes-color}\n"
    )
    registry = {entry.name: entry for entry in read_registry_file(path)}
    assert resolve_dataset("aug-a", registry=registry).augment == Augment(hflip=1.0)
    mix = mix_datasets(["aug-a:test:1", "plain-b:test:1"], registry=registry, size=40)
    for index in range(len(mix)):
        expected = Augment(hflip=1.0) if mix[index].id.startswith("aug-a/") else None
        assert mix.augment_for(index) == expected


def test_the_loader_draws_anew_each_epoch_and_the_same_per_seed(tmp_path):
    rectangle_image().save(tmp_path / "r.png")
    rows = [{"query": "<image>Box?", "images": ["r.png"], "solution": BOX} for _ in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "reg.yaml").write_text(
        "datasets:\n  - {name: rects, files: data.jsonl, augment: {hflip: 0.5, rotate: 10, crop: 0.8}}\n"
    )
    registry = {entry.name: entry for entry in read_registry_file(tmp_path / "reg.yaml")}

    def two_epochs(seed):
        loader = make_prompt_loader(resolve_dataset("rects", registry=registry), batch_size=4, seed=seed, num_workers=0)
        batches = cycle(loader)
        return [{s.id: s.columns["augment"] for s, _ in next(batches)} for _ in range(2)]

    epoch0, epoch1 = two_epochs(0)
    assert epoch0 == two_epochs(0)[0]
    assert epoch0 != epoch1 and epoch0 != two_epochs(1)[0]
    for sample, loaded in next(cycle(make_prompt_loader(resolve_dataset("rects", registry=registry), batch_size=4, num_workers=0))):
        assert sample.columns["solution"] == loaded.columns["solution"]  # rewards see the moved box
        assert box_iou(sample.columns["solution"], mask_box(loaded.images[0])) > 0.9


def test_a_registry_augment_block_trains_and_is_logged(tmp_path):
    from mmgrpo.cli import main

    registry = tmp_path / "aug.yaml"
    registry.write_text(
        "datasets:\n"
        "  - name: shapes-ground-aug\n"
        "    synthetic: shapes-ground\n"
        "    system_prompt: Answer inside <answer></answer>.\n"
        "    reward_funcs: [answer_format, iou]\n"
        "    augment: {hflip: 1.0, color_jitter: 0.2}\n"
    )
    out = tmp_path / "run"
    main(["train", "--model", "tiny:qwen2-vl", "--dataset", "shapes-ground-aug", "--dataset_registry", str(registry),
          "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size", "4",
          "--max_completion_length", "8", "--beta", "0", "--dataloader_num_workers", "1", "--logging_steps", "100",
          "--output_dir", str(out)])  # fmt: skip
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2
    original = resolve_dataset("shapes-ground")  # the same rows, unaugmented
    for record in records:
        params = record["augment"]
        assert params["hflip"] is True and set(params) == {"hflip", "brightness", "contrast", "saturation"}
        x1, y1, x2, y2 = original[int(record["sample_id"].rsplit("/", 1)[1])].columns["solution"]
        assert record["solution"] == [64.0 - x2, float(y1), 64.0 - x1, float(y2)]  # mirrored in a 64-px image
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert np.isfinite(metrics["loss"]) and "reward/iou" in metrics
