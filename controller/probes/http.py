"""The readiness probe's HTTP: a plain HTTP/1.1 client over asyncio streams (a fresh
connection an attempt, its two requests on it where the server keeps it open; each answer
read by llhttp, ``httptools``), and aiohttp's client for what it does not take (not a
plain ``http://`` endpoint).

Below :mod:`controller.probes.readiness`, which decides what the answers mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser
from httptools.parser.errors import HttpParserCallbackError

__all__ = [
    "MAX_BODY",
    "HttpCall",
    "Response",
    "aiohttp_request",
    "first_bytes",
    "get",
    "plain",
    "plain_pair",
    "within_server_time",
]


@dataclass(frozen=True, slots=True)
class HttpCall:
    """One request to a slot's server: the readiness probe's models list and sentinel, a
    sleep protocol's calls (``{level}`` in a sleep call's path is the sleep level)."""

    method: str
    path: str
    body: Mapping[str, Any] | None = None  # sent as JSON; None: no body


@dataclass(slots=True)
class Response:
    status: int
    body: Any = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


async def aiohttp_request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any,
    timeout_s: float,
) -> Response:
    try:
        async with session.request(
            method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = None
            return Response(status=resp.status, body=data)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return Response(status=0, error=f"{type(exc).__name__}: {exc}".rstrip(": "))


MAX_BODY: Final = 8 * 1024 * 1024  # a models list is a few KiB; more is not an answer


async def get(endpoint: str, path: str, timeout_s: float) -> Response | None:
    """``GET endpoint + path`` over plain asyncio streams (:func:`plain`)."""
    return await plain("GET", endpoint, path, None, timeout_s)


async def plain(
    method: str, endpoint: str, path: str, body: Any, timeout_s: float
) -> Response | None:
    """``METHOD endpoint + path`` (``body``, when not None, as JSON) over plain asyncio
    streams: HTTP/1.1, a fresh connection closed after the answer (as the aiohttp
    session's ``force_close``), ``timeout_s`` for the whole exchange, bodies by
    Content-Length, chunked or to EOF. The models list is every attempt's first request,
    and all but the last attempt of a load end there (refused or 503); the sentinel is the
    last. This costs about half the CPU of aiohttp's client (0.26-0.33 ms against
    0.56-0.60 ms an attempt, measured against a loading demo server). None: not a plain
    ``http://`` endpoint (aiohttp then asks)."""
    answers = await plain_pair(endpoint, HttpCall(method, path, body), None, timeout_s)
    return answers[0] if answers else None


