"""Prompt batches for the training loop: media decoding and prompt encoding in DataLoader workers.

    loader = make_prompt_loader(dataset, batch_size=8, encode_fn=template.encode_prompt, seed=0)
    batches = cycle(loader)                    # endless, reshuffled each epoch from the seed
    for step in range(num_steps):
        batch = next(batches)                  # [(Sample, PromptInputs), ...] of length batch_size
    state = batches.state_dict()               # {"epoch", "batch", ...}: saved in a checkpoint
    batches = PromptStream(loader, state)      # a resumed run: the same batches from there on

Workers call `sample.load_media(...)`, then the dataset's augmentation if its registry entry has an
`augment:` block (mmgrpo/data/augment.py, seeded by (seed, epoch, index)), then `encode_fn(loaded)`,
so the training step never waits on decoding. `encode_fn` must be picklable when workers are
started with spawn/forkserver (a bound method of a template is). A `DataError` raised in a worker
reaches the caller as the same `DataError` with its own message (not torch's wrapper with a
worker traceback).
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle

import numpy as np
import PIL.Image
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from mmgrpo.config import DataConfig, ModelConfig
from mmgrpo.data.lifetime import WorkerInit, stop_signals_blocked
from mmgrpo.errors import ConfigError, DataError, MMGRPOError


class EpochSampler(Sampler):
    """Row order for one epoch: a permutation seeded by (seed, epoch), sharded across ranks.

    With `world_size` ranks each rank gets every `world_size`-th index of the same permutation
    (truncated so all ranks get the same count).

    >>> sampler = EpochSampler(6, seed=0, shuffle=False, rank=1, world_size=2)
    >>> list(sampler)
    [1, 3, 5]
    """

    def __init__(
        self, num_rows: int, *, seed: int, shuffle: bool = True, rank: int = 0, world_size: int = 1,
        with_epoch: bool = False,
    ):
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.with_epoch = with_epoch  # yield (index, epoch): persistent workers cannot see set_epoch
        self.epoch = 0
        self.start = 0  # rows of this rank's share already consumed in this epoch (a resumed stream)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The next iteration is epoch `epoch`, from row `start` of this rank's share on."""
        self.epoch, self.start = epoch, start

    def indices(self, epoch: int) -> list[int]:
        """This rank's share of epoch `epoch`, in order."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        else:
            order = np.arange(self.num_rows)
        usable = len(self) * self.world_size
        return order[:usable][self.rank :: self.world_size].tolist()

    def __iter__(self):
        indices = self.indices(self.epoch)[self.start :]
        return iter([(i, self.epoch) for i in indices] if self.with_epoch else indices)

    def __len__(self) -> int:
        return self.num_rows // self.world_size


class PromptLoader(DataLoader):
    """A torch DataLoader that re-raises a worker's `DataError` cleanly; yields lists of (Sample, encoded)."""

    def __iter__(self):
        with stop_signals_blocked():  # workers start here: a scheduler's signal waits for their own handling
            batches = super().__iter__()
        for batch in batches:
            if isinstance(batch, PackedBatch):
                batch = batch.unpack()
            errors = [item.error for item in batch if isinstance(item, _Failure)]
            if errors:
                self._stop_workers()
                raise errors[0]
            yield batch

    def _stop_workers(self) -> None:
        # The raised error's traceback holds this frame and so the worker iterator in a reference
        # cycle; left to the garbage collector, its shutdown stalls 5 s. Stop the workers now (a
        # later iter() starts fresh ones).
        iterator = getattr(self, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._iterator = None


def make_prompt_loader(
    dataset,
    *,
    batch_size: int,
    encode_fn=None,
    seed: int = 0,
    num_workers: int = 2,
    prefetch_factor: int = 2,
    shuffle: bool = True,
    drop_last: bool = True,
    media_kwargs: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
    multiprocessing_context=None,
) -> PromptLoader:
    """A DataLoader over `dataset` (anything with len() and [i] -> Sample) yielding lists of
    (Sample, encode_fn(LoadedSample)) pairs; with encode_fn None the LoadedSample itself is the second item.

    media_kwargs: passed to `Sample.load_media` (fps, nframes, max_frames, sampling_rate).
    rank / world_size: each rank reads a disjoint share of every epoch.
    """
    rows_per_rank = len(dataset) // world_size
    if drop_last and rows_per_rank < batch_size:
        raise ConfigError(
            f"dataset {getattr(dataset, 'name', '')} has {len(dataset)} rows ({rows_per_rank} per rank), "
            f"fewer than one batch of {batch_size}; lower the batch size or use a larger dataset"
        )
    sampler = EpochSampler(
        len(dataset), seed=seed, shuffle=shuffle, rank=rank, world_size=world_size, with_epoch=True
    )
    workers = {}
    if num_workers > 0:
        workers = {
            "prefetch_factor": prefetch_factor,
            "persistent_workers": True,
            "worker_init_fn": WorkerInit(),  # one torch thread; ends with the trainer, even on kill -9
            "multiprocessing_context": multiprocessing_context,
        }
    return PromptLoader(
        _EncodedDataset(dataset, encode_fn, media_kwargs or {}, seed),
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=_collate,
        drop_last=drop_last,
        # Each new iterator draws its workers' seed from this generator, not from torch's global
        # RNG: the training step's sampling does not depend on when the loader (re)starts, so a
        # run resumed mid-epoch samples as the uninterrupted one did.
        generator=torch.Generator().manual_seed(seed),
        **workers,
    )


def cycle(loader: DataLoader) -> PromptStream:
    """Batches forever; before epoch e the sampler is set to e, so every epoch has its own order.

    The order depends only on the seed: two runs with the same seed see the same batches. The
    returned stream's position is state (`PromptStream.state_dict()`) that a resumed run restores.
    """
    return PromptStream(loader)


class PromptStream:
    """Endless batches of a `make_prompt_loader` loader, reshuffled per epoch, with a position that
    can be saved and restored: a stream restored at batch k of epoch e yields exactly the batches
    an uninterrupted stream yields from there on (workers and prefetching included: a batch counts
    as consumed when `next()` returns it, so prefetched ones are simply read again).

    A mixture (`MixedDataset`) is one index space whose plan (which source, which row) is fixed by
    the seed, so its datasets have no positions of their own: the mixture's position fixes each
    dataset's. `state_dict()["per_dataset"]` reports how many rows of each were read this epoch.
    Each rank streams its own share; ranks move in step, and each saves its own position.
    """

    def __init__(self, loader: DataLoader, state: dict | None = None):
        self.loader, self.sampler = loader, loader.sampler
        self.epoch, self.batch = 0, 0  # the next batch is number `batch` (from 0) of epoch `epoch`
        self.last_start = (0, 0)  # (epoch, batch) where the batch returned last began (read again on resume: async rollouts)
        self._iterator = None
        if state is not None:
            self.load_state_dict(state)

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            if self._iterator is None:
                if hasattr(self.sampler, "set_epoch"):
                    self.sampler.set_epoch(self.epoch, self.batch * self.loader.batch_size)
                self._iterator = iter(self.loader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                if self.batch == 0:
                    raise ConfigError("the prompt loader yields no batch; the dataset is smaller than one batch") from None
                self.epoch, self.batch, self._iterator = self.epoch + 1, 0, None
                continue
            self.last_start = (self.epoch, self.batch)
            self.batch += 1
            return batch

    def _identity(self) -> dict:
        dataset = getattr(self.loader.dataset, "dataset", self.loader.dataset)  # inside _EncodedDataset
        sources = getattr(dataset, "sources", [dataset])
        return {
            "dataset": getattr(dataset, "name", type(dataset).__name__),
            "rows": len(dataset),
            "sources": [[getattr(s, "name", "?"), getattr(s, "split", "?"), len(s)] for s in sources],
            "batch_size": self.loader.batch_size,
            "seed": getattr(self.sampler, "seed", None),
            "rank": getattr(self.sampler, "rank", 0),
            "world_size": getattr(self.sampler, "world_size", 1),
        }

    def state_dict(self) -> dict:
        """{"epoch", "batch"} (the next batch to yield) and what the position is a position in."""
        epoch, batch = self.epoch, self.batch
        state = {"epoch": epoch, "batch": batch, **self._identity()}
        dataset = getattr(self.loader.dataset, "dataset", self.loader.dataset)
        if hasattr(dataset, "source_ids") and isinstance(self.sampler, EpochSampler):
            read = self.sampler.indices(epoch)[: batch * self.loader.batch_size]
            counts = np.bincount(dataset.source_ids[read], minlength=len(dataset.sources)) if read else []
            state["per_dataset"] = {s.name: int(c) for s, c in zip(dataset.sources, counts)}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; the stream must be over the same data, batch size, seed and ranks."""
        mine = self._identity()
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise ConfigError(
                    f"the saved prompt stream had {key} {state[key]!r}, this run's has {value!r}: resume with the "
                    "same --dataset, --split, batch size, --seed and number of processes"
                )
        self.epoch, self.batch, self._iterator = int(state["epoch"]), int(state["batch"]), None


class _EncodedDataset(Dataset):
    """Runs in a worker: Sample -> LoadedSample -> augmentation (if its dataset has any) -> encode_fn(...)."""

    def __init__(self, dataset, encode_fn, media_kwargs: dict, seed: int = 0):
        self.dataset, self.encode_fn, self.media_kwargs = dataset, encode_fn, media_kwargs
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        index, epoch = index if isinstance(index, tuple) else (index, 0)  # EpochSampler(with_epoch=True)
        try:
            sample = self.dataset[index]
            loaded = sample.load_media(**self.media_kwargs)
            augment = self.dataset.augment_for(index) if hasattr(self.dataset, "augment_for") else None
            if augment is not None:  # the registry's `augment:` block of the sample's own dataset
                loaded = augment(loaded, seed=self.seed, epoch=epoch, index=index)
                sample = dataclasses.replace(sample, columns=loaded.columns)  # moved box, "augment" params
        except MMGRPOError as err:
            return _Failure(err)
        if self.encode_fn is None:
            return sample, loaded
        try:
            return sample, self.encode_fn(loaded)
        except MMGRPOError as err:
            return _Failure(err)
        except Exception as err:  # a processor rejecting odd media: still name the sample
            return _Failure(
                DataError(
                    f"sample {sample.id}: cannot encode its prompt ({type(err).__name__}: {err}); check its "
                    "media (size, frame count, length) and messages"
                )
            )


class _Failure:
    """A user-facing error carried out of a worker as data, to be raised in the main process."""

    def __init__(self, error: MMGRPOError):
        self.error = error


def _collate(batch: list) -> list | PackedBatch:
    # The batch stays a list of items; in a worker it leaves as one PackedBatch, so a handful of
    # tensors cross the process boundary instead of every small tensor of every prompt.
    return PackedBatch.pack(batch) if get_worker_info() is not None else batch


class PackedBatch:
    """A batch with all its tensors, arrays and decoded images moved into one flat buffer per dtype,
    for the trip out of a worker.

    A DataLoader worker hands each tensor of a batch over in its own shared-memory segment, with a
    file descriptor, a segment and a mapping each: for 64 tiny-image prompts of a dozen tensors
    each that cost the training loop more than encoding them did (docs/speed.md, "Data-loading
    workers"). Everything else crosses as pickled bytes through a pipe, which the training loop
    reads and copies: the decoded images (PIL) and video frames (numpy) a prompt keeps for a rollout
    engine are 11 MB for four 1280 x 720 images, 40 ms of the loop's time a prompt on two busy cores
    (docs/benchmarks.md, "Media preparation at real sizes"). Packed, tensors, numeric numpy arrays and
    RGB / RGBA / L images go into the buffers, the rest of the batch is pickled to bytes with each of
    them replaced by its place, and `unpack` in the main process rebuilds the same objects: tensors
    and arrays as views of the buffers, images as new PIL images of the same pixels, mode and info.

    >>> import PIL.Image
    >>> batch = [{"ids": torch.arange(3), "pixels": torch.ones(2, 2)}, ("text", torch.zeros(1, dtype=torch.long))]
    >>> packed = PackedBatch.pack(batch)
    >>> [tuple(b.shape) for b in packed.buffers]  # the two long tensors in one buffer, the float one in another
    [(4,), (4,)]
    >>> out = packed.unpack()
    >>> out[0]["ids"].tolist(), out[0]["pixels"].tolist(), out[1]
    ([0, 1, 2], [[1.0, 1.0], [1.0, 1.0]], ('text', tensor([0])))
    >>> image, frames = PIL.Image.new("RGB", (640, 360), "red"), np.zeros((8, 32, 32, 3), dtype=np.uint8)
    >>> packed = PackedBatch.pack([(image, frames)])
    >>> len(packed.payload) < 1000, [tuple(b.shape) for b in packed.buffers]  # pixels in the buffer, not the bytes
    (True, [(715776,)])
    >>> image_out, frames_out = packed.unpack()[0]
    >>> image_out.mode, image_out.size, image_out.getpixel((0, 0)), frames_out.shape, type(frames_out).__name__
    ('RGB', (640, 360), (255, 0, 0), (8, 32, 32, 3), 'ndarray')
    """

    IMAGE_MODES = ("RGB", "RGBA", "L")  # modes whose pixels np.asarray and PIL.Image.fromarray carry exactly

    def __init__(self, payload: bytes, places: list[tuple[int, int, tuple]], buffers: list[torch.Tensor]):
        self.payload, self.places, self.buffers = payload, places, buffers  # places[i]: (buffer, offset, shape)

    @classmethod
    def pack(cls, batch) -> PackedBatch:
        tensors: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor) -> int:
            tensors.append(tensor)
            return len(tensors) - 1

        class _Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                if type(obj) is torch.Tensor and not obj.requires_grad:  # not Parameters or subclasses
                    return ("tensor", keep(obj))
                if type(obj) is np.ndarray and obj.dtype.kind in "biuf" and obj.dtype.isnative:  # video frames, audio
                    try:
                        tensor = torch.from_numpy(obj if obj.flags.writeable else obj.copy())
                    except TypeError:  # a dtype torch has no type for (uint32 in older torch)
                        return None
                    return ("array", keep(tensor))
                if isinstance(obj, PIL.Image.Image) and obj.mode in PackedBatch.IMAGE_MODES:  # decoded images
                    return ("image", keep(torch.from_numpy(np.array(obj))), obj.info)
                return None

        stream = io.BytesIO()
        _Pickler(stream, protocol=pickle.HIGHEST_PROTOCOL).dump(batch)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for number, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(number)
        buffers, places = [], [None] * len(tensors)
        for numbers in by_dtype.values():
            offset = 0
            for number in numbers:
                places[number] = (len(buffers), offset, tuple(tensors[number].shape))
                offset += tensors[number].numel()
            buffers.append(torch.cat([tensors[number].reshape(-1) for number in numbers]))
        return cls(stream.getvalue(), places, buffers)

    def unpack(self):
        places, buffers = self.places, self.buffers

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, place):
                kind, number = place[:2]
                buffer, offset, shape = places[number]
                tensor = buffers[buffer][offset : offset + math.prod(shape)].view(shape)
                if kind == "tensor":
                    return tensor
                if kind == "array":
                    return tensor.numpy()
                image = PIL.Image.fromarray(tensor.numpy())
                image.info.update(place[2])
                return image

        return _Unpickler(io.BytesIO(self.payload)).load()


def media_options(template, model_cfg) -> dict:
    """`Sample.load_media` options for training and evaluation alike: video frame sampling, the
    longest audio clip the audio encoder takes and, with use_audio_in_video, each video's sound
    track at the audio tower's rate.
    model_cfg: anything with video_fps, video_nframes and use_audio_in_video (a ModelConfig)."""
    options = {"fps": model_cfg.video_fps, "nframes": model_cfg.video_nframes}
    if getattr(template, "max_audio_samples", None):  # longer clips are cut here, with one warning per dataset, not by the encoder in silence
        options["max_audio_samples"] = template.max_audio_samples
        options["sampling_rate"] = template.sampling_rate or 16000
    if model_cfg.use_audio_in_video:
        options.update(audio_in_video=True, sampling_rate=template.sampling_rate or 16000)
    return options


class PromptEncoder:
    """Runs in DataLoader workers: decoded sample -> template inputs, length checked."""

    def __init__(self, template, max_prompt_length: int):
        self.template = template
        self.max_prompt_length = max_prompt_length

    def __call__(self, loaded):
        encoded = self.template.encode_prompt(loaded)
        length = encoded.prompt_ids.shape[-1]
        if length > self.max_prompt_length:
            raise DataError(
                f"sample {loaded.id}: prompt is {length} tokens (media included), over --max_prompt_length "
                f"{self.max_prompt_length}. Raise it, or lower --max_pixels / --video_nframes."
            )
        return encoded


def prompt_stream(data_cfg: DataConfig, model_cfg: ModelConfig, dataset, template, batch_size: int, strategy, seed: int):
    """Batches of (Sample, PromptInputs) forever, reshuffled each epoch (from `seed`), each rank its
    own share: prompts encoded under --max_prompt_length by --dataloader_num_workers workers, media
    decoded as `model_cfg` says (`media_options`)."""
    loader = make_prompt_loader(
        dataset,
        batch_size=batch_size,
        encode_fn=PromptEncoder(template, data_cfg.max_prompt_length),
        seed=seed,
        num_workers=data_cfg.dataloader_num_workers,
        media_kwargs=media_options(template, model_cfg),
        rank=strategy.data_rank,  # a sequence group's ranks read the same prompts
        world_size=strategy.data_world,
    )
    return cycle(loader)
