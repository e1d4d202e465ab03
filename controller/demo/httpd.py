"""The demo server's HTTP/1.1 layer, on the standard library alone (sockets and threads).

Where it sits: under :mod:`controller.demo.api` (which gives it routes and renders errors)
and driven by :mod:`controller.demo.server` (which binds with :func:`listen` and hands
each accepted connection to :func:`serve_connection` on its own thread). It exists so the
demo server starts in a few tens of milliseconds: importing aiohttp costs ~0.26 s of CPU
and asyncio ~0.05 s, and the tests and every ``make demo`` start this server thousands
of times.

What it speaks: HTTP/1.0 and 1.1 requests with ``Content-Length`` or chunked bodies
(``Expect: 100-continue`` answered), keep-alive and pipelining, HEAD for GET routes;
responses with a ``Content-Length`` body, or streamed (``Transfer-Encoding: chunked`` on
HTTP/1.1, close-delimited on HTTP/1.0). Protocol errors answer 400/404/405/413/431/501/505
with a body rendered by the app's ``error`` callback, then close the connection.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from io import BufferedReader

__all__ = [
    "MAX_BODY_BYTES",
    "App",
    "HttpError",
    "Request",
    "Response",
    "Stream",
    "Tracker",
    "listen",
    "serve_connection",
]

MAX_LINE_BYTES = 8190  # request line and each header line, as aiohttp's server
MAX_HEADERS = 100
MAX_BODY_BYTES = 1 << 20  # as aiohttp's client_max_size
IDLE_TIMEOUT_S = 75.0  # an idle keep-alive connection (or a stalled request) is closed
LISTEN_BACKLOG = 128
SERVER = "slotctl-demo"
JSON_TYPE = "application/json; charset=utf-8"

REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Request Entity Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class HttpError(Exception):
    """A request the server refuses before any handler sees it; the connection closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Request:
    """One parsed request: method, path (query split off), lower-cased headers, body."""

    __slots__ = ("body", "headers", "method", "path", "query", "version")

    def __init__(
        self, method: str, path: str, query: str, version: str, headers: dict[str, str]
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.headers = headers
        self.body = b""


class Response:
    """A complete response: status, body bytes (sent with a Content-Length), headers."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str = JSON_TYPE,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = dict(headers or {})


class Stream:
    """A streamed 200 response: each item of ``chunks`` is sent (and flushed) as it comes."""

    __slots__ = ("chunks", "content_type", "headers")

    def __init__(
        self, chunks: Iterable[bytes], content_type: str, headers: Mapping[str, str]
    ) -> None:
        self.chunks = chunks
        self.content_type = content_type
        self.headers = dict(headers)


Handler = Callable[[Request], "Response | Stream"]
ErrorRenderer = Callable[[int, str], Response]


class App:
    """Routes (path -> method -> handler) and how protocol errors are rendered."""

    def __init__(self, routes: Mapping[str, Mapping[str, Handler]], error: ErrorRenderer) -> None:
        self.routes = routes
        self.error = error

    def dispatch(self, request: Request) -> Response | Stream:
        methods = self.routes.get(request.path)
        if methods is None:
            return self.error(404, f"Invalid URL ({request.method} {request.path})")
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            allowed = sorted({*methods, *(["HEAD"] if "GET" in methods else [])})
            response = self.error(405, f"Method {request.method} is not allowed for {request.path}")
            response.headers["Allow"] = ", ".join(allowed)
            return response
        try:
            return handler(request)
        except Exception:  # noqa: BLE001 - a handler bug answers 500 and is printed, as aiohttp does
            import traceback  # here, not at the top: only a bug needs it

            traceback.print_exc(file=sys.stderr)
            return self.error(500, "internal server error")


class Tracker:
    """Counts requests being answered, so a stop can wait for them (briefly)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self.stopping = False

    def __enter__(self) -> None:
        with self._cond:
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Stop taking new requests; wait up to ``timeout`` s for the current ones."""
        with self._cond:
            self.stopping = True
            return self._cond.wait_for(lambda: self._active == 0, timeout)


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to (one port for all)."""
    name = host.encode() if host.isascii() else host  # bytes skip the idna codec's import
    infos = socket.getaddrinfo(name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if sockets[0] is not sock:  # --port 0: the others take the first one's port
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


# --- one connection ---------------------------------------------------------------------


def serve_connection(conn: socket.socket, app: App, tracker: Tracker) -> None:
    """Answer requests on ``conn`` until the client or the protocol ends it; then close."""
    conn.settimeout(IDLE_TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = conn.makefile("rb")
    try:
        keep_alive = True
        while keep_alive and not tracker.stopping:
            try:
                request = _read_request(reader, conn)
            except HttpError as err:
                _send(conn, "HTTP/1.1", app.error(err.status, err.message), False, head=False)
                return
            if request is None:
                return
            with tracker:
                keep_alive = _wants_keep_alive(request) and not tracker.stopping
                response = app.dispatch(request)
                head = request.method == "HEAD"
                if isinstance(response, Stream):
                    keep_alive = _stream(conn, request.version, response, keep_alive)
                else:
                    _send(conn, request.version, response, keep_alive, head=head)
    except OSError:
        return  # reset, broken pipe or idle timeout: the client is gone, nobody to tell
    finally:
        reader.close()
        conn.close()


def _readline(reader: BufferedReader, status: int, what: str) -> bytes:
    line = reader.readline(MAX_LINE_BYTES + 2)
    if line and not line.endswith(b"\n"):
        raise HttpError(status, f"{what} is longer than {MAX_LINE_BYTES} bytes")
    return line


def _read_request(reader: BufferedReader, conn: socket.socket) -> Request | None:
    """The next request on the connection, or None at a clean end of stream."""
    line = _readline(reader, 400, "the request line")
    while line in (b"\r\n", b"\n"):  # robustness: blank lines before a request
        line = _readline(reader, 400, "the request line")
    if not line:
        return None
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
        raise HttpError(400, f"malformed request line: {line[:100]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505, f"unsupported HTTP version: {version[:20]!r}")
    path, _, query = target.partition("?")
    request = Request(method, path, query, version, _read_headers(reader))
    request.body = _read_body(reader, conn, request)
    return request


def _read_headers(reader: BufferedReader) -> dict[str, str]:
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):
        line = _readline(reader, 431, "a header line")
        if line in (b"\r\n", b"\n"):
            return headers
        if not line:
            raise HttpError(400, "the connection ended inside the headers")
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon or not name or name != name.strip() or name[0] in " \t":
            raise HttpError(400, f"malformed header line: {line[:100]!r}")
        name, value = name.lower(), value.strip()
        if name in headers:
            if name == "content-length" and headers[name] != value:
                raise HttpError(400, "conflicting Content-Length headers")
            value = value if name == "content-length" else f"{headers[name]}, {value}"
        headers[name] = value
    raise HttpError(431, f"more than {MAX_HEADERS} header lines")


def _read_body(reader: BufferedReader, conn: socket.socket, request: Request) -> bytes:
    headers = request.headers
    coding = headers.get("transfer-encoding")
    length = headers.get("content-length")
    if coding is not None:
        if coding.lower() != "chunked":
            raise HttpError(501, f"unsupported Transfer-Encoding: {coding[:40]!r}")
        if length is not None:
            raise HttpError(400, "both Content-Length and Transfer-Encoding")
        _continue(conn, request)
        return _read_chunked(reader)
    if length is None:
        return b""
    if not length.isdigit():
        raise HttpError(400, f"invalid Content-Length: {length[:40]!r}")
    size = int(length)
    if size > MAX_BODY_BYTES:
        raise HttpError(413, _too_large(size))
    _continue(conn, request)
    body = reader.read(size)
    if len(body) < size:
        raise OSError("the connection ended inside the body")
    return body


def _too_large(size: int | str) -> str:
    return f"Maximum request body size {MAX_BODY_BYTES} exceeded, actual body size {size}"


def _continue(conn: socket.socket, request: Request) -> None:
    if request.version == "HTTP/1.1" and request.headers.get("expect", "").lower() == (
        "100-continue"
    ):
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")


def _read_chunked(reader: BufferedReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        line = _readline(reader, 400, "a chunk size line")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpError(400, f"malformed chunk size: {line[:40]!r}") from None
        if size < 0:
            raise HttpError(400, f"malformed chunk size: {line[:40]!r}")
        if size == 0:
            break
        total += size
        if total > MAX_BODY_BYTES:
            raise HttpError(413, _too_large(f"> {MAX_BODY_BYTES}"))
        data = reader.read(size + 2)
        if len(data) < size + 2 or not data.endswith(b"\r\n"):
            raise HttpError(400, "malformed chunk")
        parts.append(data[:-2])
    while _readline(reader, 400, "a trailer line") not in (b"\r\n", b"\n", b""):
        pass  # trailers are read and ignored
    return b"".join(parts)


# --- answers ----------------------------------------------------------------------------


def _wants_keep_alive(request: Request) -> bool:
    tokens = {t.strip().lower() for t in request.headers.get("connection", "").split(",")}
    if request.version == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


def _head(version: str, status: int, fields: Mapping[str, str]) -> bytes:
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime())
    lines = [f"{version} {status} {REASONS.get(status, 'Unknown')}", f"Server: {SERVER}"]
    lines.append(f"Date: {date}")
    lines.extend(f"{name}: {value}" for name, value in fields.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _connection(version: str, keep_alive: bool) -> dict[str, str]:
    if not keep_alive:
        return {"Connection": "close"}
    return {"Connection": "keep-alive"} if version == "HTTP/1.0" else {}


def _send(
    conn: socket.socket, version: str, response: Response, keep_alive: bool, *, head: bool
) -> None:
    fields = {
        "Content-Type": response.content_type,
        "Content-Length": str(len(response.body)),
        **response.headers,
        **_connection(version, keep_alive),
    }
    conn.sendall(_head(version, response.status, fields) + (b"" if head else response.body))


def _stream(conn: socket.socket, version: str, stream: Stream, keep_alive: bool) -> bool:
    """Send ``stream``; whether the connection may carry another request."""
    chunked = version == "HTTP/1.1"
    keep_alive = keep_alive and chunked  # HTTP/1.0: the end of the body is the close
    fields = {"Content-Type": stream.content_type, **stream.headers}
    if chunked:
        fields["Transfer-Encoding"] = "chunked"
    conn.sendall(_head(version, 200, {**fields, **_connection(version, keep_alive)}))
    for chunk in stream.chunks:
        if chunk:
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
    if chunked:
        conn.sendall(b"0\r\n\r\n")
    return keep_alive
