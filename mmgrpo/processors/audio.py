"""Audio: any reference a dataset may hold -> a float32 mono waveform at the requested rate.

A reference is a path (wav, flac, mp3, ogg: whatever libsndfile reads), raw bytes, a dict
`{"bytes": ..., "path": ...}` or `{"array": ..., "sampling_rate": ...}` (Hugging Face `datasets`
Audio feature), an `(array, sampling_rate)` pair, or a bare array (taken to be at
`sampling_rate` already). Channels are averaged; resampling uses soxr.

>>> load_audio((np.ones((8000, 2), np.float32), 8000), sampling_rate=16000).shape
(16000,)
"""

from __future__ import annotations

import io
import numbers
import os

import numpy as np

from mmgrpo.errors import DataError
from mmgrpo.processors import describe_ref, resolve_media_path

MIN_RATE, MAX_RATE = 1000, 768000  # Hz: plausible source sampling rates


def load_audio(ref, sampling_rate: int = 16000, media_root: str | os.PathLike | None = None) -> np.ndarray:
    """Decode `ref` to a float32 mono array [num_samples] at `sampling_rate` Hz.

    Raises `DataError` naming the file for a missing, empty or undecodable file, an unusable
    sampling rate, or NaN / infinite samples.
    """
    if isinstance(ref, dict):
        if ref.get("array") is not None:
            return load_audio((ref["array"], ref.get("sampling_rate")), sampling_rate)
        if ref.get("bytes") is not None:
            return _decode(ref["bytes"], describe_ref(ref), sampling_rate)
        if ref.get("path"):
            return load_audio(ref["path"], sampling_rate, media_root)
        raise DataError(f"audio dict {sorted(ref)} has none of 'array', 'bytes', 'path'")
    if isinstance(ref, (tuple, list)) and len(ref) == 2 and not isinstance(ref[0], numbers.Number):
        array, source_rate = ref
        return _finish(np.asarray(array, dtype=np.float32), source_rate, sampling_rate, "audio array")
    if isinstance(ref, np.ndarray):
        return _finish(ref.astype(np.float32, copy=False), sampling_rate, sampling_rate, "audio array")
    if isinstance(ref, (bytes, bytearray)):
        return _decode(bytes(ref), describe_ref(ref), sampling_rate)
    if isinstance(ref, (str, os.PathLike)):
        path = resolve_media_path(ref, media_root, "audio")
        return _decode(path.read_bytes(), str(path), sampling_rate)
    raise DataError(
        f"unsupported audio reference of type {type(ref).__name__}; give a path, bytes, "
        "a {'bytes', 'path'} dict or an (array, sampling_rate) pair"
    )


def _decode(data: bytes, name: str, sampling_rate: int) -> np.ndarray:
    import soundfile

    if not data:
        raise DataError(f"audio {name} is empty (0 bytes); replace the file")
    try:
        samples, source_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise DataError(
            f"cannot decode audio {name}: {err}; the file is corrupt or in a format libsndfile "
            "does not read (convert it to wav or flac)"
        ) from None
    return _finish(samples, source_rate, sampling_rate, name)


def _finish(samples: np.ndarray, source_rate, sampling_rate: int, name: str) -> np.ndarray:
    import soxr

    if not isinstance(source_rate, numbers.Real) or isinstance(source_rate, bool) or not source_rate > 0:
        raise DataError(f"{name} has an unusable sampling rate {source_rate!r}; give a positive number of Hz")
    if not MIN_RATE <= source_rate <= MAX_RATE:  # a broken header: resampling it would make hours of audio
        raise DataError(
            f"{name} says its sampling rate is {source_rate} Hz, outside {MIN_RATE}-{MAX_RATE} Hz; the header "
            "is wrong: re-encode the file (e.g. ffmpeg -i in.wav -ar 16000 out.wav) or give (array, sampling_rate)"
        )
    if samples.size == 0:  # before the channel mean, which would turn [0 frames, 1 channel] into one NaN
        raise DataError(f"{name} has no samples (0 s of audio); replace the file or drop the row")
    if not np.isfinite(samples).all():  # one NaN would turn the whole clip's features (and the loss) into NaN
        bad = int((~np.isfinite(samples)).sum())
        raise DataError(f"{name} has {bad} NaN or infinite sample(s) of {samples.size}; re-encode the file with finite values")
    if samples.ndim == 2:  # soundfile gives [frames, channels]; arrays may come as [channels, frames]
        channel_axis = 1 if samples.shape[1] <= samples.shape[0] else 0
        samples = samples.mean(axis=channel_axis)
    if samples.ndim != 1:
        raise DataError(f"{name} must be 1-D (mono) or 2-D (channels), got shape {list(samples.shape)}")
    if source_rate != sampling_rate:
        samples = soxr.resample(samples, source_rate, sampling_rate, quality="HQ")
    return np.ascontiguousarray(samples, dtype=np.float32)
