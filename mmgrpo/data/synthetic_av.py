"""Synthetic video and audio datasets, made like the shapes ones (mmgrpo/data/synthetic.py).

Each generator draws one row from a numpy Generator and returns (medium, row); `synthetic.generate`
asks the medium to write itself under the dataset folder and puts the path it returns into the
row's `videos` / `audios` column. Same seed and sizes, same bytes (PyAV and libsndfile encode
deterministically), so the cache folder's hash names its content.

- `shapes-motion`: a circle, square or triangle moving left, right, up or down over 8 frames of
  64x64 (2 seconds at 4 fps), an MPEG-4 `.mp4` written with PyAV; "Which way does the shape
  move?"; solution: one word, e.g. "left".
- `shapes-motion-frames`: the same task with each clip as a list of 8 PNG frames
  (`"videos": [["videos/train/000000/0.png", ...]]`), the other way a dataset can give a video.
- `tones-pitch`: a 1 s sine tone, low (about 220 Hz) or high (about 880 Hz), 16 kHz mono `.wav`;
  "Is the tone high or low?"; solution "low" or "high".
- `tones-count`: 1-4 short beeps in 1.5 s, 16 kHz mono `.wav`; "How many beeps?"; solution the
  digit, e.g. "3".

Every row carries an assistant turn `<answer>X</answer>` (`reference_response`, for SFT).

    rng = np.random.default_rng(0)
    clip, row = GENERATORS["tones-pitch"](rng, 64)      # AudioClip, {"messages": ..., "solution": "high"}
    clip.save(folder, "audios/train/000000")            # -> "audios/train/000000.wav"
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmgrpo.data.drawing import COLOURS, SHAPES, draw_shape, jitter

DIRECTIONS = ("left", "right", "up", "down")
MOTION_FRAMES = 8  # frames per clip
MOTION_FPS = 4  # frames per second of the clip: 2 seconds of video
SAMPLING_RATE = 16000  # Hz, what the Whisper-style feature extractors of the audio families expect
PITCHES = {"low": 220.0, "high": 880.0}  # Hz, two octaves apart


@dataclass
class VideoClip:
    """uint8 frames [T, H, W, 3] written as an mp4 (MPEG-4 part 2), or as PNG frames with `as_frames`."""

    frames: np.ndarray
    fps: int
    as_frames: bool = False
    column = "videos"

    def save(self, out_dir: Path, stem: str) -> str | list[str]:
        if self.as_frames:
            import PIL.Image

            (Path(out_dir) / stem).mkdir(parents=True, exist_ok=True)
            refs = [f"{stem}/{t}.png" for t in range(len(self.frames))]
            for ref, frame in zip(refs, self.frames):
                PIL.Image.fromarray(frame).save(Path(out_dir) / ref, format="PNG")
            return refs
        relative = f"{stem}.mp4"
        path = Path(out_dir) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        write_mp4(path, self.frames, self.fps)
        return relative


@dataclass
class AudioClip:
    """float32 mono samples in [-1, 1] written as a 16-bit PCM wav."""

    samples: np.ndarray
    sampling_rate: int = SAMPLING_RATE
    column = "audios"

    def save(self, out_dir: Path, stem: str) -> str:
        import soundfile

        relative = f"{stem}.wav"
        path = Path(out_dir) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(path, self.samples, self.sampling_rate, subtype="PCM_16", format="WAV")
        return relative


def write_mp4(path: str | os.PathLike, frames: np.ndarray, fps: int) -> None:
    """uint8 frames [T, H, W, 3] (H, W even) -> an mp4 file; the same frames give the same bytes."""
    import av

    with av.open(os.fspath(path), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)  # in every FFmpeg build, unlike libx264
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 1_000_000  # far more than 64x64 needs: colours survive the compression
        stream.thread_count = 1  # one thread: deterministic output
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush


def _shapes_motion(rng: np.random.Generator, size: int, *, as_frames: bool = False) -> tuple[VideoClip, dict]:
    import PIL.Image
    import PIL.ImageDraw


    direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    rgb = jitter(rng, COLOURS[colour])
    grey = int(rng.integers(200, 256))
    side = int(rng.integers(int(size * 0.2), int(size * 0.3) + 1))
    travel = int(rng.integers(int(size * 0.35), size - side + 1))  # how far it moves over the clip
    start = int(rng.integers(0, size - side - travel + 1))  # along the motion, before flipping
    across = int(rng.integers(0, size - side + 1))  # the other coordinate stays put
    frames = []
    for t in range(MOTION_FRAMES):
        along = start + round(travel * t / (MOTION_FRAMES - 1))
        if direction in ("left", "up"):
            along = size - side - along  # mirror: moves towards 0
        x0, y0 = (along, across) if direction in ("left", "right") else (across, along)
        image = PIL.Image.new("RGB", (size, size), (grey, grey, grey))
        draw_shape(PIL.ImageDraw.Draw(image), shape, (x0, y0, x0 + side, y0 + side), rgb)
        frames.append(np.asarray(image))
    row = {
        "messages": [
            {"role": "user", "content": "<video>Which way does the shape move?"},
            {"role": "assistant", "content": f"<answer>{direction}</answer>"},
        ],
        "solution": direction,
        "shape": shape,
        "colour": colour,
    }
    return VideoClip(np.stack(frames), MOTION_FPS, as_frames=as_frames), row


def _shapes_motion_frames(rng: np.random.Generator, size: int) -> tuple[VideoClip, dict]:
    return _shapes_motion(rng, size, as_frames=True)


def _tone(frequency: float, seconds: float, amplitude: float, phase: float) -> np.ndarray:
    """A sine with 10 ms raised-cosine ramps at both ends (no clicks). float32 [seconds * rate]."""
    t = np.arange(int(round(seconds * SAMPLING_RATE))) / SAMPLING_RATE
    wave = amplitude * np.sin(2 * np.pi * frequency * t + phase)
    ramp = min(len(t) // 2, int(0.01 * SAMPLING_RATE))
    envelope = np.ones_like(t)
    envelope[:ramp] = 0.5 - 0.5 * np.cos(np.pi * np.arange(ramp) / ramp)
    envelope[len(t) - ramp :] = envelope[:ramp][::-1]
    return (wave * envelope).astype(np.float32)


def _tones_pitch(rng: np.random.Generator, size: int) -> tuple[AudioClip, dict]:
    pitch = ("low", "high")[int(rng.integers(2))]
    frequency = PITCHES[pitch] * float(rng.uniform(0.97, 1.03))  # a little jitter around the note
    samples = _tone(frequency, 1.0, float(rng.uniform(0.3, 0.8)), float(rng.uniform(0, 2 * np.pi)))
    row = {
        "messages": [
            {"role": "user", "content": "<audio>Is the tone high or low?"},
            {"role": "assistant", "content": f"<answer>{pitch}</answer>"},
        ],
        "solution": pitch,
        "frequency": round(frequency, 1),
    }
    return AudioClip(samples), row


def _tones_count(rng: np.random.Generator, size: int) -> tuple[AudioClip, dict]:
    count = int(rng.integers(1, 5))
    frequency = float(rng.uniform(500, 1000))
    amplitude = float(rng.uniform(0.3, 0.8))
    samples = np.zeros(int(1.5 * SAMPLING_RATE), dtype=np.float32)  # [24000]: 1.5 s
    position = float(rng.uniform(0.05, 0.2))  # seconds; at most 0.2 + 4 * 0.1 + 3 * 0.15 = 1.05 s used
    for _ in range(count):
        beep = _tone(frequency, 0.1, amplitude, 0.0)
        first = int(position * SAMPLING_RATE)
        samples[first : first + len(beep)] = beep
        position += 0.1 + float(rng.uniform(0.08, 0.15))  # the beep, then a silent gap
    row = {
        "messages": [
            {"role": "user", "content": "<audio>How many beeps?"},
            {"role": "assistant", "content": f"<answer>{count}</answer>"},
        ],
        "solution": str(count),
    }
    return AudioClip(samples), row


GENERATORS = {
    "shapes-motion": _shapes_motion,
    "shapes-motion-frames": _shapes_motion_frames,
    "tones-pitch": _tones_pitch,
    "tones-count": _tones_count,
}
