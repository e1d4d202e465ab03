"""The data plane's HTTP/1.1 client: keep-alive pools per upstream, each answer parsed by
llhttp (``httptools``), its body handed to a listener as it arrives.

Part of the router's data plane (:mod:`controller.dataplane.connection` is its listener).
llhttp reads the answer (status line, headers, the body's framing: ``Content-Length``,
``chunked`` with its extensions checked, or the end of the connection; none for 204 and
304): every verdict on the bytes is its own. Interim answers (100, 102, 103) are skipped; a
``101`` (we never ask for an upgrade), a transfer coding other than ``chunked`` (which the
relay would drop) and any malformed answer fail the exchange. The listener gets the
payload of each read as one piece, from outside llhttp's callbacks (so nothing a listener
does runs inside the parser). Flow control is the transports': the listener pauses this
connection's reading while its client cannot keep up. An exchange is callbacks, no future
and no task: the listener hears of the head, each piece of the body, the end or the
failure, from this connection's own ``data_received`` and ``connection_lost``.

A model server answers with the same head again but for its ``Content-Length`` and its
``Date``: a connection keeps the bytes of the last answer head llhttp read (sized, no
transfer coding, no interim answer before it: :class:`~.recall.AnswerRecall`), and an
answer whose head is those bytes exactly, but for the digits of its length (1 to 18 of
``0-9``) and a ``Date`` value of the same IMF-fixdate shape (letters, digits, spaces,
commas, colons: bytes llhttp reads in any field value alike), gets that head's verdict
again without llhttp's callbacks; its body is ``Content-Length`` bytes, as llhttp reads
it. Any other byte that differs goes through llhttp. Such an answer whole in one read
(the common case) ends the exchange at once — the connection back in its pool — and its
listener hears of it in one call (:meth:`Listener.on_answer`: the head, the body, the end).

A connection goes back to its pool only after a whole answer (llhttp's keep-alive verdict:
HTTP/1.1, no ``Connection: close``, nothing after the answer); idle ones are closed after
:data:`IDLE_S`. A kept-alive connection found closed before any byte of the answer fails
``stale``: the listener retries once on a fresh one, as aiohttp's client does.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import time
from collections.abc import Callable
from typing import Final, Protocol

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser
from httptools.parser.errors import HttpParserCallbackError

from controller.dataplane.recall import AnswerRecall, answer_recall
from controller.dataplane.states import Phase

__all__ = [
    "CONNECT_S",
    "IDLE_S",
    "Framing",
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


class Framing(enum.Enum):
    """How an answer's body is framed."""

    NONE = "none"  # 204, 304, Content-Length: 0
    LENGTH = "length"  # Content-Length
    CHUNKED = "chunked"
    CLOSE = "close"  # to the end of the connection


# Phases and framings as module constants in the hot path (``Phase.BODY`` is a lookup
# through the enum's metaclass, ~70 ns).
_IDLE: Final = Phase.IDLE
_WAITING: Final = Phase.WAITING
_HEAD: Final = Phase.HEAD
_BODY: Final = Phase.BODY
_DONE: Final = Phase.DONE
_NO_BODY: Final = Framing.NONE
_SIZED: Final = Framing.LENGTH
_CHUNKED: Final = Framing.CHUNKED
_TO_CLOSE: Final = Framing.CLOSE


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
        """The answer's head is parsed (``status``, ``fields``, ``framing``…)."""

    def relay(self, data: bytes) -> None:
        """A piece of the body (de-chunked)."""

    def on_end(self) -> None:
        """The whole body was relayed; the connection is no longer the listener's (it is
        back in its pool, or closed)."""

    def on_error(self, error: UpstreamError) -> None:
        """The exchange broke (before the head: nothing was relayed; ``error.stale``: a
        kept-alive connection closed before any byte, worth one retry)."""

    def on_answer(self, upstream: Upstream, body: bytes) -> None:
        """A whole sized answer came in one read, its head recalled: what ``on_head``,
        ``relay(body)`` (when there is a body) and ``on_end`` say, in one call, the
        connection already back in its pool (or closed): the common case of a kept-alive
        model server's answers."""