async def first_bytes(endpoint: str, path: str, timeout_s: float) -> Response | None:
    """``GET endpoint + path`` for liveness: did the server send *anything* within
    ``timeout_s``? Only its status line is read (a busy server may be slow to finish an
    answer, never to start one). ``extra["hung"]`` is True when not one byte came in time
    (the connect included: a stopped server's full accept queue); a refused or closed
    connection is not hung (the process may be gone: the exit check's case). None: not a
    plain ``http://`` endpoint."""
    url = urlsplit(endpoint + path)
    if url.scheme != "http" or not url.hostname:
        return None
    target = (url.path or "/") + (f"?{url.query}" if url.query else "")
    data = (
        f"GET {target} HTTP/1.1\r\nHost: {url.netloc}\r\nUser-Agent: slotctl-probe\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    got = b""

    async def exchange() -> None:
        nonlocal got
        reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
        try:
            writer.write(data)
            got = await reader.read(1)
            if got:
                got += await reader.readline()
        finally:
            writer.close()

    try:
        await within_server_time(exchange(), timeout_s)
    except TimeoutError:
        if not got:
            return Response(0, error=f"no byte within {timeout_s:g}s", extra={"hung": True})
    except (OSError, ValueError, asyncio.LimitOverrunError) as exc:
        if not got:
            return Response(0, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
    if not got:
        return Response(0, error="the server closed the connection without an answer")
    return Response(status := _status(got), error="" if status else "an answer that is not HTTP")


# How often :func:`within_server_time` looks at the clock, and how late a look may be
# before the lateness is the loop's own (not counted against the server).
LAG_TICK_S: Final = 0.25
LAG_TOLERANCE_S: Final = 0.05


async def within_server_time(work: Coroutine[Any, Any, None], timeout_s: float) -> float:
    """Run ``work`` for ``timeout_s`` of the *server's* time; TimeoutError past it.

    A controller whose event loop is busy (a thousand probes, a burst of watch events)
    runs its callbacks late: the answer a server sent at once may sit in the socket while
    the loop catches up, and a plain ``asyncio.timeout`` counts that wait as the server's
    silence (a healthy server taken for hung). Here the deadline moves out by the loop's
    own lateness, seen as a tick that wakes later than it was due. Returns the lateness
    forgiven (seconds)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    forgiven = 0.0
    start = loop.time()
    try:
        while True:
            left = start + forgiven + timeout_s - loop.time()
            if left <= 0:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if task.cancelled():
                    raise TimeoutError
                task.result()  # it finished as it was cancelled: its outcome stands
                return forgiven
            step = min(LAG_TICK_S, left)
            due = loop.time() + step
            done, _ = await asyncio.wait((task,), timeout=step)
            if done:
                task.result()
                return forgiven
            late = loop.time() - due
            if late > LAG_TOLERANCE_S:
                forgiven += late
    except asyncio.CancelledError:
        task.cancel()
        raise


def _status(line: bytes) -> int:
    """The status a status line gives, as llhttp reads it (0: none, not HTTP)."""
    parser = HttpResponseParser(object())
    try:
        parser.feed_data(line)
    except HttpParserError:
        return 0
    return parser.get_status_code() if line.endswith(b"\n") else 0


class _Reusable(Exception):
    """A kept-alive connection the server had closed before it answered (retry fresh)."""


async def plain_pair(
    endpoint: str,
    first: HttpCall,
    then: Callable[[Response], HttpCall | None] | None,
    timeout_s: float,
) -> list[Response] | None:
    """``first``, then the request ``then(first's answer)`` names (if any), over plain
    asyncio streams (:func:`plain`), on one connection where the server keeps it open:
    a ready attempt's models list and sentinel cost one connection, not two. ``first``
    asks to keep the connection only when a second request may follow; the second goes on
    a fresh connection when the first answer ends it (``Connection: close``, a body to
    EOF) or when the server closed it before answering (as a client retries a stale
    keep-alive connection). None: not a plain ``http://`` endpoint."""
    url = urlsplit(endpoint + first.path)
    if url.scheme != "http" or not url.hostname:
        return None
    address = (url.hostname, url.port or 80)
    answers: list[Response] = []
    kept: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    request: HttpCall | None = first
    try:
        while request is not None:
            follow = then if not answers else None
            answer, kept = await _exchange(endpoint, address, request, kept, follow, timeout_s)
            answers.append(answer)
            request = follow(answer) if follow is not None else None
    finally:
        if kept is not None:
            kept[1].close()
    return answers


async def _exchange(
    endpoint: str,
    address: tuple[str, int],
    request: HttpCall,
    kept: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None,
    keep: object,
    timeout_s: float,
) -> tuple[Response, tuple[asyncio.StreamReader, asyncio.StreamWriter] | None]:
    """One request on ``kept`` (else a fresh connection); the answer and the connection
    when it may carry the next request (``keep``: one may follow), else None (closed)."""
    method, path, body = request.method, request.path, request.body
    url = urlsplit(endpoint + path)
    target = (url.path or "/") + (f"?{url.query}" if url.query else "")
    payload = b"" if body is None else json.dumps(body).encode()
    content = "" if body is None else "Content-Type: application/json\r\n"
    if payload or method not in ("GET", "HEAD"):
        content += f"Content-Length: {len(payload)}\r\n"
    connection = "keep-alive" if keep else "close"
    data = (
        f"{method} {target} HTTP/1.1\r\nHost: {url.netloc}\r\nAccept: application/json\r\n"
        f"User-Agent: slotctl-probe\r\n{content}Connection: {connection}\r\n\r\n"
    ).encode("latin-1") + payload
    conn = kept
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                if conn is None:
                    conn = await asyncio.open_connection(*address)
                    fresh = True
                else:
                    fresh = False
                reader, writer = conn
                try:
                    writer.write(data)
                    answer, status, reusable = await _read_answer(reader, fresh)
                except _Reusable:
                    writer.close()
                    conn = None
                    continue
                except BaseException:
                    writer.close()
                    raise
                break
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        return Response(status=0, error=f"{type(exc).__name__}: {exc}".rstrip(": ")), None
    except (ValueError, HttpParserError) as exc:  # not HTTP (llhttp says), a body too large
        return Response(status=0, error=f"bad HTTP answer: {exc}"), None
    if not (keep and reusable):  # llhttp's keep-alive verdict, and a length or chunks
        writer.close()
        conn = None
    try:
        parsed = json.loads(answer) if answer.strip() else None
    except ValueError:  # UnicodeDecodeError is one
        parsed = None
    return Response(status=status, body=parsed), conn


_HEAD_MAX: Final = 64 * 1024  # an answer's head beyond this is no server's (as aiohttp)


class _TooLarge(ValueError):
    """A body beyond :data:`MAX_BODY`, or a head beyond :data:`_HEAD_MAX`."""


class _After(Exception):
    """Raised from a callback to stop llhttp: bytes came after the whole answer."""


class _Answer:
    """One answer as llhttp reads it (``httptools``, strict): its status, body, framing."""

    def __init__(self) -> None:
        self.parser = HttpResponseParser(self)
        self.status = 0
        self.length: str | None = None  # Content-Length (digits: llhttp checks them)
        self.codings: list[str] = []  # Transfer-Encoding, each header's value
        self.body = bytearray()
        self.headed = False  # the final (not interim) head came
        self.done = False  # the whole answer came
        self.after = False  # bytes came after it: the connection is not reused
        self.keep = False  # llhttp's keep-alive verdict (a body to EOF is none)
        self.head = 0  # the header lines' bytes so far

    def on_message_begin(self) -> None:
        if self.done:
            self.after = True
            raise _After

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head += len(name) + len(value) + 4
        if self.head > _HEAD_MAX:
            raise _TooLarge("the answer's head is too large")
        key = name.lower()
        if key == b"content-length":
            self.length = value.decode("latin-1").strip()
        elif key == b"transfer-encoding":
            self.codings.append(value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (a 101: llhttp raises the upgrade)
            self.length, self.codings = None, []
            return
        self.status, self.headed = status, True
        self.keep = self.parser.should_keep_alive()
        if self.length is not None and int(self.length) > MAX_BODY:
            raise _TooLarge(f"Content-Length {self.length}")

    def on_body(self, body: bytes) -> None:
        if len(self.body) + len(body) > MAX_BODY:
            raise _TooLarge("body too large")
        self.body += body

    def on_message_complete(self) -> None:
        self.done = self.done or self.headed

    @property
    def to_the_end(self) -> bool:
        """The body runs to the end of the connection, as llhttp frames an answer with
        neither a length nor chunked as its last coding."""
        last = ",".join(self.codings).rsplit(",", 1)[-1].strip().lower()
        return self.length is None and last != "chunked"

    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except HttpParserCallbackError as exc:
            if not self.after:
                raise exc.__context__ or exc from None  # a body too large
        except HttpParserUpgrade:
            raise ValueError("the server switched protocols (101): not asked for") from None


async def _read_answer(reader: asyncio.StreamReader, fresh: bool) -> tuple[bytes, int, bool]:
    """One answer read by llhttp: its body, status and whether the connection may
    carry another request. A kept-alive connection closed before any byte is
    :class:`_Reusable` (the request goes again on a fresh one)."""
    answer, seen = _Answer(), 0
    while not answer.done:
        try:
            data = await reader.read(65536)
        except ConnectionError as exc:
            if fresh or seen:
                raise
            raise _Reusable from exc
        if not data:
            if answer.headed and answer.to_the_end:
                return bytes(answer.body), answer.status, False  # ended with the connection
            if not fresh and not seen:
                raise _Reusable
            raise asyncio.IncompleteReadError(bytes(answer.body), None)
        seen += len(data)
        answer.feed(data)
        if not answer.headed and seen > _HEAD_MAX:
            raise _TooLarge("the answer's head is too large")
    return bytes(answer.body), answer.status, answer.keep and not answer.after
