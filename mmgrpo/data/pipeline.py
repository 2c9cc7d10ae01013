"""Prompt batches for the training loop: media decoding and prompt encoding in DataLoader workers.

    loader = make_prompt_loader(dataset, batch_size=8, encode_fn=template.encode_prompt, seed=0)
    batches = cycle(loader)                    # endless, reshuffled each epoch from the seed
    for step in range(num_steps):
        batch = next(batches)                  # [(Sample, PromptInputs), ...] of length batch_size

Workers call `sample.load_media(...)`, then the dataset's augmentation if its registry entry has an
`augment:` block (mmgrpo/data/augment.py, seeded by (seed, epoch, index)), then `encode_fn(loaded)`,
so the training step never waits on decoding. `encode_fn` must be picklable when workers are
started with spawn/forkserver (a bound method of a template is). A `DataError` raised in a worker
reaches the caller as the same `DataError` with its own message (not torch's wrapper with a
worker traceback).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

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

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
        else:
            order = np.arange(self.num_rows)
        usable = len(self) * self.world_size
        indices = order[:usable][self.rank :: self.world_size].tolist()
        return iter([(i, self.epoch) for i in indices] if self.with_epoch else indices)

    def __len__(self) -> int:
        return self.num_rows // self.world_size


class PromptLoader(DataLoader):
    """A torch DataLoader that re-raises a worker's `DataError` cleanly; yields lists of (Sample, encoded)."""

    def __iter__(self):
        for batch in super().__iter__():
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
            "worker_init_fn": _init_worker,
            "multiprocessing_context": multiprocessing_context,
        }
    return PromptLoader(
        _EncodedDataset(dataset, encode_fn, media_kwargs or {}, seed),
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=_as_list,
        drop_last=drop_last,
        **workers,
    )


def cycle(loader: DataLoader):
    """Batches forever; before epoch e the sampler is set to e, so every epoch has its own order.

    The order depends only on the seed: two runs with the same seed see the same batches.
    """
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise ConfigError("the prompt loader yields no batch; the dataset is smaller than one batch")
        epoch += 1


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


def _as_list(batch: list) -> list:
    return batch


def _init_worker(worker_id: int) -> None:
    # Workers decode and run processors; one thread each keeps them from fighting the trainer.
    torch.set_num_threads(1)


def media_options(template, model_cfg) -> dict:
    """`Sample.load_media` options for training and evaluation alike: video frame sampling and,
    with use_audio_in_video, each video's sound track at the audio tower's rate.
    model_cfg: anything with video_fps, video_nframes and use_audio_in_video (a ModelConfig)."""
    options = {"fps": model_cfg.video_fps, "nframes": model_cfg.video_nframes}
    if model_cfg.use_audio_in_video:
        options.update(audio_in_video=True, sampling_rate=template.sampling_rate or 16000)
    return options