class _Stop(Exception):
    """Raised from a callback to stop llhttp (bytes after a whole answer)."""


class Upstream(asyncio.Protocol):
    """One connection to a model server, one exchange at a time."""

    __slots__ = (
        "_clean",
        "_complete",
        "_extra",
        "_interim",
        "_keep",
        "_key",
        "_left",
        "_length",
        "_listener",
        "_parser",
        "_paused",
        "_phase",
        "_pieces",
        "_pool",
        "_recall",
        "_reset",
        "_seen",
        "_told",
        "_used",
        "codings",
        "content_type",
        "date",
        "fields",
        "framing",
        "heard",
        "idle_since",
        "length",
        "reason",
        "recalled",
        "status",
        "transport",
    )

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self._pool, self._key = pool, key
        self.transport: asyncio.Transport | None = None
        self._listener: Listener | None = None  # None: idle in the pool (or given up)
        self._parser = HttpResponseParser(self)
        self._phase = _IDLE
        self._pieces: list[bytes] = []  # the body of this read, relayed after the parse
        self._complete = False  # llhttp saw the answer's end in this read
        self._extra = False  # bytes came after the answer: not reused
        self._seen = 0  # bytes of the current answer's head so far
        self._told = False  # the listener heard of the head
        self._keep = False  # llhttp's keep-alive verdict on the answer
        self._reset = False  # the connection ended with an error
        self._used = False  # an earlier exchange went over this connection
        self._clean = False  # the last exchange ended as a whole recalled answer (send())
        self._paused = False
        self._recall: AnswerRecall | None = None  # the last answer head llhttp read, by its bytes
        self.recalled: AnswerRecall | None = None  # this answer's head, when it was that one
        self._left = 0  # a recalled answer's body: bytes still to come (llhttp not fed)
        self._interim = False  # an interim answer came before this one
        self.status, self.reason = 0, b""
        # The answer's headers as they came, but its framing (Content-Length,
        # Transfer-Encoding: ``codings``, ``length``) and its ``date``.
        self.fields: list[tuple[bytes, bytes]] = []
        self.codings: list[bytes] = []
        self.content_type = b""
        self.date = b""
        self.framing = _NO_BODY
        self.length = 0  # the body's Content-Length (LENGTH framing)
        self._length: int | None = None
        self.idle_since = 0.0
        # A byte came since the stall sweep last looked (it clears this): the one cost of
        # the upstream idle timeout per read, an attribute store.
        self.heard = False

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
        self.heard = True
        if self._left:
            self._more_body(data)
            self._deliver()
            return
        recall = self._recall
        if self._phase is not _WAITING or recall is None:
            self._parse(data)
            return
        # The recalled head (the module docstring says when): ``data`` read as it and its
        # body; another head goes to llhttp. A whole answer in this read ends the exchange
        # here (Listener.on_answer); else the rest of its body is counted in by _more_body.
        # In line: a request's code runs from cold caches, where each function more it
        # touches costs (docs/performance.md, the router).
        found = recall.pattern.match(data)
        if found is None:
            self._parse(data)
            return
        if self.recalled is not recall:  # (the same: what it said is set already; a
            # parse in between drops ``recalled`` first)
            self.status, self.reason, self.fields, self.content_type, self._keep = recall.said
            self.recalled = recall
            self.codings = []
        self.date = found.group("d") if recall.date is None else recall.date
        self._length = self.length = length = int(found.group("n"))
        self.framing = _SIZED if length else _NO_BODY
        end = found.end()
        size = len(data) - end
        if size < length:  # more of its body to come
            self._phase = _BODY
            self._left = length
            self._more_body(data[end:] if size else b"")
            self._deliver()
            return
        if size > length:
            self._extra = True  # bytes after the answer: the connection is not reused
        listener = self._listener
        self._listener = None
        self._phase = _IDLE  # (the next send() sets what this exchange left)
        # _ended(), in line: its answer whole, back in the pool (or closed)
        if self._paused:
            self.resume_reading()
        self._used = self._clean = True  # (send() has nothing of this exchange to reset)
        if self._keep and size == length and self.transport is not None:
            # pool.put's common case, in line: back among the idle connections
            pool = self._pool
            idle = pool.idle.get(self._key)
            if idle is not None and not pool.closed and len(idle) < _POOL_MAX:
                self.idle_since = pool.clock()
                idle.append(self)
            else:
                pool.put(self._key, self)
        else:
            self._close()
        listener.on_answer(self, data[end : end + length])

    def _parse(self, data: bytes) -> None:
        """``data`` read by llhttp; then the listener hears of it."""
        first = self._phase is _WAITING
        if first:
            self._phase = _HEAD
            self.recalled = None
            self._begin()
        try:
            self._parser.feed_data(data)
        except HttpParserUpgrade:
            self._fail("the server switched protocols (101): not asked for")
            return
        except HttpParserCallbackError as exc:
            if not self._extra:  # a bug in a callback, not the server's bytes
                raise exc.__context__ or exc from None
        except HttpParserError as exc:
            self._fail(f"a malformed answer ({exc})")
            return
        if self._phase is _HEAD:
            self._seen += len(data)
            if self._seen > _HEAD_MAX:
                self._fail("the response head is too large")
                return
        elif first and not self._interim and self._phase is _BODY:
            self._recall = self._recall_of(data[: data.find(b"\r\n\r\n") + 4])
        self._deliver()

    def _recall_of(self, raw: bytes) -> AnswerRecall | None:
        """The recall of the head ``raw`` llhttp just read; None: not sized, or coded."""
        if self._length is None or self.codings or self.status in (204, 304):
            return None
        return answer_recall(
            raw,
            self._length,
            self.date,
            (self.status, self.reason, self.fields, self.content_type, self._keep),
        )

    def _more_body(self, data: bytes) -> None:
        """More of a recalled answer's body (see :meth:`data_received`)."""
        left = self._left
        if len(data) > left:
            self._extra = True  # bytes after the answer: the connection is not reused
            data = data[:left]
        if data:
            self._pieces.append(data)
        self._left = left - len(data)
        self._complete = not self._left

    def eof_received(self) -> bool:
        return False  # close: a half-closed upstream ends the exchange (connection_lost)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._reset = exc is not None  # not a clean end (a reset): a body to the end is cut
        self._pool.forget(self)
        if self._listener is None:
            return  # idle in the pool, or given up
        phase = self._phase
        if phase is _WAITING or phase is _HEAD:
            stale = self._used and phase is _WAITING
            self._fail("the server closed the connection", stale=stale)
        elif phase is _BODY:
            if self.framing is _TO_CLOSE and not self._reset:
                self._finish()  # a body to the end of the connection, whole
            else:
                self._fail("the server closed the connection mid-answer")

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

    # ------------------------------------------------------------------ llhttp's callbacks

    def on_message_begin(self) -> None:
        if self._complete:  # bytes after the whole answer: the connection is not reused
            self._extra = True
            raise _Stop

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        # The framing headers, the type and the Date apart (by their length first: most
        # names are none of them); the others kept as they came, for the relay.
        size = len(name)
        if size == 14 and name.lower() == b"content-length":
            self._length = int(value)  # digits, llhttp checked (and refused a second one)
        elif size == 17 and name.lower() == b"transfer-encoding":
            self.codings.append(value)
        elif size == 4 and name.lower() == b"date":
            self.date = value
        else:
            if size == 12 and name.lower() == b"content-type":
                self.content_type = value.strip()
            self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim answer: skip it
            self._begin()
            self._interim = True
            return
        self.status = status
        self._keep = self._parser.should_keep_alive()
        length = self._length
        if status in (204, 304):
            self.framing = _NO_BODY
        elif self.codings:
            self.framing = _CHUNKED  # llhttp took it: chunked is the last coding
        elif length is not None:
            self.framing, self.length = (_SIZED, length) if length else (_NO_BODY, 0)
        else:
            self.framing = _TO_CLOSE
        self._phase = _BODY

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        if self._phase is _BODY:  # not an interim answer's end
            self._complete = True

    # ------------------------------------------------------------------ an exchange

    def _begin(self) -> None:
        """An answer's head to come: nothing of it known."""
        self.status, self.reason, self.content_type, self.date = 0, b"", b"", b""
        self.fields, self.codings = [], []
        self.framing, self.length, self._length = _NO_BODY, 0, None

    def send(self, request: bytes | list[bytes], listener: Listener) -> None:
        """Write a request (its bytes, or its pieces: a large body is not copied);
        ``listener`` hears of the answer."""
        transport = self.transport
        assert transport is not None
        self._listener = listener
        self._phase = _WAITING
        if self._clean:  # the last exchange a whole recalled answer: nothing to reset
            self._clean = False
        else:
            self._seen, self._complete, self._extra, self._told = 0, False, False, False
            self._interim, self._left = False, 0
        if isinstance(request, bytes):
            transport.write(request)
        else:
            transport.writelines(request)

    def _deliver(self) -> None:
        """After a read: the head to the listener (once), this read's body, the end."""
        listener = self._listener
        if listener is None or self._phase is _HEAD:
            return
        if self._phase is _BODY:
            if not self._told:  # the head came in this read
                self._told = True
                if self.codings and b", ".join(self.codings).lower() != b"chunked":
                    self._fail("an unsupported Transfer-Encoding")  # a coding would be lost
                    return
                listener.on_head(self)
                if self._listener is not listener:
                    return  # given up in on_head
            pieces = self._pieces
            if pieces:
                self._pieces = []
                listener.relay(pieces[0] if len(pieces) == 1 else b"".join(pieces))
                if self._listener is not listener:
                    return  # given up while relaying
        if self._complete:
            self._finish()

    def abort(self) -> None:
        """The exchange was given up (client gone, lease revoked): drop the connection,
        without a word to the listener."""
        self._listener = None
        self._close()

    def _fail(self, message: str, *, stale: bool = False) -> None:
        listener, self._listener = self._listener, None
        self._phase = _DONE
        self._close()
        if listener is not None:
            listener.on_error(UpstreamError(message, stale=stale))

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _finish(self) -> None:
        listener, self._listener = self._listener, None
        self._phase = _IDLE
        self._ended()
        if listener is not None:
            listener.on_end()

    def _ended(self) -> None:
        """The exchange is over, its answer whole: back in the pool, or closed."""
        if self._paused:
            self.resume_reading()  # paused by a slow client while its last bytes went out
        self._used = True
        reusable = self._keep and not self._extra and self.framing is not _TO_CLOSE
        if reusable and self.transport is not None:
            self._pool.put(self._key, self)
        else:
            self._close()


