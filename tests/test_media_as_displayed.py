"""Media read as a viewer or a player shows it (issue 49, kind 3): deep images scaled to 8 bits,
EXIF orientation applied, non-regular files refused as such, NaN audio refused, audio longer than
the encoder takes cut with one warning per dataset."""

import io
import logging
import os

import numpy as np
import PIL.Image
import pytest
import soundfile

from mmgrpo.data.sample import Sample
from mmgrpo.errors import DataError
from mmgrpo.processors.audio import load_audio
from mmgrpo.processors.image import load_image
from mmgrpo.processors.video import load_video

RAMP = np.linspace(0, 1, 16 * 8).reshape(8, 16)  # [H, W]: a grey ramp from black to white


def _encoded(array: np.ndarray, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    PIL.Image.fromarray(array).save(out, format=fmt, **save)
    return out.getvalue()


def _rotated_jpeg() -> bytes:
    """A 16x8 JPEG, left half black, stored with EXIF orientation 6: a viewer shows it 8x16, black on top."""
    pixels = np.zeros((8, 16, 3), np.uint8)
    pixels[:, 8:] = 255
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="JPEG", exif=exif, quality=95)
    return out.getvalue()


DEEP_IMAGES = {
    "16-bit PNG": lambda: _encoded((RAMP * 65535).astype(np.uint16), "PNG"),
    "float TIFF": lambda: _encoded(RAMP.astype(np.float32), "TIFF"),
    "32-bit integer TIFF holding 16-bit values": lambda: _encoded((RAMP * 65535).astype(np.int32), "TIFF"),
    "16-bit big-endian TIFF": lambda: _encoded((RAMP * 65535).astype(">u2"), "TIFF"),
}
DEEP_ARRAYS = {
    "uint16": lambda: (RAMP * 65535).astype(np.uint16),
    "float32 0-1": lambda: RAMP.astype(np.float32),
    "float64 0-1000": lambda: RAMP * 1000,
}


@pytest.mark.parametrize("kind", sorted(DEEP_ARRAYS))
def test_deep_arrays_are_scaled_to_8_bits(kind):
    grey = np.asarray(load_image(DEEP_ARRAYS[kind]()))[:, :, 0].astype(int)
    assert np.abs(grey - np.rint(RAMP * 255)).max() <= 1, (kind, grey.min(), grey.max())


@pytest.mark.parametrize("form", ["path", "bytes", "dict", "data URI", "video frame"])
@pytest.mark.parametrize("kind", sorted(DEEP_IMAGES))
def test_deep_images_are_scaled_to_8_bits(kind, form, tmp_path):
    data = DEEP_IMAGES[kind]()
    (tmp_path / "deep.img").write_bytes(data)
    refs = {
        "path": "deep.img",
        "bytes": data,
        "dict": {"bytes": data, "path": None},
        "data URI": "data:image/png;base64," + __import__("base64").b64encode(data).decode(),
    }
    if form == "video frame":
        grey = load_video([data, data], fps=1.0).frames[0, :, :, 0].astype(int)  # [H, W]
    else:
        grey = np.asarray(load_image(refs[form], media_root=tmp_path))[:, :, 0].astype(int)
    expected = np.rint(RAMP * 255)
    assert np.abs(grey - expected).max() <= 1, (kind, grey.min(), grey.max(), len(np.unique(grey)))


def test_rotated_jpeg_is_upright(tmp_path):
    (tmp_path / "rotated.jpg").write_bytes(_rotated_jpeg())
    for ref in ("rotated.jpg", _rotated_jpeg(), PIL.Image.open(io.BytesIO(_rotated_jpeg()))):
        image = load_image(ref, media_root=tmp_path)
        assert image.size == (8, 16)  # (width, height): turned upright
        grey = np.asarray(image)[:, :, 0].astype(int)
        assert grey[:6].mean() < 30 and grey[-6:].mean() > 225  # the black half is on top


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    return tmp_path / "pipe", "named pipe"


NON_REGULAR = {
    "FIFO": _fifo,
    "directory": lambda tmp_path: ((tmp_path / "folder.png").mkdir() or tmp_path / "folder.png", "directory"),
    "/dev/zero": lambda tmp_path: ("/dev/zero", "device file"),
}
LOADERS = {
    "image": lambda ref: load_image(ref),
    "video": lambda ref: load_video(ref),
    "audio": lambda ref: load_audio(ref),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("what", sorted(NON_REGULAR))
def test_non_regular_files_are_refused_as_such(what, loader, tmp_path):
    path, words = NON_REGULAR[what](tmp_path)
    with pytest.raises(DataError) as err:
        LOADERS[loader](str(path))
    assert words in str(err.value) and "not a regular file" in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_audio_with_non_finite_samples_is_refused_naming_the_file(bad, tmp_path):
    samples = np.zeros(1600, np.float32)
    samples[100] = bad
    soundfile.write(tmp_path / "bad.wav", samples, 16000, subtype="FLOAT")
    with pytest.raises(DataError, match=r"bad\.wav has 1 NaN or infinite sample"):
        load_audio(str(tmp_path / "bad.wav"))
    with pytest.raises(DataError, match="NaN or infinite"):
        load_audio((samples, 16000))


def test_long_audio_is_cut_to_the_encoder_with_one_warning_per_dataset(caplog):
    from mmgrpo.config.schema import ModelConfig
    from mmgrpo.data.prompt_batches import media_options
    from mmgrpo.models import load_processor
    from mmgrpo.models.tiny import build_tiny
    from mmgrpo.templates import get_template

    template = get_template("qwen2-audio", load_processor(str(build_tiny("qwen2-audio"))))

    options = media_options(template, ModelConfig())
    limit = template.max_audio_samples
    assert options["max_audio_samples"] == limit == 30 * 16000  # Whisper's 30 s chunk

    def sample(dataset, index, seconds):
        clip = (np.zeros(int(seconds * 16000), np.float32), 16000)
        return Sample(id=f"{dataset}/train/{index}", messages=[], audios=[clip])

    with caplog.at_level(logging.WARNING, logger="mmgrpo.data"):
        first = sample("long-talks", 0, 45).load_media(**options)
        sample("long-talks", 1, 50).load_media(**options)
        sample("short-talks", 0, 10).load_media(**options)
        sample("other-talks", 0, 31).load_media(**options)
    assert len(first.audios[0]) == limit
    lines = [r.getMessage() for r in caplog.records if "cut" in r.getMessage()]
    assert len(lines) == 2, lines  # one per dataset that has a long clip
    assert "long-talks/train/0" in lines[0] and "45.0 s" in lines[0] and "15.0 s are cut" in lines[0]
    assert "other-talks" in lines[1] and "1.0 s are cut" in lines[1]
