"""The data plane's HTTP/1.1 client: keep-alive pools per upstream, a response head parsed
once, the body handed to a listener as it arrives.

Part of the router's data plane (:mod:`controller.dataplane.plane` is its server side). It
speaks just what a model server answers: a status line and headers, then a body framed by
``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the connection (none for
1xx, 204 and 304). Interim 1xx answers are skipped. A chunked body is de-chunked here; the
listener gets the payload of each read as one piece (no per-event work). Flow control is the
transports': the listener pauses this connection's reading while its client cannot keep up.
An exchange is callbacks, no future and no task: the listener hears of the head, each
piece of the body, the end or the failure, from this connection's own ``data_received``
and ``connection_lost``.

A connection goes back to its pool only after a whole response (HTTP/1.1, no
``Connection: close``); idle ones are closed after :data:`IDLE_S`. A kept-alive connection
found closed before any byte of the answer fails ``stale``: the listener retries once on a
fresh one, as aiohttp's client does.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Final, Protocol

from controller.dataplane.upstream_head import (
    BAD_VALUE,
    FRAMING,
    HEADER_LINES,
    AnswerTemplate,
    chunk_size,
    content_length,
)

__all__ = [
    "CHUNKED",
    "CLOSE",
    "CONNECT_S",
    "IDLE_S",
    "LENGTH",
    "NONE",
    "Listener",
    "Upstream",
    "UpstreamError",
    "UpstreamPool",
]

IDLE_S: Final = 30.0  # an idle kept-alive upstream connection is closed after this
# Connect timeout (the slot's upstream_idle_s when shorter). There is no read timeout per
# read (a timer per read is costly): the data plane's stall sweep ends an exchange whose
# server sent nothing for the slot's upstream_idle_s (``Upstream.heard``).
CONNECT_S: Final = 10.0
_HEAD_MAX: Final = 64 * 1024  # a response head larger than this is a broken upstream
_POOL_MAX: Final = 256  # idle connections kept per upstream
_JOIN_MAX: Final = 256 * 1024  # a request up to this size is written as one piece

# Framing of a response body: none, Content-Length, chunked, to the end of the connection.
NONE, LENGTH, CHUNKED, CLOSE = 0, 1, 2, 3
_NONE, _LENGTH, _CHUNKED, _CLOSE = NONE, LENGTH, CHUNKED, CLOSE
# States of the chunked decoder.
_SIZE, _DATA, _DATA_END, _TRAILER = 0, 1, 2, 3


class UpstreamError(Exception):
    """The upstream could not be reached (``unreachable``) or broke (``failed``)."""

    def __init__(
        self,
        message: str,
        *,
        unreachable: bool = False,
        stale: bool = False,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.stale = stale  # a reused connection closed before any byte: retry on a new one
        self.timed_out = timed_out  # the connect timed out (slot.upstream_timeout)


class Listener(Protocol):
    """Who hears of an exchange (the client connection): each call at most once but
    ``relay``; after ``on_end`` or ``on_error`` nothing more."""

    def on_head(self, upstream: Upstream) -> None:
        """The answer's head is parsed (``status``, ``fields``…); :meth:`Upstream.attach`
        then relays its body."""

    def relay(self, data: bytes) -> None:
        """A piece of the body (de-chunked)."""

    def on_end(self) -> None:
        """The whole body was relayed; the connection is no longer the listener's (it is
        back in its pool, or closed)."""

    def on_error(self, error: UpstreamError) -> None:
        """The exchange broke (before the head: nothing was relayed; ``error.stale``: a
        kept-alive connection closed before any byte, worth one retry)."""


class Upstream(asyncio.Protocol):
    """One connection to a model server, one exchange at a time."""

    __slots__ = (
        "_attached",
        "_buffer",
        "_chunk_left",
        "_chunk_state",
        "_got",
        "_key",
        "_left",
        "_listener",
        "_parsed",
        "_paused",
        "_pool",
        "_reset",
        "_reusable",
        "_template",
        "_used",
        "content_type",
        "fields",
        "framing",
        "heard",
        "idle_since",
        "reason",
        "status",
        "transport",
    )

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self._pool, self._key = pool, key
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._listener: Listener | None = None  # None: idle in the pool (or given up)
        self._parsed = False  # the current answer's head is parsed
        self._attached = False  # its body goes to the listener
        self._got = False  # a byte of the current answer arrived
        self._reset = False  # the connection ended with an error
        self._template: AnswerTemplate | None = None  # the last answer's head, to read the next
        self._used = False  # an earlier exchange went over this connection
        self._reusable = False
        self._paused = False
        self.status, self.reason = 0, b""
        self.fields = b""  # the answer's header lines, each after a CRLF, as they came
        self.content_type = b""
        self.framing = _NONE
        self._left = 0  # Content-Length bytes still to come
        self._chunk_state, self._chunk_left = _SIZE, 0
        self.idle_since = 0.0
        # A byte came since the stall sweep last looked (it clears this): the one cost of
        # the upstream idle timeout per read, an attribute store.
        self.heard = False

    @property
    def length(self) -> int:
        """The body's Content-Length (``LENGTH`` framing), before any of it is relayed."""
        return self._left

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._listener is None:  # idle in the pool: nothing may arrive
            self._close()
            return
        self._got = self.heard = True
        if self._attached:
            self._feed(data)
        else:
            self._buffer += data
            if not self._parsed:
                self._parse_head()

    def eof_received(self) -> bool:
        return False  # close: a half-closed upstream ends the exchange (connection_lost)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._reset = exc is not None  # not a clean end (a reset): a body to the end is cut
        self._pool.forget(self)
        if self._listener is None:
            return  # idle in the pool, or given up
        if not self._parsed:
            stale = self._used and not self._got
            self._fail(UpstreamError("the server closed the connection", stale=stale))
        elif self._attached:
            self._ended()
        # else: attach() relays what was buffered, then ends the exchange

    def _ended(self) -> None:
        """The connection ended with the body underway: complete (close-delimited and a
        clean end) or cut."""
        if self.framing == _CLOSE and not self._reset:
            self._finish()
        else:
            self._fail(UpstreamError("the server closed the connection mid-answer"))

    @property
    def paused(self) -> bool:
        """Reading is paused for a slow client (the server's silence is then ours)."""
        return self._paused

    def pause_reading(self) -> None:
        """The sink's client cannot keep up: stop reading (the server then blocks)."""
        if self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and self._paused:
            self._paused = False
            self.transport.resume_reading()

    # ------------------------------------------------------------------ an exchange

    def send(self, request: list[bytes], listener: Listener) -> None:
        """Write a request; ``listener`` hears of the answer."""
        assert self.transport is not None
        self._listener = listener
        self._parsed = self._attached = self._got = False
        if sum(map(len, request)) <= _JOIN_MAX:
            self.transport.write(b"".join(request))  # one segment, one send
        else:
            self.transport.writelines(request)  # a large body is not copied

    def attach(self) -> None:
        """Relay the body (after ``on_head``): what came already, then as it arrives."""
        self._attached = True
        if self.framing == _NONE:
            self._finish()
            return
        if self._buffer:
            data = bytes(self._buffer)
            self._buffer.clear()
            self._feed(data)
        if self.transport is None and self._listener is not None:
            self._ended()  # the connection ended before the listener attached

    def abort(self) -> None:
        """The exchange was given up (client gone, lease revoked): drop the connection,
        without a word to the listener."""
        self._listener = None
        self._close()

    def _fail(self, error: UpstreamError) -> None:
        listener, self._listener = self._listener, None
        self._close()
        if listener is not None:
            listener.on_error(error)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ parsing

    def _parse_head(self) -> None:
        buffer = self._buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _HEAD_MAX:
                    self._fail_head("the response head is too large")
                return
            head = bytes(buffer[:end])
            del buffer[: end + 4]
            if self._template is not None and self._again(head, self._template):
                return
            first = head.find(b"\r\n")
            if first < 0:
                first = len(head)
            version, _, rest = head[:first].partition(b" ")
            code, _, reason = rest.partition(b" ")
            if (
                not version.startswith(b"HTTP/1.")
                or len(code) != 3
                or not code.isdigit()
                or BAD_VALUE.search(reason)
            ):
                self._fail_head("the answer is not HTTP/1.x")
                return
            status = int(code)
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue, 103 Early Hints): skip it
            break
        # Every header line checked in one pass (never relayed to a client otherwise), then
        # only the ones that frame the body are looked at.
        if not HEADER_LINES.fullmatch(head, first):
            self._fail_head("a malformed response header")
            return
        length: int | None = None
        chunked = close = coded = False
        content_type = b""
        for name, value in FRAMING.findall(head, first):
            lower = name.lower()
            value = value.rstrip(b" \t")
            if lower == b"content-length":
                length = content_length(value, length)
                if length is None:
                    self._fail_head("a malformed Content-Length")
                    return
            elif lower == b"transfer-encoding":
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
                coded = True
            elif lower == b"connection":
                close = b"close" in value.lower()
            else:
                content_type = value
        if coded and (not chunked or length is not None):
            # A coding other than chunked last, or both framings: aiohttp refuses it too.
            self._fail_head("an unsupported Transfer-Encoding")
            return
        self.status, self.reason = status, reason
        self.fields, self.content_type = head[first:], content_type
        self._parsed = True
        if status in (204, 304):
            self.framing = _NONE
        elif chunked:
            self.framing, self._chunk_state = _CHUNKED, _SIZE
        elif length is not None:
            self.framing, self._left = (_LENGTH, length) if length else (_NONE, 0)
        else:
            self.framing = _CLOSE
        self._reusable = version == b"HTTP/1.1" and not close and self.framing != _CLOSE
        self._template = (
            AnswerTemplate.of(head, first, status, reason, content_type, self._reusable)
            if self.framing == _LENGTH
            else None
        )
        assert self._listener is not None
        self._listener.on_head(self)

    def _again(self, head: bytes, template: AnswerTemplate) -> bool:
        """``head`` read from the last answer's template (see :class:`AnswerTemplate`);
        False: parse it."""
        length = template.length_of(head)
        if length is None:
            return False
        self.status, self.reason = template.status, template.reason
        self.fields, self.content_type = head[template.first :], template.content_type
        self.framing, self._left, self._reusable = _LENGTH, length, template.reusable
        self._parsed = True
        assert self._listener is not None
        self._listener.on_head(self)
        return True

    def _fail_head(self, message: str) -> None:
        self._fail(UpstreamError(message))

    def _feed(self, data: bytes) -> None:
        sink = self._listener
        if sink is None:
            return  # given up while relaying
        framing = self.framing
        if framing == _LENGTH:
            if len(data) >= self._left:
                data, extra = data[: self._left], len(data) > self._left
                self._left = 0
                if data:
                    sink.relay(data)
                if extra:
                    self._reusable = False  # bytes beyond the answer: do not reuse
                self._finish()
                return
            self._left -= len(data)
            sink.relay(data)
        elif framing == _CHUNKED:
            self._dechunk(data, sink)
        else:
            sink.relay(data)

    def _dechunk(self, data: bytes, sink: Listener) -> None:
        """Decode chunked framing; the payload of this read goes to the sink as one piece."""
        if not self._buffer and self._chunk_state == _SIZE:
            # The common case of a stream: this read is one whole chunk (an event).
            end = data.find(b"\r\n")
            size = chunk_size(data[:end]) if end > 0 else 0
            stop = end + 2 + size
            if size > 0 and len(data) == stop + 2 and data.endswith(b"\r\n"):
                sink.relay(data[end + 2 : stop])
                return
        buffer = self._buffer
        buffer += data
        payload: list[bytes] = []
        at = 0
        size = len(buffer)
        while at < size:
            state = self._chunk_state
            if state == _DATA:
                take = min(self._chunk_left, size - at)
                payload.append(bytes(buffer[at : at + take]))
                at += take
                self._chunk_left -= take
                if not self._chunk_left:
                    self._chunk_state = _DATA_END
                continue
            end = buffer.find(b"\r\n", at)
            if end < 0:
                if size - at > 4096:
                    self._broken("a malformed chunk")
                    return
                break
            line = bytes(buffer[at:end])
            at = end + 2
            if state == _SIZE:
                self._chunk_left = chunk_size(line)
                if self._chunk_left < 0:
                    self._broken("a malformed chunk size")
                    return
                self._chunk_state = _DATA if self._chunk_left else _TRAILER
            elif state == _DATA_END:
                if line:
                    self._broken("a chunk without its CRLF")
                    return
                self._chunk_state = _SIZE
            elif not line:  # the empty line after the trailers: the end of the body
                del buffer[:at]
                if payload:
                    sink.relay(b"".join(payload))
                if buffer:
                    self._reusable = False
                    buffer.clear()
                self._finish()
                return
        del buffer[:at]
        if payload:
            sink.relay(payload[0] if len(payload) == 1 else b"".join(payload))

    def _broken(self, message: str) -> None:
        self._fail(UpstreamError(message))

    def _finish(self) -> None:
        listener, self._listener = self._listener, None
        self.resume_reading()  # paused by a slow client while its last bytes went out
        self._used = True
        if self._reusable and self.transport is not None and not self._buffer:
            self._pool.put(self._key, self)
        else:
            self._close()
        if listener is not None:
            listener.on_end()


