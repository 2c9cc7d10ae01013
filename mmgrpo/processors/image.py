"""Images: any reference a dataset may hold -> an RGB `PIL.Image`.

A reference is one of: a path (relative to `media_root`, absolute, or `file://`), an http(s) URL
(downloaded once into a cache, mmgrpo/processors/remote.py), raw bytes,
a base64 data URI (`data:image/png;base64,...`), a dict `{"bytes": ..., "path": ...}` (the
Hugging Face `datasets` Image feature with decode=False), a `PIL.Image`, or a uint8 array [H, W, 3].

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

from mmgrpo.errors import DataError
from mmgrpo.processors import describe_ref, resolve_media_path


def load_image(ref, media_root: str | os.PathLike | None = None) -> PIL.Image.Image:
    """Decode `ref` to an RGB image; transparent pixels are composited onto white.

    Raises `DataError` naming the file for a missing, empty or undecodable image.
    """
    if isinstance(ref, PIL.Image.Image):
        return _to_rgb(ref)
    if isinstance(ref, np.ndarray):
        if ref.dtype != np.uint8 or ref.ndim not in (2, 3):
            raise DataError(
                f"image array must be uint8 [H, W] or [H, W, 3], got {ref.dtype} {list(ref.shape)}"
            )
        return _to_rgb(PIL.Image.fromarray(ref))
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
    return _to_rgb(image)


def _to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
