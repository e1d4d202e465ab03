"""The readiness probe's HTTP: a plain HTTP/1.1 client over asyncio streams (a fresh
connection an attempt, its two requests on it where the server keeps it open), and
aiohttp's client for what it does not take (not a plain ``http://`` endpoint).

Below :mod:`controller.probe`, which decides what the answers mean.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp

__all__ = [
    "MAX_BODY",
    "Request",
    "Response",
    "aiohttp_request",
    "first_bytes",
    "get",
    "plain",
    "plain_pair",
]


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
    answers = await plain_pair(endpoint, (method, path, body), None, timeout_s)
    return answers[0] if answers else None


Request = tuple[str, str, Any]  # method, path, JSON body (None: none)


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
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
            try:
                writer.write(data)
                got = await reader.read(1)
                if got:
                    got += await reader.readline()
            finally:
                writer.close()
    except TimeoutError:
        if not got:
            return Response(0, error=f"no byte within {timeout_s:g}s", extra={"hung": True})
    except (OSError, ValueError, asyncio.LimitOverrunError) as exc:
        if not got:
            return Response(0, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
    if not got:
        return Response(0, error="the server closed the connection without an answer")
    parts = got.split(b" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1][:3].isdigit() else 0
    return Response(status, error="" if status else "an answer that is not HTTP")


class _Reusable(Exception):
    """A kept-alive connection the server had closed before it answered (retry fresh)."""


async def plain_pair(
    endpoint: str,
    first: Request,
    then: Callable[[Response], Request | None] | None,
    timeout_s: float,
) -> list[Response] | None:
    """``first``, then the request ``then(first's answer)`` names (if any), over plain
    asyncio streams (:func:`plain`), on one connection where the server keeps it open:
    a ready attempt's models list and sentinel cost one connection, not two. ``first``
    asks to keep the connection only when a second request may follow; the second goes on
    a fresh connection when the first answer ends it (``Connection: close``, a body to
    EOF) or when the server closed it before answering (as a client retries a stale
    keep-alive connection). None: not a plain ``http://`` endpoint."""
    url = urlsplit(endpoint + first[1])
    if url.scheme != "http" or not url.hostname:
        return None
    address = (url.hostname, url.port or 80)
    answers: list[Response] = []
    kept: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    request: Request | None = first
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
    request: Request,
    kept: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None,
    keep: object,
    timeout_s: float,
) -> tuple[Response, tuple[asyncio.StreamReader, asyncio.StreamWriter] | None]:
    """One request on ``kept`` (else a fresh connection); the answer and the connection
    when it may carry the next request (``keep``: one may follow), else None (closed)."""
    method, path, body = request
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
                    try:
                        head = await reader.readuntil(b"\r\n\r\n")
                    except asyncio.IncompleteReadError as exc:
                        if fresh or exc.partial:
                            raise
                        raise _Reusable from exc
                    except ConnectionError as exc:
                        if fresh:
                            raise
                        raise _Reusable from exc
                    status, headers = _parse_head(head)
                    answer, reusable = await _read_body(reader, status, headers)
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
    except ValueError as exc:  # not HTTP, or a body beyond MAX_BODY
        return Response(status=0, error=f"bad HTTP answer: {exc}"), None
    if not (keep and reusable and "close" not in headers.get("connection", "").lower()):
        writer.close()
        conn = None
    try:
        parsed = json.loads(answer) if answer.strip() else None
    except ValueError:  # UnicodeDecodeError is one
        parsed = None
    return Response(status=status, body=parsed), conn


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise ValueError(f"status line {status_line[:80]!r}")
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(rest[:3]), headers


async def _read_body(
    reader: asyncio.StreamReader, status: int, headers: dict[str, str]
) -> tuple[bytes, bool]:
    """The body, and whether the connection may carry another request after it (not
    when the body ran to EOF)."""
    if status in (204, 304) or status < 200:
        return b"", True
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return bytes(body), True
            if len(body) + size > MAX_BODY:
                raise ValueError("body too large")
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    if "content-length" in headers:
        length = int(headers["content-length"])
        if not 0 <= length <= MAX_BODY:
            raise ValueError(f"Content-Length {length}")
        return await reader.readexactly(length), True
    rest = await reader.read(MAX_BODY + 1)  # no length given: the body ends at EOF
    while len(rest) <= MAX_BODY and (more := await reader.read(MAX_BODY + 1 - len(rest))):
        rest += more
    if len(rest) > MAX_BODY:
        raise ValueError("body too large")
    return rest, False
