"""One client connection of the router's data plane (:mod:`.plane` says the whole): its
requests read with llhttp (:mod:`.request`), each ``/v1`` request served here as the
driver of its routed call (:class:`~controller.router.call.RoutedCall`), each other one
passed to aiohttp's protocol for this connection, and the connection taken back once
aiohttp answered it; where it is, one :class:`State`. :class:`Plane` is what it uses of
the listening socket's protocol factory, :class:`Fallback` what it uses of aiohttp's.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Final, Protocol

from controller.access.keys import TOKEN_PRINCIPAL, KeyHold, Principal
from controller.dataplane import answers as out
from controller.dataplane.request import Got, RequestHead, RequestReader
from controller.dataplane.states import READING, State
from controller.dataplane.upstream import (
    CONNECT_S,
    Framing,
    Upstream,
    UpstreamError,
    UpstreamPool,
)
from controller.router.aliases import model_entries
from controller.router.call import RoutedCall, record_unserved
from controller.router.context import CLIENT_CLOSED, RouterContext
from controller.router.hosts import HostPolicy
from controller.router.memo import RouteMemo
from controller.router.refusals import Refusal

__all__ = ["Connection", "Fallback", "Plane"]

_PIPELINE_MAX: Final = 1024 * 1024  # read ahead while a request is served, then pause
_LINGER_S: Final = 10.0  # a refused body is read (and dropped) this long at most, as aiohttp

_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
# States, by identity in the hot path (an enum member's hash is a Python call) and as
# module constants (``State.IDLE`` is a lookup through the enum's metaclass, ~70 ns).
_IDLE: Final = State.IDLE
_BODY: Final = State.BODY
_PASSING: Final = State.PASSING
_AIOHTTP: Final = State.AIOHTTP
_LEASING: Final = State.LEASING
_CONNECTING: Final = State.CONNECTING
_SENT: Final = State.SENT
_RELAYING: Final = State.RELAYING
_LINGERING: Final = State.LINGERING
_CLOSED: Final = State.CLOSED
_MORE: Final = Got.MORE
_HEAD: Final = Got.HEAD
_REQUEST: Final = Got.REQUEST
_PASSED: Final = Got.PASSED
_FOREIGN: Final = Got.FOREIGN
_GOT_PASSING: Final = Got.PASSING
_CHUNKED: Final = Framing.CHUNKED
_TO_CLOSE: Final = Framing.CLOSE
_LAST_CHUNK: Final = b"0\r\n\r\n"
_JOIN_MAX: Final = 256 * 1024  # a request up to this size goes upstream as one piece


class Fallback(Protocol):
    """aiohttp's connection protocol as the data plane drives it
    (:func:`controller.api.refused.bridged_protocol`): fed the bytes of the requests that
    are not the router's, on this connection's transport; ``answered(keep)`` is called
    once it answered one (``keep``: the connection goes on)."""

    answered: Callable[[bool], None] | None

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...

    def data_received(self, data: bytes) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...


class Plane(Protocol):
    """What a connection uses of its plane (:class:`controller.dataplane.plane.DataPlane`)."""

    ctx: RouterContext
    fallback: Callable[[], Fallback]  # aiohttp's protocol, one a connection
    hosts: HostPolicy  # the Host values this listener answers (DNS rebinding)
    pool: UpstreamPool
    fronts: set[Connection]
    closing: bool
    in_flight: int
    loop: asyncio.AbstractEventLoop

    def ended(self) -> None: ...

    def drained(self) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection, until it closes (or is handed to aiohttp for good)."""

    __slots__ = (
        "active",
        "aiohttp",
        "buffer",
        "call",
        "chunked",
        "discard",
        "head",
        "head_at",
        "idle_s",
        "keep",
        "key",
        "looping",
        "memo",
        "old",
        "paused",
        "pending",
        "plane",
        "quiet_since",
        "reader",
        "reading",
        "reason",
        "request",
        "retried",
        "sent",
        "sent_for",
        "sse",
        "state",
        "task",
        "token",
        "told",
        "transport",
        "upstream",
        "watched",
    )

    def __init__(self, plane: Plane) -> None:
        self.plane = plane
        self.state = State.IDLE
        self.transport: asyncio.Transport | None = None
        self.reader = RequestReader()
        self.buffer = bytearray()  # bytes read while a request is served, for their turn
        self.head_at = 0.0  # when the head of the request whose body is read came
        self.call: RoutedCall | None = None  # the request being served (None: none is)
        self.task: asyncio.Task[None] | None = None  # while it waits: a cold lease, a connect
        self.reason: str | None = None  # why it was given up: client, lease, shutdown
        self.upstream: Upstream | None = None  # its exchange, once sent
        self.keep = True  # the client keeps the connection after this request (llhttp's)
        self.old = False  # an HTTP/1.0 request: answered as 1.0
        # The routed request's head: its target (path and query) and the header lines
        # passed upstream (None: none yet)
        self.head: RequestHead | None = None
        self.key: tuple[str, int] = ("", 0)  # its upstream
        self.request: bytes | list[bytes] = b""  # what was sent there (again on a stale one)
        # The head of the last request sent upstream but its length, and what it was for
        # (the request head and the endpoint, by identity: a kept-alive client's repeated
        # head is the same object, an endpoint the same string while its server runs).
        self.sent_for: tuple[RequestHead, str, bytes, bytes] | None = None
        self.retried = False  # sent again already
        self.paused = False  # the client's transport asked for no more writes for now
        self.reading = True  # reading from the client (paused while a request is served)
        self.looping = False  # in _next (a request answered at once asks for the next)
        self.discard = 0  # LINGERING: bytes of the refused body still to drop (-1: chunked)
        # The answer being written: its head held until its first body bytes, whether it
        # is re-chunked, an event stream, whether any byte of it went out.
        self.pending = b""
        self.chunked = self.sse = self.sent = False
        self.active = time.monotonic()
        # Who the last request was, by its Authorization and x-api-key values (the same
        # bytes objects while its head is recalled): a kept-alive client presents the same
        # again. The API token's admin; a key's principal with its hold, recognised again
        # by the key ring while keys.json is unchanged and the key unexpired.
        self.token: tuple[bytes | None, bytes | None, Principal, KeyHold | None] | None = None
        # What the last routed request decided (its requester and its slot), with what it
        # was decided from: the next one's, when those are the same (router/memo.py).
        self.memo = RouteMemo()
        # aiohttp's protocol for this connection (made at its first request), and whether
        # it answered the request passed to it while its body was still being passed.
        self.aiohttp: Fallback | None = None
        self.told = False
        # The stall sweep's (``plane.stalled``): the exchange it watches, since when its
        # server has sent nothing, the slot's upstream_idle_s.
        self.watched: Upstream | None = None
        self.quiet_since = 0.0
        self.idle_s = 0.0

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.plane.fronts.add(self)

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state is _IDLE or state is _BODY or state is _PASSING:  # in READING
            if self.buffer or self.looping:
                self.buffer += data
                self._next()
            else:
                self._read(data)
                if self.buffer:
                    self._next()
        elif state is _LINGERING:
            if self.discard < 0:  # a chunked body: dropped through llhttp, to its end
                if self.reader.feed(data) in (_REQUEST, _FOREIGN):
                    self.close()
                return
            self.discard -= len(data)
            if self.discard <= 0:
                self.close()
        elif state is not _CLOSED:  # a request in flight: their turn comes after it
            self.buffer += data
            if len(self.buffer) > _PIPELINE_MAX and self.transport is not None and self.reading:
                self.reading = False
                self.transport.pause_reading()  # resumed once the request in flight is done

    def eof_received(self) -> bool:
        return False  # as aiohttp: a client that half-closes has left

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.plane.fronts.discard(self)
        head = self.reader.head if self.state is State.BODY else None
        if head is not None and self._principal(head) is not None:
            # Gone before its whole body: recorded as a call the client gave up.
            record_unserved(self.plane.ctx, self.head_at, CLIENT_CLOSED)
        self.state = State.CLOSED
        self.abort_request("client")
        fallback, self.aiohttp = self.aiohttp, None
        if fallback is not None:
            fallback.answered = None
            fallback.connection_lost(exc)

    def pause_writing(self) -> None:
        self.paused = True
        if self.upstream is not None:
            self.upstream.pause_reading()
        if self.aiohttp is not None:
            self.aiohttp.pause_writing()

    def resume_writing(self) -> None:
        self.paused = False
        if self.upstream is not None:
            self.upstream.resume_reading()
        if self.aiohttp is not None:
            self.aiohttp.resume_writing()

    # ------------------------------------------------------------------ connection

    @property
    def with_aiohttp(self) -> bool:
        """aiohttp has a request of this connection's (its bytes, or its answer, to come)."""
        state = self.state
        return state is _PASSING or state is _AIOHTTP

    @property
    def idle(self) -> bool:
        """No request in flight here or at aiohttp (the keep-alive sweep may close it)."""
        return self.call is None and not self.with_aiohttp

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self, reason: str) -> None:
        """Cancel the request in flight (its lease is released on the way) and close."""
        self.abort_request(reason)
        self.close()

    def _next(self) -> None:
        """Read the buffered bytes, request by request, while no request is in flight. A
        request answered at once (a refusal, a 401, the models list) asks for the next one
        from inside this call: that is a turn of this loop, not a deeper call (thousands
        pipelined in one read would reach the recursion limit)."""
        if self.looping:
            return
        self.looping = True
        try:
            buffer = self.buffer
            while buffer and self.state in READING and self.transport is not None:
                data = bytes(buffer)
                buffer.clear()
                self._read(data)
        finally:
            self.looping = False

    def _read(self, data: bytes) -> None:
        """Feed a read to llhttp; act on what it gave (see :class:`RequestReader`)."""
        self.active = now = time.monotonic()
        reader = self.reader
        got = reader.feed(data)
        if got is not _REQUEST and got is not _HEAD:
            if got is _MORE:
                return
            if got is _FOREIGN:
                state = self.state
                if state is _BODY:  # a /v1 body llhttp refuses (a bad chunk), its head taken
                    self._write(out.malformed_body(reader.head))
                    self._linger(0)
                elif state is _PASSING:  # an aiohttp request's: aiohttp waits for its body
                    self.close()  # for ever on a bad chunk (answering nothing): closed instead
                else:  # aiohttp's 400, from every byte of the request
                    self._hand_over(reader.raw)
                return
            self._pass(reader.passed, got, reader.rest)  # PASSING, PASSED
            return
        head = reader.head
        assert head is not None
        if reader.fresh:
            plane = self.plane
            if head.cleared is plane.hosts and not plane.closing and head.length <= head.limit:
                # A repeated head this listener judged already (but its length).
                self.head_at = now
                if got is _HEAD and head.expect and self.transport is not None:
                    self.transport.write(_CONTINUE)
            elif not self._admit(head, got):
                return
        if got is _HEAD:
            self.state = _BODY
            if reader.over:  # a chunked body past the limit: refused, its rest dropped
                self._refuse_body(head, -1)
            return
        if reader.rest:
            self.buffer[:0] = reader.rest
        if reader.over:
            self._refuse_body(head, 0)
            return
        body = reader.body
        reader.head, reader.body = None, b""  # reader.done(), in line (``over``: False)
        self._start(head, body)

    def _admit(self, head: RequestHead, got: Got) -> bool:
        """The checks of a head before its body is read, the first time this listener
        sees it (:meth:`_read` passes a repeated one): the Host, the stop, the body's limit
        (and the token with it). False: answered (and closed after the body)."""
        transport, plane = self.transport, self.plane
        assert transport is not None
        hosts = plane.hosts
        early = out.early_answer(head, hosts, closing=plane.closing, keys=plane.ctx.keys)
        if early is not None:
            answer, status = early
            transport.write(answer)
            self._linger(0 if got is _REQUEST else self._left_of(head))
            if status:  # a refusal of the router's (not the API's 401 nor the 421)
                record_unserved(plane.ctx, self.active, status)
            return False
        head.cleared = hosts
        self.head_at = self.active
        if got is _HEAD and head.expect:
            transport.write(_CONTINUE)
        return True

    def _left_of(self, head: RequestHead) -> int:
        """The bytes of a refused request's body still to come (-1: chunked, to its end)."""
        return -1 if head.length < 0 else head.length - self.reader.body_seen()

    def _refuse_body(self, head: RequestHead, left: int) -> None:
        """A chunked body went past the endpoint's limit: the 413 (or the 401 first)."""
        transport = self.transport
        assert transport is not None
        answer, status = out.over_limit(head, self.plane.ctx.keys)
        transport.write(answer)
        self._linger(left)
        if status:
            record_unserved(self.plane.ctx, self.head_at, status)

    def _linger(self, left: int) -> None:
        """Close once the ``left`` bytes of a refused body are in (dropped; -1: a chunked
        body, to its end), or after ``_LINGER_S``: closed at once, the unread bytes reset
        the connection, and a client still sending its body (http.client, requests) never
        reads the answer."""
        self.buffer.clear()
        self.state = _LINGERING
        if left == 0:
            self.close()
            return
        self.discard = left
        self.plane.loop.call_later(_LINGER_S, self.close)

    # ------------------------------------------------------------------ aiohttp's requests

    def _pass(self, data: bytes, got: Got, rest: bytes) -> None:
        """Bytes of a request that is aiohttp's (the REST API, the dashboard, the event
        stream): passed to this connection's aiohttp protocol; the next request is read
        once aiohttp answered this one (``_answered``)."""
        fallback = self.aiohttp
        if fallback is None:
            fallback = self.aiohttp = self.plane.fallback()
            fallback.answered = self._answered
            fallback.connection_made(self.transport)  # type: ignore[arg-type]
            if self.paused:
                fallback.pause_writing()
        if self.state is not _PASSING:
            self.told = False  # a new request: not answered yet
        if rest:
            self.buffer[:0] = rest
        if got is Got.PASSED:
            self.state = _IDLE if self.told else _AIOHTTP
        else:
            self.state = _PASSING
        fallback.data_received(data)

    def _answered(self, keep: bool) -> None:
        """aiohttp answered the request passed to it (from inside its task: what follows
        runs as a callback of the loop's)."""
        if keep:
            self.plane.loop.call_soon(self._taken_back)
        # else aiohttp closes the connection itself

    def _taken_back(self) -> None:
        """aiohttp's answer is out: the connection's next request, read here."""
        if self.transport is None:
            return
        if self.state is _PASSING:
            self.told = True  # answered before its whole body: read on once it passed
        elif self.state is _AIOHTTP:
            self.state = _IDLE
            self.active = time.monotonic()
            if not self.reading:
                self.reading = True
                self.transport.resume_reading()
            self._next()

    def _hand_over(self, raw: bytes) -> None:
        """aiohttp serves this connection from here on (a head refused: its ``400``; an
        upgrade), from the bytes read so far."""
        transport = self.transport
        assert transport is not None
        self.plane.fronts.discard(self)
        self.transport = None
        self.state = State.HANDED_OVER
        fallback, self.aiohttp = self.aiohttp, None
        if fallback is None:
            fallback = self.plane.fallback()
            fallback.connection_made(transport)
        fallback.answered = None
        transport.set_protocol(fallback)  # type: ignore[arg-type]
        data = raw + bytes(self.buffer)
        self.buffer.clear()
        if data:
            fallback.data_received(data)

    # ------------------------------------------------------------------ a request's life
    #
    # Callbacks from the request's head to its answer's last byte: ``_start`` (the token;
    # the call's begin: the model, the lease), ``_send`` (an idle pooled connection), then
    # the upstream's ``on_head``, ``relay``, ``on_end`` or ``on_error``, and ``_end`` — or,
    # for a whole sized answer in one read whose head the upstream recalled, its one
    # ``on_answer`` (the head, the body and the end at once). A task only while the
    # request waits: for a cold slot's load (``_leasing``) or a new connection
    # (``_connecting``). ``call`` is set from ``_start`` to its end, which runs once.

    def _principal(self, head: RequestHead) -> Principal | None:
        """Who the request is, looked up (and kept for the connection's next request)."""
        found = out.principal_held(head, self.plane.ctx.keys)
        if isinstance(found, KeyHold):
            self.token = (head.authorization, head.api_key, found.principal, found)
            return found.principal
        if found is TOKEN_PRINCIPAL:
            self.token = (head.authorization, head.api_key, found, None)
        return found

    def _start(self, head: RequestHead, body: bytes) -> None:
        plane = self.plane
        self.pending = b""
        self.sent = self.chunked = self.sse = False
        token = self.token  # who a kept-alive client was, recognised by its bytes
        principal: Principal | None
        if token is not None and token[0] is head.authorization and token[1] is head.api_key:
            held = token[3]
            if held is None:  # the API token
                principal = token[2]
            else:  # a key: as identify() says it now, unless keys.json changed
                keys = plane.ctx.keys
                principal = keys.again(held, time.monotonic(), time.time())
                if principal is None:
                    principal = self._principal(head)
        else:
            principal = self._principal(head)
        if principal is None:
            # As the API's auth: no event, no router metrics.
            self._write(out.unauthorized(head, close=not head.keep))
            self._done(keep=head.keep)
            return
        if not head.collects:
            if head.endpoint is None:  # a /v1 path the router does not hold (404, 405)
                self._write(out.not_routed(head))
            else:
                entries = model_entries(plane.ctx.manager, principal)
                self._write(out.models_answer(entries, head))
            self._done(keep=head.keep)
            return
        call = self.call = RoutedCall(
            plane.ctx, principal, head.kind, head.forms, head.arg, self.active, self.memo
        )
        plane.in_flight += 1
        self.keep, self.old, self.reason, self.retried = head.keep, head.old, None, False
        self.head = head
        self.state = _LEASING
        try:
            if not call.begin(head.asked, head.content_type, body):
                self.task = plane.loop.create_task(self._leasing(call))
                return
            self._send(head)
        except Refusal as refusal:
            self._refuse(refusal)
        except Exception as exc:  # noqa: BLE001  # a bug: _failed logs it (a 500)
            self._failed(exc)

    async def _leasing(self, call: RoutedCall) -> None:
        try:
            await call.wait()
        except asyncio.CancelledError:
            self._cancelled()
            return
        except Refusal as refusal:
            self.task = None
            self._refuse(refusal)
            return
        except Exception as exc:  # noqa: BLE001  # a bug: _failed logs it (a 500)
            self.task = None
            self._failed(exc)
            return
        self.task = None
        try:
            self._send(None)
        except Refusal as refusal:
            self._refuse(refusal)
        except Exception as exc:  # noqa: BLE001  # a bug: _failed logs it (a 500)
            self._failed(exc)

    def _send(self, head: RequestHead | None) -> None:
        """The lease is held: the request (``head``: its head, when it is at hand) goes to
        the slot's server. Its head there is the last one's but for the length when the
        request's head and the endpoint are the same objects (a kept-alive client's
        repeated head, the same server)."""
        call = self.call
        assert call is not None
        endpoint, body = call.upstream()
        made = self.sent_for
        if made is not None and made[0] is head and made[1] is endpoint:
            key, before, after = self.key, made[2], made[3]
        else:
            key, host, prefix = out.address(endpoint)
            self.key = key
            asked = self.head
            assert asked is not None
            before = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Length: " % (
                prefix,
                asked.target,
                host,
            )
            after = asked.forward + b"\r\n\r\n"
            self.sent_for = (head, endpoint, before, after) if head is not None else None
        size = len(body)
        request: bytes | list[bytes]
        if size <= _JOIN_MAX:  # one segment, one send
            self.request = request = b"%s%d%s%s" % (before, size, after, body)
        else:  # a large body is not copied
            self.request = request = [b"%s%d%s" % (before, size, after), body]
        # pool.take's common case, in line: the newest idle connection, still open
        pool = self.plane.pool
        idle = pool.idle.get(key)
        upstream = idle.pop() if idle else None
        if upstream is not None:
            transport = upstream.transport
            if transport is None or transport.is_closing():
                upstream = pool.take(key)  # closed while idle: the next one
        if upstream is None:
            self.state = _CONNECTING
            self.task = self.plane.loop.create_task(self._connecting())
            return
        self.upstream, self.state = upstream, _SENT
        upstream.send(request, self)

    async def _connecting(self) -> None:
        call = self.call
        assert call is not None
        timeout = min(CONNECT_S, call.idle_s())
        try:
            upstream = await self.plane.pool.connect(self.key, timeout)
        except asyncio.CancelledError:
            self._cancelled()
            return
        except UpstreamError as exc:
            self.task = None
            timed_out = timeout if exc.timed_out else None
            self._refuse(
                call.upstream_failed(str(exc), unreachable=exc.unreachable, timed_out_s=timed_out)
            )
            return
        except Exception as exc:  # noqa: BLE001  # a bug: _failed logs it (a 500)
            self.task = None
            self._failed(exc)
            return
        self.task = None
        if self.paused:
            upstream.pause_reading()
        self.upstream, self.state = upstream, _SENT
        upstream.send(self.request, self)

    # The upstream's listener.

    def on_head(self, upstream: Upstream) -> None:
        call = self.call
        assert call is not None
        self.state = _RELAYING
        call.status = upstream.status
        old, framing = self.old, upstream.framing
        if old and (framing is _CHUNKED or framing is _TO_CLOSE):
            self.keep = False  # to an HTTP/1.0 client an unsized body ends with the connection
        self.pending, self.chunked, self.sse = out.response_head(
            upstream, close=not self.keep, old=old
        )
        if self.sse and (self.chunked or old):  # an event stream: its head goes out now (the
            # first token may be seconds away); a break before it is then an in-band error
            self._write(self.pending)
            self.pending = b""
        if self.paused:
            upstream.pause_reading()

    def relay(self, data: bytes) -> None:
        """A piece of the upstream's body."""
        transport = self.transport
        if transport is None:
            return  # the client left: connection_lost gives the request up
        call = self.call
        if call is not None and call.tail is not None:
            call.keep(data)
        if self.chunked:
            data = b"%x\r\n" % len(data) + data + b"\r\n"
        if self.pending:
            data, self.pending = self.pending + data, b""
        self.sent = True
        transport.write(data)

    def on_answer(self, upstream: Upstream, body: bytes) -> None:
        """A whole sized answer (:meth:`Upstream.data_received` recalled its head): what
        :meth:`on_head`, :meth:`relay` and :meth:`on_end` do for it, at once (no early head
        and no re-chunking for a sized body), the upstream already back in its pool."""
        self.upstream = None  # back in its pool: no pause of it from here on
        call = self.call
        assert call is not None
        call.status = upstream.status
        # response_head's common case, in line (a request's code runs from cold caches,
        # where each function more it touches costs; docs/performance.md, the router): the
        # recalled head's client head made already, for this connection's close and old.
        keep, old = self.keep, self.old
        close = not keep
        made = upstream.recalled.made if upstream.recalled is not None else None
        if made is not None and made[0] is close and made[1] is old and upstream.length:
            date = upstream.date
            if date:
                head = b"%s\r\nDate: %s\r\nContent-Length: %d%s" % (
                    made[2],
                    date,
                    upstream.length,
                    made[3],
                )
            else:
                head = b"%s\r\nContent-Length: %d%s" % (made[2], upstream.length, made[3])
        else:
            head = out.response_head(upstream, close=close, old=old)[0]
        if call.tail is not None:
            call.keep(body)
        transport = self.transport
        if transport is not None:  # (None: the client left; connection_lost gives it up)
            self.sent = True
            transport.write(head + body if body else head)
        self.call = None  # the end (_end's, with nothing upstream to drop)
        call.finish()
        plane = self.plane
        plane.in_flight -= 1  # plane.ended(), in line: a stop waits only once closing
        if plane.closing:
            plane.drained()
        # _done(self.keep), in line: a request's code runs from cold caches, where each
        # function more it touches costs (docs/performance.md, the router).
        if self.state is not _CLOSED:
            self.state = _IDLE
        if not keep or plane.closing:
            self.close()
        elif self.transport is not None:
            if not self.reading:
                self.reading = True
                self.transport.resume_reading()
            if self.buffer:
                self._next()

    def on_end(self) -> None:
        self.upstream = None  # back in its pool
        if self.pending or self.chunked:
            tail = _LAST_CHUNK if self.chunked else b""
            self._write(self.pending + tail if self.pending else tail)
            self.pending = b""
        self._end(True)

    def on_error(self, error: UpstreamError) -> None:
        self.upstream = None  # closed
        call = self.call
        assert call is not None
        if self.state is _SENT and error.stale and not self.retried:
            self.retried = True  # a kept-alive connection closed while idle: once more
            self.state = _CONNECTING
            self.task = self.plane.loop.create_task(self._connecting())
            return
        self._end(self._broken(call.upstream_failed(str(error), unreachable=error.unreachable)))

    # The end.

    def _refuse(self, refusal: Refusal) -> None:
        """A refusal before anything went upstream (after, :meth:`_broken` says it)."""
        call = self.call
        assert call is not None
        call.refused(refusal)
        self._write(out.refusal_answer(refusal, close=not self.keep, old=self.old))
        self._end(True)

    def _failed(self, exc: Exception) -> None:
        """A bug: a 500, logged, the lease released."""
        call = self.call
        assert call is not None
        self._end(self._broken(call.failed(exc)))

    def _cancelled(self) -> None:
        """A wait was cancelled by :meth:`abort_request`."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        self.task = None
        self._end(self._interrupted())

    def _end(self, keep: bool) -> None:
        """The request is over: its upstream exchange dropped if unfinished, its call
        finished (the lease released, the call recorded); then the next request, or
        close."""
        call, self.call = self.call, None
        if call is None:
            return
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.abort()  # given up before its end
        call.finish()
        self.plane.ended()
        self._done(keep and self.keep)

    def _done(self, keep: bool) -> None:
        """The request is answered: the next one, or close."""
        if self.state is not _CLOSED:
            self.state = _IDLE
        if not keep or self.plane.closing:
            self.close()
        elif self.transport is not None:
            if not self.reading:
                self.reading = True
                self.transport.resume_reading()
            if self.buffer:
                self._next()

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None:
            self.sent = True
            self.transport.write(data)

    def abort_request(self, reason: str) -> None:
        """Give the request being served up; ``reason`` picks its answer
        (:meth:`_interrupted`)."""
        call = self.call
        if call is None or self.reason is not None:
            return
        self.reason = reason
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the wait ends it
        else:
            self.task = None
            self._end(self._interrupted())

    def _interrupted(self) -> bool:
        """The answer of a request given up (the call says which); False: close."""
        call = self.call
        assert call is not None
        reason = self.reason or "client"
        refusal = call.interrupted(reason, self.idle_s)
        if refusal is None:
            return False  # the client left
        if reason == "shutdown":
            self.keep = False  # closed after it (and said so)
            self._broken(refusal)
            return False
        return self._broken(refusal)

    def _broken(self, refusal: Refusal) -> bool:
        """A failed request: the refusal when nothing went out yet; else said in-band
        (an event stream's last event) or cut short (closed: never a "complete" body)."""
        if not self.sent:
            self.pending = b""
            self._write(out.refusal_answer(refusal, close=not self.keep, old=self.old))
            return True
        if self.sse and self.chunked:
            self._write(out.sse_error_end(refusal))
            return True
        if self.sse and self.old:  # to the end of the connection: the event, then close
            self._write(out.sse_error_end(refusal, chunked=False))
        return False
