"""Videos: a file (or its bytes) or a list of frame images -> `Video(frames, metadata)`.

Frames are sampled uniformly over the whole clip, either `fps` frames per second of video or a
fixed `nframes`. The count is always even (at least 2) because the Qwen vision towers merge
frames in temporal pairs; an odd count is rounded down.

    load_video("clip.mp4", fps=2.0)             # a 10 s clip -> 20 frames
    load_video("clip.mp4", nframes=8)           # 8 frames, evenly spaced
    load_video(["f0.jpg", "f1.jpg", "f2.jpg", "f3.jpg"], fps=1.0)   # frames as given

`metadata` holds what a Hugging Face video processor needs (`VideoMetadata` fields): `fps` of the
source, `total_num_frames` of the source, `frames_indices` of the sampled frames, `duration` in
seconds, `width`, `height`. Files are decoded with decord, or with PyAV when decord is missing or
cannot open the file.

    load_video("clip.mp4", audio_sampling_rate=16000)   # also its sound track -> Video.audio

With `audio_sampling_rate` the file's first audio stream is decoded with PyAV, whole (frames are
sampled over the whole clip too), mixed to mono and resampled: `Video.audio`, float32
[num_samples]. A file without sound, or a video given as frames, gets `audio=None`.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmgrpo.errors import DataError
from mmgrpo.processors import describe_ref, resolve_media_path


@dataclass
class Video:
    """A decoded video: the sampled frames and what a processor needs to know about them."""

    frames: Any  # uint8 numpy array [num_frames, height, width, 3]
    metadata: dict  # fps, total_num_frames, frames_indices, duration (seconds)
    # The sound track, float32 mono [num_samples] at the requested rate: decoded only when asked
    # (`load_media(audio_in_video=True)`, Qwen2.5-Omni's use_audio_in_video); None otherwise.
    audio: np.ndarray | None = None


def load_video(
    ref,
    *,
    fps: float = 2.0,
    nframes: int | None = None,
    max_frames: int | None = None,
    media_root: str | os.PathLike | None = None,
    audio_sampling_rate: int | None = None,
) -> Video:
    """Decode and sample a video.

    ref: a path, bytes, a `{"bytes", "path"}` dict, a list of frame references (each anything
        `load_image` accepts; taken as a clip recorded at `fps`), a uint8 array [T, H, W, 3] or a `Video`.
    fps: frames to sample per second of video (ignored when `nframes` is given).
    nframes: sample exactly this many frames (rounded down to an even number).
    max_frames: cap on the number of sampled frames (long clips at a high fps).
    audio_sampling_rate: also decode the sound track at this rate (Hz) into `Video.audio`.
    """
    if isinstance(ref, Video):
        return ref
    if isinstance(ref, (list, tuple)):
        return _from_frames(ref, fps=fps, nframes=nframes, max_frames=max_frames, media_root=media_root)
    if isinstance(ref, np.ndarray):
        return _from_array(ref, fps=fps, nframes=nframes, max_frames=max_frames)
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            data, name = ref["bytes"], describe_ref(ref)
        elif ref.get("path"):
            return load_video(
                ref["path"], fps=fps, nframes=nframes, max_frames=max_frames, media_root=media_root,
                audio_sampling_rate=audio_sampling_rate,
            )
        else:
            raise DataError(f"video dict {sorted(ref)} has neither 'bytes' nor 'path'")
    elif isinstance(ref, (bytes, bytearray)):
        data, name = bytes(ref), describe_ref(ref)
    elif isinstance(ref, (str, os.PathLike)):
        path = resolve_media_path(ref, media_root, "video")
        data, name = None, str(path)
        if path.stat().st_size == 0:
            raise DataError(f"video {name} is empty (0 bytes); replace the file")
    else:
        raise DataError(
            f"unsupported video reference of type {type(ref).__name__}; give a path, bytes, "
            "a {'bytes', 'path'} dict or a list of frame images"
        )
    if data is not None and not data:
        raise DataError(f"video {name} is empty (0 bytes); replace the file")
    video = _decode_file(
        name if data is None else io.BytesIO(data), name, fps=fps, nframes=nframes, max_frames=max_frames
    )
    if audio_sampling_rate is not None:
        video.audio = decode_sound_track(name if data is None else io.BytesIO(data), name, audio_sampling_rate)
    return video


def decode_sound_track(source, name: str, sampling_rate: int) -> np.ndarray | None:
    """A video file's first audio stream as float32 mono [num_samples] at `sampling_rate`; None without one."""
    import av

    try:
        with av.open(source) as container:
            if not container.streams.audio:
                return None
            stream = container.streams.audio[0]
            # libswresample mixes the channels down and resamples; planar float mono: to_ndarray() is [1, n]
            resampler = av.AudioResampler(format="fltp", layout="mono", rate=int(sampling_rate))
            chunks = []
            for frame in container.decode(stream):
                chunks += [out.to_ndarray()[0] for out in resampler.resample(frame)]
            chunks += [out.to_ndarray()[0] for out in resampler.resample(None)]  # flush
    except Exception as err:  # av.error.* for a corrupt stream
        raise DataError(f"cannot decode the sound track of video {name}: {err}; the file is corrupt") from None
    if not chunks:
        return None
    track = np.ascontiguousarray(np.concatenate(chunks), dtype=np.float32)
    if not np.isfinite(track).all():
        raise DataError(f"the sound track of video {name} has NaN or infinite samples; re-encode the file")
    return track


