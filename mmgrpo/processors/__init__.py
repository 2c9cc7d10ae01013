"""Media decoding: one function per modality, each turning any supported reference into arrays.

    from mmgrpo.processors import load_image, load_video, load_audio
    load_image("cat.png", media_root="data/")            # PIL.Image, RGB
    load_video("clip.mp4", fps=2.0)                      # Video(frames uint8 [T, H, W, 3], metadata)
    load_audio("speech.flac", sampling_rate=16000)       # float32 mono numpy array

Every failure is a `DataError` naming the file and saying what to do. The decoders are imported
lazily so that `import mmgrpo.processors` does not pull in decord, PyAV or soundfile.
"""

from __future__ import annotations

import os
from pathlib import Path

from mmgrpo.errors import DataError

__all__ = ["load_image", "load_video", "load_audio", "resolve_media_path", "describe_ref"]


def resolve_media_path(ref: str | os.PathLike, media_root: str | os.PathLike | None, kind: str) -> Path:
    """The file a path reference names: absolute as given, relative to `media_root` (or the cwd).

    `file://` prefixes are stripped; an http(s) URL is downloaded into the media cache
    (`mmgrpo/processors/remote.py`) and that file returned; s3:// and gs:// are refused.

    >>> resolve_media_path("a/b.png", "/nowhere", "image")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    mmgrpo.errors.DataError: image file not found: /nowhere/a/b.png (relative to media_root '/nowhere'); ...
    """
    text = os.fspath(ref)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if text.startswith(("http://", "https://")):
        from mmgrpo.processors.remote import download_media

        return download_media(text, kind)
    if text.startswith(("s3://", "gs://")):
        raise DataError(
            f"{kind} reference {text!r} is a bucket URL; mmgrpo downloads http(s) URLs only: "
            "download the file and give its path"
        )
    path = Path(text).expanduser()
    if not path.is_absolute() and media_root is not None:
        path = Path(media_root).expanduser() / path
    if path.exists() and not path.is_file():  # read as media, a FIFO or /dev/zero would block or never end
        raise DataError(
            f"{kind} path {path} is {_file_kind(path)}, not a regular file; point the dataset at the {kind} file itself"
        )
    if not path.is_file():
        where = f" (relative to media_root {os.fspath(media_root)!r})" if media_root is not None else ""
        raise DataError(
            f"{kind} file not found: {path}{where}; check the path in the dataset, "
            "or point the relative paths elsewhere: --media_root for a data file, media_root in its registry entry"
        )
    return path


def _file_kind(path: Path) -> str:
    """What a path that is not a regular file is, in words.

    >>> _file_kind(Path("/dev/null")), _file_kind(Path("/"))
    ('a device file', 'a directory')
    """
    import stat

    mode = path.stat().st_mode
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    return "not a regular file"


def describe_ref(ref) -> str:
    """A short printable name for a media reference, for error messages.

    >>> describe_ref("a.png"), describe_ref(b"123"), describe_ref("data:image/png;base64," + "A" * 99)
    ("'a.png'", '<3 bytes>', "'data:image/png;base64,AAAAAAAAAA...'")
    """
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref)} bytes>"
    if isinstance(ref, (str, os.PathLike)):
        text = os.fspath(ref)
        return repr(text[:32] + "..." if text.startswith("data:") and len(text) > 32 else text)
    if isinstance(ref, dict):
        if ref.get("path"):
            return repr(ref["path"])
        if ref.get("bytes") is not None:
            return f"<{len(ref['bytes'])} bytes>"
    return f"<{type(ref).__name__}>"


def __getattr__(name):
    if name == "load_image":
        from mmgrpo.processors.image import load_image

        return load_image
    if name == "load_video":
        from mmgrpo.processors.video import load_video

        return load_video
    if name == "load_audio":
        from mmgrpo.processors.audio import load_audio

        return load_audio
    raise AttributeError(f"module 'mmgrpo.processors' has no attribute {name!r}")
