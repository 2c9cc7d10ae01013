"""The prompt DataLoader: workers decode and encode, order is seeded per epoch, errors arrive clean."""

import PIL.Image
import pytest

from mmgrpo.data.prompt_batches import EpochSampler, cycle, make_prompt_loader
from mmgrpo.data.sample import LoadedSample, Sample
from mmgrpo.errors import ConfigError, DataError


class ToyDataset:
    """Ten image samples; row 7 names a file that does not exist when `broken`."""

    def __init__(self, root, broken=False):
        self.root, self.broken, self.name = str(root), broken, "toy"

    def __len__(self):
        return 10

    def __getitem__(self, index):
        image = "missing.png" if self.broken and index == 7 else "dot.png"
        return Sample(
            id=f"toy/train/{index}",
            messages=[{"role": "user", "content": "<image>hi"}],
            images=[image],
            columns={"solution": str(index)},
            media_root=self.root,
        )


def encode(loaded: LoadedSample) -> dict:
    """Stands in for template.encode_prompt: module-level, so picklable."""
    return {"id": loaded.id, "size": loaded.images[0].size}


@pytest.fixture
def root(tmp_path):
    PIL.Image.new("RGB", (6, 5), "white").save(tmp_path / "dot.png")
    return tmp_path


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_of_sample_and_encoded_pairs(root, num_workers):
    loader = make_prompt_loader(
        ToyDataset(root), batch_size=4, encode_fn=encode, seed=0, num_workers=num_workers
    )
    batches = list(loader)
    assert len(batches) == 2 and all(len(batch) == 4 for batch in batches)  # drop_last: 10 rows -> 2 batches
    for sample, encoded in batches[0]:
        assert isinstance(sample, Sample) and encoded == {"id": sample.id, "size": (6, 5)}
    ids = [sample.id for batch in batches for sample, _ in batch]
    assert len(set(ids)) == 8


def test_order_is_seeded_and_changes_per_epoch(root):
    def first_epochs(seed, num_workers):
        batches = cycle(
            make_prompt_loader(ToyDataset(root), batch_size=5, seed=seed, num_workers=num_workers)
        )
        return [[sample.id for sample, _ in next(batches)] for _ in range(6)]

    run = first_epochs(seed=1, num_workers=0)
    assert run == first_epochs(seed=1, num_workers=2)  # workers do not change the order
    assert run != first_epochs(seed=2, num_workers=0)
    epochs = [run[0] + run[1], run[2] + run[3], run[4] + run[5]]
    assert all(sorted(epoch) == sorted(f"toy/train/{i}" for i in range(10)) for epoch in epochs)
    assert epochs[0] != epochs[1]
    assert isinstance(run[0][0], str)


def test_unshuffled_and_sharded():
    assert list(EpochSampler(5, seed=0, shuffle=False)) == [0, 1, 2, 3, 4]
    ranks = [list(EpochSampler(7, seed=3, rank=rank, world_size=2)) for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 3 and not set(ranks[0]) & set(ranks[1])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_errors_arrive_as_clean_data_errors(root, num_workers):
    loader = make_prompt_loader(ToyDataset(root, broken=True), batch_size=10, seed=0, num_workers=num_workers)
    with pytest.raises(DataError) as caught:
        next(iter(loader))
    message = str(caught.value)
    assert message.startswith("sample toy/train/7, field 'images[0]'") and "missing.png" in message
    assert "Traceback" not in message


def test_dataset_smaller_than_a_batch(root):
    with pytest.raises(ConfigError, match="10 rows.*batch of 16"):
        make_prompt_loader(ToyDataset(root), batch_size=16, seed=0)


def test_workers_hand_over_encoded_prompts_as_one_buffer_per_dtype_and_the_same_values(root):
    # A real template's PromptInputs hold a dozen small tensors each; from a worker the whole
    # batch crosses in one buffer per dtype (PackedBatch) and arrives as the same objects.
    import torch

    from mmgrpo.models.loading import load_template

    template = load_template("tiny:qwen2-vl", "qwen2-vl")[2]
    batches = {
        workers: next(iter(make_prompt_loader(ToyDataset(root), batch_size=4, encode_fn=template.encode_prompt,
                                              seed=0, num_workers=workers)))
        for workers in (0, 2)
    }

    def tensors(obj):
        found = []

        def walk(value):
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, dict):
                for item in value.values():
                    walk(item)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    walk(item)
            elif hasattr(value, "__dict__"):
                walk(vars(value))

        walk(obj)
        return found

    direct, handed = tensors(batches[0]), tensors(batches[2])
    assert len(direct) == len(handed) >= 8
    for a, b in zip(direct, handed):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert [type(encoded).__name__ for _, encoded in batches[2]] == [type(encoded).__name__ for _, encoded in batches[0]]
    storages = {(t.dtype, t.untyped_storage().data_ptr()) for t in handed if t.numel()}
    assert len(storages) == len({t.dtype for t in handed if t.numel()})  # one buffer per dtype


def test_decoded_images_and_frames_cross_in_the_buffers_not_the_pickled_bytes():
    # A prompt keeps its decoded media for a rollout engine: 2.7 MB per 1280 x 720 image. Pickled
    # as bytes they went through the worker's pipe and were copied by the training loop; packed,
    # they travel in the shared buffers and the pickled rest stays small.
    import numpy as np
    import torch

    from mmgrpo.data.prompt_batches import PackedBatch

    rng = np.random.default_rng(0)
    image = PIL.Image.fromarray(rng.integers(0, 256, (72, 128, 3), dtype=np.uint8))
    image.info["dpi"] = (72, 72)
    images = [image, image.convert("L"), image.convert("RGBA"), image.convert("P")]  # P: pickled as before
    frames = rng.integers(0, 256, (8, 16, 16, 3), dtype=np.uint8)  # a Video's frames
    audio = rng.standard_normal(1600).astype(np.float32)
    metadata = {"frames_indices": np.arange(8), "fps": 2.0}
    packed = PackedBatch.pack([{"images": images, "frames": frames, "audio": audio, "metadata": metadata,
                                "ids": torch.arange(5)}])
    palette_bytes = 72 * 128 + 768
    assert len(packed.payload) < palette_bytes + 2000  # only the palette image's pixels are pickled
    out = packed.unpack()[0]
    for before, after in zip(images, out["images"]):
        assert (after.mode, after.size, after.info) == (before.mode, before.size, before.info)
        assert after.tobytes() == before.tobytes() and after.getpalette() == before.getpalette()
    for key, given in (("frames", frames), ("audio", audio)):
        assert type(out[key]) is np.ndarray and out[key].dtype == given.dtype
        np.testing.assert_array_equal(out[key], given)
    np.testing.assert_array_equal(out["metadata"]["frames_indices"], metadata["frames_indices"])
    assert out["metadata"]["fps"] == 2.0 and out["ids"].tolist() == [0, 1, 2, 3, 4]


def test_workers_hand_over_the_same_decoded_images(root):
    loaders = {workers: make_prompt_loader(ToyDataset(root), batch_size=4, seed=0, num_workers=workers) for workers in (0, 2)}
    batches = {workers: next(iter(loader)) for workers, loader in loaders.items()}
    for (_, direct), (_, handed) in zip(batches[0], batches[2]):
        assert [(i.mode, i.size, i.tobytes()) for i in handed.images] == [(i.mode, i.size, i.tobytes()) for i in direct.images]