def sample_frame_indices(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = 2.0,
    nframes: int | None = None,
    max_frames: int | None = None,
    name: str = "video",
) -> list[int]:
    """Indices of the frames to keep: evenly spaced over the clip, an even count of at least 2.

    >>> sample_frame_indices(100, 25.0, fps=2.0)        # 4 s at 2 fps
    [0, 14, 28, 42, 57, 71, 85, 99]
    >>> sample_frame_indices(10, 30.0, fps=1.0)          # shorter than one sample period: 2 frames
    [0, 9]
    >>> sample_frame_indices(100, 25.0, nframes=5)       # odd counts round down
    [0, 33, 66, 99]
    """
    if total_frames < 2:
        raise DataError(f"video {name} has {total_frames} frame(s); at least 2 are needed; drop this video")
    if nframes is not None:
        count = int(nframes)
        if count > total_frames:
            raise DataError(
                f"video {name} has {total_frames} frames, fewer than the {count} asked (nframes); "
                "ask for fewer frames or sample by fps"
            )
    else:
        if video_fps <= 0:
            raise DataError(
                f"video {name} reports no frame rate; sample it with a fixed nframes instead of fps"
            )
        count = round(total_frames / video_fps * fps)
    if max_frames is not None:
        count = min(count, max_frames)
    count = max(2, min(count, total_frames)) // 2 * 2
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def _decode_file(source, name: str, *, fps: float, nframes: int | None, max_frames: int | None) -> Video:
    errors = []
    try:
        import decord
    except ImportError as err:
        errors.append(f"decord: {err}")
    else:
        try:
            reader = decord.VideoReader(source, num_threads=1)
            total, video_fps = len(reader), float(reader.get_avg_fps())
        except Exception as err:  # decord raises RuntimeError/DECORDError for anything it cannot open
            errors.append(f"decord: {err}")
        else:
            indices = sample_frame_indices(
                total, video_fps, fps=fps, nframes=nframes, max_frames=max_frames, name=name
            )
            try:
                frames = reader.get_batch(indices).asnumpy()  # [T, H, W, 3] uint8
            except Exception as err:
                raise DataError(f"cannot decode frames of video {name}: {err}; the file is corrupt") from None
            return _video(frames, indices, total, video_fps)
    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        return _decode_with_pyav(source, name, fps=fps, nframes=nframes, max_frames=max_frames)
    except DataError:
        raise
    except Exception as err:
        errors.append(f"PyAV: {err}")
    raise DataError(f"cannot decode video {name} ({'; '.join(errors)}); the file is corrupt or not a video")


def _decode_with_pyav(source, name: str, *, fps: float, nframes: int | None, max_frames: int | None) -> Video:
    import av

    with av.open(source) as container:
        if not container.streams.video:
            raise DataError(f"video {name} has no video stream; check the file")
        stream = container.streams.video[0]
        video_fps = float(stream.average_rate or stream.guessed_rate or 0)
        total = stream.frames
        if total <= 0:  # some containers do not store a frame count: count by decoding
            total = sum(1 for _ in container.decode(stream))
            container.seek(0)
        indices = sample_frame_indices(
            total, video_fps, fps=fps, nframes=nframes, max_frames=max_frames, name=name
        )
        wanted, frames, position = set(indices), {}, -1
        for position, frame in enumerate(container.decode(stream)):
            if position in wanted:
                frames[position] = frame.to_ndarray(format="rgb24")
            if position >= indices[-1]:
                break
    if len(frames) < len(wanted):
        raise DataError(
            f"video {name} ended after {position + 1} of its {total} frames; the file is truncated"
        )
    return _video(np.stack([frames[i] for i in indices]), indices, total, video_fps)


def _from_frames(refs, *, fps: float, nframes: int | None, max_frames: int | None, media_root) -> Video:
    from mmgrpo.processors.image import load_image

    if len(refs) < 2:
        raise DataError(f"a video given as frames needs at least 2 frames, got {len(refs)}")
    images = [load_image(ref, media_root) for ref in refs]
    if len({image.size for image in images}) > 1:
        sizes = sorted({image.size for image in images})
        raise DataError(
            f"video frames {describe_ref(refs[0])}... have different sizes {sizes}; resize them to one size"
        )
    frames = np.stack([np.asarray(image) for image in images])
    name = f"{describe_ref(refs[0])}... (given as frames)"
    return _from_array(frames, fps=fps, nframes=nframes, max_frames=max_frames, name=name)


def _from_array(
    frames: np.ndarray, *, fps: float, nframes: int | None = None, max_frames: int | None = None, name="array"
) -> Video:
    """Frames taken as a clip recorded at `fps`: all of them, or `nframes` / `max_frames` sampled evenly."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise DataError(f"video array must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    if len(frames) < 2:
        raise DataError(f"a video needs at least 2 frames, got {len(frames)}")
    total = len(frames)
    if nframes is None and max_frames is None:
        indices = list(range(total // 2 * 2))  # an even count (temporal patch of 2): an odd last frame is dropped
    else:
        indices = sample_frame_indices(total, fps, fps=fps, nframes=nframes, max_frames=max_frames, name=name)
    return _video(frames[indices], indices, total, fps)


def _video(frames: np.ndarray, indices: list[int], total: int, video_fps: float) -> Video:
    metadata = {
        "fps": video_fps,
        "total_num_frames": total,
        "frames_indices": indices,
        "duration": total / video_fps if video_fps > 0 else None,
        "width": int(frames.shape[2]),
        "height": int(frames.shape[1]),
    }
    return Video(frames=np.ascontiguousarray(frames), metadata=metadata)
