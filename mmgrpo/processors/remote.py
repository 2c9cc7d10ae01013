"""Media given as http(s) URLs: downloaded once, with a timeout and a size cap, into an on-disk cache.

    path = download_media("https://example.com/cat.png", "image")   # -> ~/.cache/mmgrpo/media/<sha256>.png

A dataset may hold URLs wherever it holds paths (images, videos, audio files). Settings, read from
the environment so DataLoader workers see them too:

    MMGRPO_MEDIA_TIMEOUT     seconds to connect and between bytes (default 20)
    MMGRPO_MEDIA_MAX_BYTES   the largest file accepted (default 64 MiB)
    MMGRPO_MEDIA_CACHE       the cache folder (default ~/.cache/mmgrpo/media)

A cached URL is never fetched again (delete the file to refresh it). Every failure (offline, timeout,
HTTP error, too large, a server answering with HTML where an image was expected) is a `DataError`
naming the URL; the data loader adds the sample and field.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from mmgrpo.errors import DataError

DEFAULT_TIMEOUT_S = 20.0
DEFAULT_MAX_BYTES = 64 * 2**20
URL_PREFIXES = ("http://", "https://")
_CHUNK = 1 << 16


def is_url(ref) -> bool:
    """Whether a media reference is an http(s) URL.

    >>> is_url("https://a.b/c.png"), is_url("c.png"), is_url(b"http")
    (True, False, False)
    """
    return isinstance(ref, str) and ref.startswith(URL_PREFIXES)


def cache_dir() -> Path:
    return Path(os.environ.get("MMGRPO_MEDIA_CACHE") or Path.home() / ".cache" / "mmgrpo" / "media").expanduser()


def cached_path(url: str) -> Path:
    """Where `url` is cached: its sha256, with the URL path's extension (decoders may read it)."""
    suffix = Path(urllib.request.urlparse(url).path).suffix.lower()
    suffix = suffix if suffix.isascii() and 1 < len(suffix) <= 6 else ""
    return cache_dir() / (hashlib.sha256(url.encode()).hexdigest() + suffix)


def _setting(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise DataError(f"${name}={value!r} is not a number") from None


def download_media(url: str, kind: str) -> Path:
    """The local file of `url` (downloaded now unless cached); `kind` is image | video | audio."""
    path = cached_path(url)
    if path.is_file():
        return path
    timeout = _setting("MMGRPO_MEDIA_TIMEOUT", DEFAULT_TIMEOUT_S)
    max_bytes = int(_setting("MMGRPO_MEDIA_MAX_BYTES", DEFAULT_MAX_BYTES))
    request = urllib.request.Request(url, headers={"User-Agent": "mmgrpo"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            content_type = (response.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if content_type.startswith(("text/", "application/json")):
                raise DataError(f"{kind} URL {url} answered with {content_type}, not a {kind} file; check the URL")
            length = response.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise DataError(_too_large(kind, url, int(length), max_bytes))
            data = bytearray()
            while chunk := response.read(_CHUNK):
                data += chunk
                if len(data) > max_bytes:
                    raise DataError(_too_large(kind, url, len(data), max_bytes, at_least=True))
    except DataError:
        raise
    except urllib.error.HTTPError as err:
        raise DataError(f"{kind} URL {url}: HTTP {err.code} {err.reason}") from None
    except TimeoutError:
        raise DataError(f"{kind} URL {url}: no answer within {timeout:g} s ($MMGRPO_MEDIA_TIMEOUT); "
                        "download it yourself and give the path") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise DataError(f"{kind} URL {url}: no answer within {timeout:g} s ($MMGRPO_MEDIA_TIMEOUT); "
                            "download it yourself and give the path") from None
        raise DataError(f"cannot download {kind} URL {url} ({reason}); offline? download it and give the path") from None
    if not data:
        raise DataError(f"{kind} URL {url} sent 0 bytes")
    path.parent.mkdir(parents=True, exist_ok=True)
    # written to a temporary file and renamed: DataLoader workers may fetch the same URL at once
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".part") as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)
    return path


def _too_large(kind: str, url: str, size: int, max_bytes: int, at_least: bool = False) -> str:
    return (f"{kind} URL {url} is {'over ' if at_least else ''}{size} bytes, above the cap of {max_bytes} "
            "($MMGRPO_MEDIA_MAX_BYTES); raise the cap or give a smaller file")
