"""Media as http(s) URLs, against a real HTTP server on 127.0.0.1: downloaded, cached, capped, timed out."""

import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from mmgrpo.data.sample import normalize_row
from mmgrpo.errors import DataError
from mmgrpo.processors.remote import cached_path


def _png(width=8, height=6) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 200, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


class Handler(BaseHTTPRequestHandler):
    hits: dict = {}

    def do_GET(self):  # noqa: N802  (http.server's name)
        Handler.hits[self.path] = Handler.hits.get(self.path, 0) + 1
        routes = {
            "/cat.png": ("image/png", _png()),
            "/big.png": ("image/png", b"\x89PNG" + b"0" * 5000),
            "/page.png": ("text/html", b"<html>a login page</html>"),
            "/garbage.png": ("image/png", b"this is not a png at all"),
        }
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path not in routes:
            self.send_error(404)
            return
        content_type, body = routes[self.path]
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_MEDIA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MMGRPO_MEDIA_TIMEOUT", "1")
    monkeypatch.setenv("MMGRPO_MEDIA_MAX_BYTES", "4096")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Handler.hits = {}
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _sample(url: str):
    return normalize_row({"query": "<image>What colour?", "images": [url], "solution": "grey"}, dataset="web", index=7)


def test_an_image_url_is_downloaded_once_and_cached(server):
    url = f"{server}/cat.png"
    loaded = _sample(url).load_media()
    assert loaded.images[0].size == (8, 6) and loaded.images[0].mode == "RGB"
    assert cached_path(url).is_file() and cached_path(url).suffix == ".png"
    _sample(url).load_media()
    assert Handler.hits["/cat.png"] == 1  # the second load read the cache


@pytest.mark.parametrize("path, message", [
    ("/slow.png", r"no answer within 1 s \(\$MMGRPO_MEDIA_TIMEOUT\)"),
    ("/big.png", r"is 5004 bytes, above the cap of 4096 \(\$MMGRPO_MEDIA_MAX_BYTES\)"),
    ("/page.png", r"answered with text/html, not a image file"),
    ("/garbage.png", r"cannot decode image 'http://127.0.0.1:\d+/garbage.png'.*not an image"),
    ("/missing.png", r"HTTP 404"),
])
def test_bad_urls_are_data_errors_naming_the_sample_and_the_url(server, path, message):
    with pytest.raises(DataError, match=r"sample web/train/7, field 'images\[0\]': .*" + message):
        _sample(f"{server}{path}").load_media()
    if path != "/garbage.png":  # (a file the server sent whole is cached as sent)
        assert not cached_path(f"{server}{path}").exists()  # nothing half-written is left to be read later


def test_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_MEDIA_CACHE", str(tmp_path / "cache"))
    # a port nothing listens on: connection refused, as when offline
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(DataError, match=r"cannot download image URL http://127.0.0.1:\d+/x.png .*offline\?"):
        _sample(f"http://127.0.0.1:{port}/x.png").load_media()
