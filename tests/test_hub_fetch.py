"""HubRepo.fetch lands a range's bytes exactly, whichever way they come: through huggingface_hub's
client (each received chunk copied into the buffer, by numpy from NUMPY_COPY bytes, which lets go of
the GIL, by a memoryview below) or, once the Hub has redirected a file to its CDN, from the socket
straight into the buffer (reshard.sources.rawhttp): its connections kept alive, a dropped kept one
replaced without a retry, a redirect or a proxy left to huggingface_hub's client, a chunked body,
TLS verified as httpx verifies it (SSL_CERT_FILE: tests/fixtures/localhost.pem, a self-signed
certificate for localhost and 127.0.0.1 valid until 2126, with its key in the same file)."""

from __future__ import annotations

import contextlib
import http.server
import os
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import reshard.sources.hubhttp as hubhttp
import reshard.sources.rawhttp as rawhttp
from reshard.io.memory import aligned_buffer
from tests.fixtures.hubrun import REPO, serving

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """The socket path is taken only without proxy variables: a runner that sets them for the package
    index must not decide which path these tests see."""
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fetch")
    data = os.urandom(3 * MIB + 12345)
    (folder / "blob.bin").write_bytes(data)
    with serving(folder) as server:
        yield server, data


def _repo(served, monkeypatch, raw: bool = True) -> hubhttp.HubRepo:
    import huggingface_hub.constants as constants

    server, _ = served
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setenv("RESHARD_HUB_RETRIES", "0")  # a wrong copy fails at once, not after backoffs
    if not raw:
        monkeypatch.setattr(rawhttp, "usable", lambda: False)
    repo = hubhttp.HubRepo(REPO, None)
    assert (repo.raw is not None) == raw
    return repo


@pytest.mark.parametrize(
    "numpy_from, raw", [(1, False), (1 << 40, False), (1, True)], ids=["numpy", "memoryview", "socket"]
)
def test_fetched_ranges_are_the_files_bytes(served, monkeypatch, numpy_from, raw):
    _, data = served
    monkeypatch.setattr(hubhttp, "NUMPY_COPY", numpy_from)
    repo = _repo(served, monkeypatch, raw)
    buf = aligned_buffer(4 * MIB)
    try:
        for pos, n in ((0, len(data)), (7, 2 * MIB + 3), (len(data) - 100, 100), (MIB, 1)):
            out = memoryview(buf)[4096 : 4096 + n]
            repo.fetch("blob.bin", pos, out)
            assert bytes(out) == data[pos : pos + n]
            del out
    finally:
        buf.close()


def test_the_cdn_connection_is_kept_and_a_dropped_one_replaced_without_a_retry(served, monkeypatch, capfd):
    _, data = served
    repo = _repo(served, monkeypatch)
    out = bytearray(1000)
    repo.fetch("blob.bin", 0, memoryview(out))  # the Hub's redirect, through huggingface_hub's client
    repo.fetch("blob.bin", 5, memoryview(out))  # the CDN, straight
    (kept,) = [c for cs in repo.raw.idle.values() for c in cs]
    repo.fetch("blob.bin", 9, memoryview(out))
    assert [c for cs in repo.raw.idle.values() for c in cs] == [kept] and bytes(out) == data[9:1009]
    kept.sock.shutdown(2)  # as a server that closed an idle connection: seen before the request
    repo.fetch("blob.bin", 11, memoryview(out))
    (fresh,) = [c for cs in repo.raw.idle.values() for c in cs]
    assert fresh is not kept and bytes(out) == data[11:1011]
    # closed after the check (select says nothing to read): the request fails, once more on a new one
    monkeypatch.setattr(rawhttp.select, "select", lambda r, w, x, t: ([], [], []))
    fresh.sock.shutdown(2)
    repo.fetch("blob.bin", 13, memoryview(out))
    assert bytes(out) == data[13:1013]
    assert "retrying" not in capfd.readouterr().err


def test_a_redirect_from_the_download_url_is_followed_by_huggingface_hubs_client(served, monkeypatch):
    _, data = served
    repo = _repo(served, monkeypatch)
    out = bytearray(4096)
    repo.fetch("blob.bin", 0, memoryview(out))
    cdn = repo.urls["blob.bin"]
    repo.urls["blob.bin"] = repo.resolve_url("blob.bin")  # answers 302 to the CDN
    repo.fetch("blob.bin", 100, memoryview(out))
    assert bytes(out) == data[100:4196]
    assert repo.urls["blob.bin"] == cdn


def test_a_refused_range_on_the_socket_path_is_one_line_with_what_to_do(served, monkeypatch):
    from reshard.errors import SourceError

    _, data = served
    repo = _repo(served, monkeypatch)
    repo.fetch("blob.bin", 0, memoryview(bytearray(10)))  # the CDN's URL known: the socket path next
    with pytest.raises(SourceError) as e:
        repo.fetch("blob.bin", len(data) + 10, memoryview(bytearray(10)))  # past the end: 416
    assert "answered HTTP 416" in str(e.value) and "run again" in str(e.value)


def test_proxies_and_custom_clients_keep_huggingface_hubs_client(monkeypatch):
    from huggingface_hub.utils import _http

    assert rawhttp.usable()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert not rawhttp.usable()
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", lambda: None)
    assert not rawhttp.usable()
    monkeypatch.undo()
    monkeypatch.delattr(_http, "default_client_factory")  # a huggingface_hub without the private names
    assert not rawhttp.usable()


def _read(pool: rawhttp.Pool, url: str, size: int) -> bytes:
    out = bytearray(size)
    with pool.get(url, {}, 10) as answer:
        k = 0
        while k < size:
            m = answer.readinto1(memoryview(out)[k:])
            assert m > 0
            k += m
    return bytes(out)


@contextlib.contextmanager
def _serving(answer, tls: Path | None = None) -> Iterator[int]:
    """An HTTP/1.1 server on 127.0.0.1 whose GETs `answer(handler)` writes; its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            answer(self)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls)
        httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_tls_is_verified_as_huggingface_hubs_client_verifies_it(monkeypatch):
    body = os.urandom(300_000)

    def plain(h):
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    pem = Path(__file__).parent / "fixtures" / "localhost.pem"
    with _serving(plain, tls=pem) as port:
        url = f"https://localhost:{port}/blob"
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        with pytest.raises(ssl.SSLCertVerificationError):
            _read(rawhttp.Pool(), url, len(body))
        monkeypatch.setenv("SSL_CERT_FILE", str(pem))
        pool = rawhttp.Pool()
        assert _read(pool, url, len(body)) == body
        assert _read(pool, url, len(body)) == body
        assert sum(len(c) for c in pool.idle.values()) == 1  # one connection, kept
        pool.close()


def test_a_chunked_body_is_taken_apart():
    body = os.urandom(70_000)

    def chunked(h):
        h.send_response(206)
        h.send_header("Content-Range", f"bytes 0-{len(body) - 1}/{len(body)}")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for i in range(0, len(body), 30_000):
            piece = body[i : i + 30_000]
            h.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        h.wfile.write(b"0\r\n\r\n")

    pool = rawhttp.Pool()
    with _serving(chunked) as port:
        assert _read(pool, f"http://127.0.0.1:{port}/x", len(body)) == body
    pool.close()
