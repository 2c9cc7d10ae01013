"""Images: any reference a dataset may hold -> an RGB `PIL.Image`.

A reference is one of: a path (relative to `media_root`, absolute, or `file://`), an http(s) URL
(downloaded once into a cache, mmgrpo/processors/remote.py), raw bytes,
a base64 data URI (`data:image/png;base64,...`), a dict `{"bytes": ..., "path": ...}` (the
Hugging Face `datasets` Image feature with decode=False), a `PIL.Image`, or an array [H, W] or
[H, W, 3] (uint8; uint16 and float are scaled as below).

Every image is made what a viewer shows: turned upright by its EXIF orientation, and brought to
8 bits per channel by scaling, never by clipping (a 16-bit PNG spans 0-65535, a float TIFF 0-1;
PIL's own `convert("RGB")` would saturate the first to two grey levels and turn the second black):

>>> deep = PIL.Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.uint16))  # 16-bit grey
>>> np.asarray(load_image(deep))[0, :, 0].tolist()
[0, 128, 255]
>>> flat = PIL.Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))    # float, 0-1
>>> np.asarray(load_image(flat))[0, :, 0].tolist()
[0, 128, 255]

>>> load_image(PIL.Image.new("L", (4, 3))).mode, load_image(PIL.Image.new("L", (4, 3))).size
('RGB', (4, 3))
"""

from __future__ import annotations

import base64
import binascii
import io
import os

import numpy as np
import PIL.Image
import PIL.ImageOps

from mmgrpo.errors import DataError
from mmgrpo.processors import describe_ref, resolve_media_path


def load_image(ref, media_root: str | os.PathLike | None = None) -> PIL.Image.Image:
    """Decode `ref` to an RGB image; transparent pixels are composited onto white.

    Raises `DataError` naming the file for a missing, empty or undecodable image.
    """
    if isinstance(ref, PIL.Image.Image):
        return _as_displayed(ref, "image")
    if isinstance(ref, np.ndarray):
        if ref.ndim not in (2, 3) or not (ref.dtype.kind == "u" and ref.dtype.itemsize <= 2 or ref.dtype.kind == "f"):
            raise DataError(
                f"image array must be uint8, uint16 or float [H, W] or [H, W, 3], got {ref.dtype} {list(ref.shape)}"
            )
        return _as_displayed(PIL.Image.fromarray(_array_to_8_bits(ref)), "image array")
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return _decode(ref["bytes"], describe_ref(ref))
        if ref.get("path"):
            return load_image(ref["path"], media_root)
        raise DataError(f"image dict {sorted(ref)} has neither 'bytes' nor 'path'")
    if isinstance(ref, (bytes, bytearray)):
        return _decode(bytes(ref), describe_ref(ref))
    if isinstance(ref, str) and ref.startswith("data:"):
        return _decode(_data_uri_bytes(ref), describe_ref(ref))
    if isinstance(ref, (str, os.PathLike)):
        path = resolve_media_path(ref, media_root, "image")  # an http(s) URL: its cached download
        return _decode(path.read_bytes(), repr(os.fspath(ref)) if str(ref).startswith(("http://", "https://")) else str(path))
    raise DataError(
        f"unsupported image reference of type {type(ref).__name__}; give a path, bytes, "
        "a data URI, a {'bytes', 'path'} dict or a PIL image"
    )


def _data_uri_bytes(uri: str) -> bytes:
    header, _, payload = uri.partition(",")
    if not header.endswith(";base64") or not payload:
        raise DataError(
            f"image data URI {describe_ref(uri)} is not of the form 'data:image/<type>;base64,<data>'"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise DataError(f"image data URI {describe_ref(uri)} holds invalid base64 ({err})") from None


def _decode(data: bytes, name: str) -> PIL.Image.Image:
    if not data:
        raise DataError(f"image {name} is empty (0 bytes); replace the file")
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as err:
        raise DataError(f"cannot decode image {name}: {err}; the file is corrupt or not an image") from None
    return _as_displayed(image, name)


def _as_displayed(image: PIL.Image.Image, name: str) -> PIL.Image.Image:
    """The image as a viewer shows it: upright (EXIF orientation), 8 bits per channel, RGB."""
    try:
        image = PIL.ImageOps.exif_transpose(image)  # a camera's rotated JPEG: its pixels are stored sideways
    except (OSError, SyntaxError, ValueError, TypeError, KeyError) as err:  # a malformed EXIF block
        raise DataError(f"cannot read the EXIF orientation of image {name}: {err}; re-save the image") from None
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        image = _scaled_to_8_bits(image, name)
    return _to_rgb(image)


def _array_to_8_bits(pixels: np.ndarray, name: str = "image array") -> np.ndarray:
    """A uint16 array scaled from 0-65535, a float one from 0-1 (min-max stretched when it lies outside), to uint8.

    >>> _array_to_8_bits(np.array([[0, 65535]], np.uint16)).tolist(), _array_to_8_bits(np.array([[0.0, 0.5]])).tolist()
    ([[0, 255]], [[0, 128]])
    """
    pixels = pixels.astype(pixels.dtype.newbyteorder("="), copy=False)  # a big-endian 16-bit TIFF ("I;16B")
    if pixels.dtype == np.uint8:
        return pixels
    values = pixels.astype(np.float64)
    if pixels.dtype == np.uint16:
        low, high = 0.0, 65535.0
    else:
        if not np.isfinite(values).all():
            raise DataError(f"image {name} has NaN or infinite pixels; re-export it with finite values")
        low, high = (0.0, 1.0) if values.min() >= 0 and values.max() <= 1 else (values.min(), values.max())
    return np.clip(np.rint((values - low) / max(high - low, 1e-12) * 255.0), 0, 255).astype(np.uint8)


def _scaled_to_8_bits(image: PIL.Image.Image, name: str) -> PIL.Image.Image:
    """A 16-bit, 32-bit integer or float grey image -> mode "L" (`_array_to_8_bits`). 32-bit integers
    are read as 8-bit or 16-bit values when they fit in those ranges (a 16-bit PNG an older decoder read)."""
    pixels = np.asarray(image)  # [H, W]
    if image.mode == "I":
        low, high = int(pixels.min()), int(pixels.max())
        pixels = pixels.astype(np.uint8 if 0 <= low and high <= 255 else np.uint16 if 0 <= low and high <= 65535 else np.float64)
    return PIL.Image.fromarray(_array_to_8_bits(pixels, name))  # 2-D uint8: mode "L"


def _to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
