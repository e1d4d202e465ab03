"""A small forwarding HTTP proxy on 127.0.0.1, for the model reader's proxy tests.

It does what a proxy such as squid does for the two kinds of request a client sends it:

``CONNECT host:port``
    opens a TCP connection to ``host:port``, answers ``200``, then copies bytes both ways
    (the tunnel an ``https`` request goes through: the proxy sees no header of it);
``GET http://host:port/path``
    (a request with an absolute URL) forwards it to ``host:port`` with the origin-form
    path, ``Connection: close`` and no ``Proxy-*`` header, and copies the answer back.

With ``credentials`` set (``user:password``) a request without the matching
``Proxy-Authorization: Basic`` is answered ``407``. Every request is recorded
(:attr:`ForwardProxy.seen`: its method, target and header names; never a header's value).
It runs on threads, so blocking and asynchronous clients can use it alike.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import socketserver
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["ForwardProxy", "Seen"]


@dataclass(frozen=True)
class Seen:
    method: str
    target: str
    headers: frozenset[str]  # the header names, lower case (never a value)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        line = self.rfile.readline(65537).decode("latin-1").rstrip("\r\n")
        if not line:
            return
        method, target, _version = line.split(" ", 2)
        headers: list[tuple[str, str]] = []
        while (raw := self.rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
            name, _, value = raw.decode("latin-1").partition(":")
            headers.append((name.strip(), value.strip()))
        names = frozenset(name.lower() for name, _ in headers)
        proxy = self.server.owner
        with proxy.lock:
            proxy.seen.append(Seen(method, target, names))
        if proxy.credentials is not None:
            wanted = "Basic " + base64.b64encode(proxy.credentials.encode()).decode()
            sent = [v for n, v in headers if n.lower() == "proxy-authorization"]
            if sent != [wanted]:
                self.wfile.write(
                    b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                    b'Proxy-Authenticate: Basic realm="test"\r\nContent-Length: 0\r\n'
                    b"Connection: close\r\n\r\n"
                )
                return
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            upstream = socket.create_connection((host.strip("[]"), int(port)))
            self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            self.wfile.flush()
        else:
            url = urlsplit(target)
            upstream = socket.create_connection((url.hostname or "", url.port or 80))
            path = url.path or "/"
            if url.query:
                path += "?" + url.query
            kept = [
                f"{n}: {v}\r\n"
                for n, v in headers
                if not n.lower().startswith("proxy-") and n.lower() != "connection"
            ]
            head = f"{method} {path} HTTP/1.1\r\n" + "".join(kept) + "Connection: close\r\n\r\n"
            upstream.sendall(head.encode("latin-1"))
        with upstream:
            back = threading.Thread(target=_pipe, args=(upstream, self.connection), daemon=True)
            back.start()
            _pipe(self.connection, upstream)
            back.join()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: ForwardProxy


class ForwardProxy:
    """See the module text. ``with ForwardProxy() as proxy:`` starts and stops it."""

    def __init__(self, *, credentials: str | None = None) -> None:
        self.credentials = credentials
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The proxy's URL, with its credentials (as a ``*_PROXY`` variable holds it)."""
        userinfo = f"{self.credentials}@" if self.credentials else ""
        return f"http://{userinfo}127.0.0.1:{self.port}"

    def __enter__(self) -> ForwardProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