class UpstreamPool:
    """Idle kept-alive connections per upstream ``(host, port)``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # Idle connections per upstream, the newest last (the data plane takes the last
        # in line; take() checks that it is still open).
        self.idle: dict[tuple[str, int], list[Upstream]] = {}
        self.clock = clock
        self.closed = False

    def take(self, key: tuple[str, int]) -> Upstream | None:
        """An idle kept-alive connection to ``key``, or None."""
        idle = self.idle.get(key)
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
        idle = self.idle.get(key)
        if idle is None:
            idle = self.idle[key] = []
        if self.closed or len(idle) >= _POOL_MAX:
            conn.abort()
            return
        conn.idle_since = self.clock()
        idle.append(conn)

    def forget(self, conn: Upstream) -> None:
        for idle in self.idle.values():
            if conn in idle:
                idle.remove(conn)
                return

    def sweep(self) -> None:
        """Close connections idle for longer than :data:`IDLE_S`."""
        horizon = self.clock() - IDLE_S
        for idle in self.idle.values():
            for conn in [c for c in idle if c.idle_since < horizon]:
                conn.abort()  # connection_lost forgets it

    def close(self) -> None:
        self.closed = True
        for idle in self.idle.values():
            for conn in list(idle):
                conn.abort()
        self.idle.clear()