class UpstreamPool:
    """Idle kept-alive connections per upstream ``(host, port)``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._idle: dict[tuple[str, int], list[Upstream]] = {}
        self._clock = clock
        self.closed = False

    def take(self, key: tuple[str, int]) -> Upstream | None:
        """An idle kept-alive connection to ``key``, or None."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def connect(self, key: tuple[str, int], timeout_s: float = CONNECT_S) -> Upstream:
        """A fresh connection to ``key``; raises UpstreamError."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(lambda: Upstream(self, key), *key)
        except TimeoutError:  # a server that accepts no connection (a full accept queue)
            raise UpstreamError(
                f"connecting to {key[0]}:{key[1]} timed out after {timeout_s:g}s",
                timed_out=True,
            ) from None
        except OSError as exc:
            detail = str(exc) or type(exc).__name__
            raise UpstreamError(
                f"cannot connect to {key[0]}:{key[1]}: {detail}", unreachable=True
            ) from None
        return conn

    def put(self, key: tuple[str, int], conn: Upstream) -> None:
        idle = self._idle.setdefault(key, [])
        if self.closed or len(idle) >= _POOL_MAX:
            conn.abort()
            return
        conn.idle_since = self._clock()
        idle.append(conn)

    def forget(self, conn: Upstream) -> None:
        for idle in self._idle.values():
            if conn in idle:
                idle.remove(conn)
                return

    def sweep(self) -> None:
        """Close connections idle for longer than :data:`IDLE_S`."""
        horizon = self._clock() - IDLE_S
        for idle in self._idle.values():
            for conn in [c for c in idle if c.idle_since < horizon]:
                conn.abort()  # connection_lost forgets it

    def close(self) -> None:
        self.closed = True
        for idle in self._idle.values():
            for conn in list(idle):
                conn.abort()
        self._idle.clear()
