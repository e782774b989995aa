"""Range GETs from a download URL (the Hub's CDN) read straight into the caller's buffer.

huggingface_hub's client (httpx over httpcore and h11) hands a body over as 64 KiB bytes objects,
each copied three times on the way (h11's receive buffer, its slice, httpcore's bytes()) under the
GIL: at Hub speeds most of a --stream save's CPU. Here a body goes from the socket into the
buffer with one recv_into (`readinto1`, the GIL let go), over http.client, keeping the connections
alive as httpcore does (RESHARD_HUB_CONNECTIONS idle per host).

Only the direct requests take this path: the Hub's resolve request (its token, its redirect, its
errors) stays with huggingface_hub's client, and so does everything when a proxy variable is set or
the client factory is not huggingface_hub's own (`usable`). TLS uses the context httpx would build
(SSL_CERT_FILE / SSL_CERT_DIR honoured). A redirect from the download URL is not followed here
(`Redirected`: the caller asks huggingface_hub's client instead).
"""

from __future__ import annotations

import http.client
import select
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from reshard import settings


class Redirected(Exception):
    """The download URL answered a redirect: huggingface_hub's client follows it."""


def usable() -> bool:
    """No proxy variable set and huggingface_hub's default client: what that client would do is a
    plain connection to the URL's host."""
    proxies = urllib.request.getproxies_environment()  # *_proxy, either case, as httpx reads them
    if any(proxies.get(scheme) for scheme in ("http", "https", "all")):
        return False
    from huggingface_hub.utils import _http

    default = getattr(_http, "default_client_factory", None)  # private names: absent, the client is used
    return default is not None and getattr(_http, "_GLOBAL_CLIENT_FACTORY", None) is default


class Answer:
    """One response: its status, headers and URL; `readinto1` fills a buffer with body bytes."""

    def __init__(self, url: str, resp: http.client.HTTPResponse) -> None:
        self.url = url
        self.status_code = resp.status
        self.headers = resp.headers
        self.history: list[Any] = []
        self._resp = resp
        self.left = resp.length  # body bytes still to come (None: chunked, or until the server closes)

    def readinto1(self, out: memoryview) -> int:
        """At most len(out) body bytes as soon as some are there; 0 at the body's end."""
        if self.left is not None:
            if self.left <= 0:
                return 0
            if len(out) > self.left:
                out = out[: self.left]
        if self._resp.chunked:  # http.client takes the chunks apart (a copy more; CDNs send lengths)
            data = self._resp.read1(len(out))
            out[: len(data)] = data
            return len(data)
        fp = self._resp.fp
        n = fp.readinto1(out) if fp is not None else 0
        if self.left is not None:
            self.left -= n
        return n


class Pool:
    """Keep-alive HTTP/1.1 connections per (scheme, host, port), shared by the reading threads."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self.lock = threading.Lock()
        self._ssl: Any = None

    def _new(self, scheme: str, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
        if scheme == "https":
            if self._ssl is None:
                import httpx2

                self._ssl = httpx2.create_ssl_context()
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _take(self, key: tuple[str, str, int]) -> http.client.HTTPConnection | None:
        """An idle connection the server has not closed (nothing to read on it), or None."""
        while True:
            with self.lock:
                conns = self.idle.get(key)
                if not conns:
                    return None
                conn = conns.pop()
            sock = conn.sock
            if sock is not None and not select.select([sock], [], [], 0)[0]:
                return conn
            conn.close()  # closed by the server (EOF readable) or sent what nobody asked for

    def _give(self, key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self.lock:
            conns = self.idle.setdefault(key, [])
            if len(conns) < max(1, settings.HUB_CONNECTIONS.get()):
                conns.append(conn)
                return
        conn.close()

    @contextmanager
    def get(self, url: str, headers: dict[str, str], timeout: float) -> Iterator[Answer]:
        """GET `url`; the connection goes back to the pool if the whole body was read."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url[:80]}")
        port = parts.port or (443 if scheme == "https" else 80)
        key = (scheme, parts.hostname, port)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        conn = self._take(key)
        reused = conn is not None
        while True:
            if conn is None:
                conn = self._new(scheme, parts.hostname, port, timeout)
            try:
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                if not reused:
                    raise
                conn, reused = None, False  # a kept connection the server dropped meanwhile: once more, fresh
            except BaseException:
                conn.close()
                raise
        answer = Answer(url, resp)
        done = False
        try:
            if 300 <= resp.status < 400 and resp.getheader("Location"):
                raise Redirected(resp.getheader("Location"))
            yield answer
            done = answer.left == 0 and not resp.will_close
        finally:
            resp.close()  # the socket stays with `conn`: kept if the body was all read, else closed
            if done:
                self._give(key, conn)
            else:
                conn.close()

    def close(self) -> None:
        with self.lock:
            conns = [c for cs in self.idle.values() for c in cs]
            self.idle.clear()
        for conn in conns:
            conn.close()
