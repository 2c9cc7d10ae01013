"""Media decoding: every kind of reference, and a DataError naming the file for every failure."""

import base64
import io
import sys

import av
import numpy as np
import PIL.Image
import pytest
import soundfile

from mmgrpo.data.sample import Video
from mmgrpo.errors import DataError
from mmgrpo.processors.audio import load_audio
from mmgrpo.processors.image import load_image
from mmgrpo.processors.video import load_video, sample_frame_indices


def png_bytes(colour="red", size=(6, 4), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new(mode, size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_mp4(path, num_frames=20, fps=10, size=32):
    """Frame i is a flat grey of level 10 * i, so a decoded frame tells its index."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 10 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "red.png").write_bytes(png_bytes())
    (root / "empty.png").write_bytes(b"")
    (root / "broken.png").write_bytes(b"\x89PNG not really")
    write_mp4(root / "clip.mp4")
    (root / "broken.mp4").write_bytes(b"junk" * 64)
    (root / "empty.mp4").write_bytes(b"")
    t = np.arange(8000) / 8000
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 440 * t)], axis=1).astype(np.float32)
    soundfile.write(root / "tone.wav", stereo, 8000)
    soundfile.write(root / "tone.flac", stereo[:, 0], 8000)
    (root / "broken.wav").write_bytes(b"RIFF....garbage")
    (root / "empty.wav").write_bytes(b"")
    return root


# ---- images ----------------------------------------------------------------------------------------


def test_image_reference_kinds(media):
    data = png_bytes()
    refs = [
        "red.png",  # relative to media_root
        str(media / "red.png"),  # absolute
        f"file://{media / 'red.png'}",
        data,
        "data:image/png;base64," + base64.b64encode(data).decode(),
        {"bytes": data, "path": "ignored.png"},  # HF datasets Image feature, decode=False
        {"bytes": None, "path": "red.png"},
        PIL.Image.open(io.BytesIO(data)),
        np.full((4, 6, 3), (255, 0, 0), np.uint8),
    ]
    for ref in refs:
        image = load_image(ref, media_root=media)
        assert image.mode == "RGB" and image.size == (6, 4), ref
        assert image.getpixel((0, 0)) == (255, 0, 0), ref


def test_transparent_image_goes_onto_white():
    image = load_image(png_bytes(colour=(0, 0, 0, 0), mode="RGBA"))
    assert image.mode == "RGB" and image.getpixel((1, 1)) == (255, 255, 255)


@pytest.mark.parametrize(
    "ref, needles",
    [
        ("missing.png", ["not found", "missing.png", "media_root"]),
        ("empty.png", ["empty.png", "empty"]),
        ("broken.png", ["broken.png", "cannot decode"]),
        ("data:image/png;base64,@@@", ["base64"]),
        ("data:image/png,abc", ["data URI"]),
        ("https://example.com/a.png", ["URL", "download"]),
        (12, ["unsupported image reference"]),
        ({"path": None}, ["neither 'bytes' nor 'path'"]),
    ],
)
def test_image_errors(media, ref, needles):
    with pytest.raises(DataError) as caught:
        load_image(ref, media_root=media)
    for needle in needles:
        assert needle in str(caught.value)


# ---- video -----------------------------------------------------------------------------------------


def test_video_sampled_by_fps(media):
    video = load_video("clip.mp4", fps=2.0, media_root=media)  # 20 frames at 10 fps = 2 s -> 4 frames
    assert isinstance(video, Video)
    assert video.frames.shape == (4, 32, 32, 3) and video.frames.dtype == np.uint8
    meta = video.metadata
    assert meta["fps"] == 10.0 and meta["total_num_frames"] == 20 and meta["duration"] == 2.0
    assert meta["frames_indices"] == [0, 6, 13, 19]
    levels = video.frames[:, 16, 16, 0].astype(int)
    # the right frames, codec noise aside
    assert np.all(np.abs(levels - 10 * np.array(meta["frames_indices"])) <= 6)


def test_video_fixed_frame_count_is_even(media):
    assert load_video(media / "clip.mp4", nframes=5).frames.shape[0] == 4
    assert load_video(media / "clip.mp4", nframes=20).metadata["frames_indices"] == list(range(20))
    assert load_video(media / "clip.mp4", fps=100.0, max_frames=6).frames.shape[0] == 6


def test_video_from_bytes_dict_and_frames(media):
    data = (media / "clip.mp4").read_bytes()
    assert load_video(data, nframes=4).frames.shape == (4, 32, 32, 3)
    assert load_video({"bytes": data, "path": None}, nframes=2).frames.shape[0] == 2
    assert load_video({"bytes": None, "path": "clip.mp4"}, nframes=2, media_root=media).frames.shape[0] == 2
    frames = [png_bytes(colour=(10 * i, 0, 0)) for i in range(5)]
    video = load_video(frames, fps=1.0)  # frames as given; an odd last frame is dropped
    assert video.frames.shape == (4, 4, 6, 3)
    assert video.metadata["fps"] == 1.0 and video.metadata["frames_indices"] == [0, 1, 2, 3]
    assert video.frames[3, 0, 0, 0] == 30


def test_video_falls_back_to_pyav(media, monkeypatch):
    expected = load_video(media / "clip.mp4", nframes=4)
    monkeypatch.setitem(sys.modules, "decord", None)  # `import decord` now raises ImportError
    fallback = load_video(media / "clip.mp4", nframes=4)
    assert fallback.metadata["frames_indices"] == expected.metadata["frames_indices"]
    assert fallback.metadata["total_num_frames"] == 20 and fallback.metadata["fps"] == 10.0
    assert np.abs(fallback.frames.astype(int) - expected.frames.astype(int)).max() <= 3
    with pytest.raises(DataError, match="broken.mp4"):
        load_video(media / "broken.mp4")


@pytest.mark.parametrize(
    "ref, kwargs, needles",
    [
        ("missing.mp4", {}, ["not found", "missing.mp4"]),
        ("empty.mp4", {}, ["empty.mp4", "empty"]),
        ("broken.mp4", {}, ["broken.mp4", "cannot decode"]),
        ("clip.mp4", {"nframes": 30}, ["clip.mp4", "20 frames", "fewer than the 30"]),
        (["red.png"], {}, ["at least 2 frames"]),
    ],
)
def test_video_errors(media, ref, kwargs, needles):
    with pytest.raises(DataError) as caught:
        load_video(ref, media_root=media, **kwargs)
    for needle in needles:
        assert needle in str(caught.value)


def test_frame_indices_need_two_frames():
    with pytest.raises(DataError, match="1 frame"):
        sample_frame_indices(1, 30.0)
    with pytest.raises(DataError, match="no frame rate"):
        sample_frame_indices(10, 0.0, fps=2.0)


# ---- audio -----------------------------------------------------------------------------------------


def test_audio_reference_kinds(media):
    wav = load_audio("tone.wav", sampling_rate=16000, media_root=media)  # 1 s stereo at 8 kHz
    assert wav.dtype == np.float32 and wav.shape == (16000,)
    # a full-scale sine keeps its RMS through channel mixing and resampling
    assert abs(np.sqrt(np.mean(wav**2)) - np.sqrt(0.5)) < 0.02
    assert load_audio(str(media / "tone.flac"), 8000).shape == (8000,)
    assert load_audio((media / "tone.flac").read_bytes(), 16000).shape == (16000,)
    assert load_audio({"bytes": None, "path": "tone.wav"}, 8000, media_root=media).shape == (8000,)
    wave = np.zeros(4000, np.float64)
    assert load_audio((wave, 4000), 16000).shape == (16000,)
    assert load_audio({"array": wave, "sampling_rate": 4000}, 8000).shape == (8000,)
    bare = load_audio(np.zeros(100, np.float32), 16000)
    assert bare.shape == (100,) and bare.dtype == np.float32
    assert load_audio(np.zeros((2, 100), np.float32), 16000).shape == (100,)  # [channels, frames]


@pytest.mark.parametrize(
    "ref, needles",
    [
        ("missing.wav", ["not found", "missing.wav"]),
        ("empty.wav", ["empty.wav", "empty"]),
        ("broken.wav", ["broken.wav", "cannot decode"]),
        ((np.zeros(10), 0), ["sampling rate 0"]),
        ((np.zeros(10), "fast"), ["sampling rate 'fast'"]),
        ((np.zeros(0), 16000), ["no samples"]),
        ({"array": np.zeros(10)}, ["sampling rate None"]),
        (3.5, ["unsupported audio reference"]),
    ],
)
def test_audio_errors(media, ref, needles):
    with pytest.raises(DataError) as caught:
        load_audio(ref, 16000, media_root=media)
    for needle in needles:
        assert needle in str(caught.value)
