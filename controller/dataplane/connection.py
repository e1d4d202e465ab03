"""One client connection of the router's data plane (:mod:`.plane` says the whole): its
requests read with llhttp (:mod:`.request`), the ones the data plane takes served as
callbacks, anything else handed to aiohttp for good; where it is, one :class:`State`.
:class:`Plane` is what it uses of the listening socket's protocol factory.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Final, Protocol

from controller.dataplane import answers as out
from controller.dataplane.request import Got, RequestHead, RequestReader
from controller.dataplane.states import READING, State
from controller.dataplane.upstream import CONNECT_S, Upstream, UpstreamError, UpstreamPool
from controller.model.errors import SlotctlError
from controller.router import refusals
from controller.router.access import requester
from controller.router.aliases import model_entries
from controller.router.body import model_of, with_model
from controller.router.context import (
    CLIENT_CLOSED,
    Call,
    RouterContext,
    record_call,
    upstream_idle_s,
)
from controller.router.hosts import HostPolicy
from controller.router.leasing import Pending, lease_now, lease_rest
from controller.router.refusals import Refusal

__all__ = ["Connection", "Plane"]

log = logging.getLogger("slotctl.router")

_PIPELINE_MAX: Final = 1024 * 1024  # read ahead while a request is served, then pause
_LINGER_S: Final = 10.0  # a refused body is read (and dropped) this long at most, as aiohttp

_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
# READING's states, by identity in the hot path (an enum member's hash is a Python call).
_IDLE: Final = State.IDLE
_BODY: Final = State.BODY
_LAST_CHUNK: Final = b"0\r\n\r\n"


class Plane(Protocol):
    """What a connection uses of its plane (:class:`controller.dataplane.plane.DataPlane`)."""

    ctx: RouterContext
    fallback: Callable[[], asyncio.BaseProtocol]  # aiohttp's protocol factory
    hosts: HostPolicy  # the Host values this listener answers (DNS rebinding)
    pool: UpstreamPool
    fronts: set[Connection]
    closing: bool
    in_flight: int
    loop: asyncio.AbstractEventLoop

    def ended(self) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection, until it is handed to aiohttp."""

    def __init__(self, plane: Plane) -> None:
        self.plane = plane
        self.state = State.IDLE
        self.transport: asyncio.Transport | None = None
        self.reader = RequestReader()
        self.buffer = bytearray()  # bytes read while a request is served, for their turn
        self.head_at = 0.0  # when the head of the request whose body is read came
        self.call: Call | None = None  # the request being served (None: none is)
        self.task: asyncio.Task[None] | None = None  # while it waits: a cold lease, a connect
        self.reason: str | None = None  # why it was given up: client, lease, shutdown
        self.upstream: Upstream | None = None  # its exchange, once sent
        self.keep = True  # the client keeps the connection after this request (llhttp's)
        self.key: tuple[str, int] = ("", 0)  # its upstream
        self.request: list[bytes] = []  # what was sent there (sent again on a stale one)
        self.retried = False  # sent again already
        self.paused = False  # the client's transport asked for no more writes for now
        self.reading = True  # reading from the client (paused while a request is served)
        self.looping = False  # in _next (a request answered at once asks for the next)
        self.discard = 0  # LINGERING: bytes of the refused body still to drop
        # The answer being written: its head held until its first body bytes, whether it
        # is re-chunked, an event stream, whether any byte of it went out.
        self.pending = b""
        self.chunked = self.sse = self.sent = False
        self.active = time.monotonic()
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
        if state is _IDLE or state is _BODY:  # in READING
            if self.buffer or self.looping:
                self.buffer += data
                self._next()
            else:
                self._read(data)
                if self.buffer:
                    self._next()
        elif state is State.LINGERING:
            self.discard -= len(data)
            if self.discard <= 0:
                self.close()
        elif state is not State.CLOSED:  # a request in flight: their turn comes after it
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
        if head is not None and out.principal(head, self.plane.ctx.keys) is not None:
            # Gone before its whole body: recorded as aiohttp's router records it.
            record_call(self.plane.ctx, Call(started=self.head_at, status=CLIENT_CLOSED))
        self.state = State.CLOSED
        self.abort_request("client")

    def pause_writing(self) -> None:
        self.paused = True
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.upstream is not None:
            self.upstream.resume_reading()

    # ------------------------------------------------------------------ connection

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
        self.active = time.monotonic()
        reader = self.reader
        got = reader.feed(data)
        if got is Got.MORE:
            return
        if got is Got.FOREIGN:
            self._hand_over(reader.raw)
            return
        head = reader.head
        assert head is not None
        if reader.fresh and not self._admit(head, got):
            return
        if got is Got.HEAD:
            self.state = State.BODY
            return
        if reader.rest:
            self.buffer[:0] = reader.rest
        body = reader.body
        reader.done()
        self._start(head, body)

    def _admit(self, head: RequestHead, got: Got) -> bool:
        """The checks of a head before its body is read: the Host, the stop, the body's
        limit (and the token with it). False: answered (and closed after the body)."""
        transport, plane = self.transport, self.plane
        assert transport is not None
        early = out.early_answer(head, plane.hosts, closing=plane.closing, keys=plane.ctx.keys)
        if early is not None:
            answer, status = early
            transport.write(answer)
            self._linger(0 if got is Got.REQUEST else head.length - self.reader.body_seen())
            if status:  # as aiohttp's router records them (not the API's 401 nor the 421)
                record_call(plane.ctx, Call(started=self.active, status=status))
            return False
        self.head_at = self.active
        if got is Got.HEAD and head.expect:
            transport.write(_CONTINUE)
        return True

    def _linger(self, left: int) -> None:
        """Close once the ``left`` bytes of a refused body are in (dropped), or after
        ``_LINGER_S``: closed at once, the unread bytes reset the connection, and a client
        still sending its body (http.client, requests) never reads the answer."""
        self.buffer.clear()
        self.state = State.LINGERING
        if left <= 0:
            self.close()
            return
        self.discard = left
        self.plane.loop.call_later(_LINGER_S, self.close)

    def _hand_over(self, raw: bytes) -> None:
        """aiohttp serves this connection from here on, from the bytes read so far."""
        transport = self.transport
        assert transport is not None
        self.plane.fronts.discard(self)
        self.transport = None
        self.state = State.HANDED_OVER
        protocol = self.plane.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        data = raw + bytes(self.buffer)
        self.buffer.clear()
        if data and isinstance(protocol, asyncio.Protocol):
            protocol.data_received(data)

    # ------------------------------------------------------------------ a request's life
    #
    # Callbacks from the request's head to its answer's last byte: ``_start`` (token,
    # model, lease), ``_send`` (an idle pooled connection), then the upstream's
    # ``on_head``, ``relay``, ``on_end`` or ``on_error``, and ``_end``. A task only while
    # the request waits: for a cold slot's load (``_leasing``) or a new connection
    # (``_connecting``). ``call`` is set from ``_start`` to ``_end``, which runs once.

    def _start(self, head: RequestHead, body: bytes) -> None:
        ctx = self.plane.ctx
        self.pending = b""
        self.sent = self.chunked = self.sse = False
        principal = out.principal(head, ctx.keys)
        if principal is None:
            # As the API's auth: no event, no router metrics.
            self._write(out.unauthorized(head, close=not head.keep))
            self._done(keep=head.keep)
            return
        if head.method == b"GET":
            self._write(out.models_answer(model_entries(ctx.manager, principal), head))
            self._done(keep=head.keep)
            return
        call = self.call = Call(started=time.monotonic(), principal=principal)
        self.plane.in_flight += 1
        self.keep, self.reason, self.retried = head.keep, None, False
        self.state = State.LEASING
        try:
            if ctx.closed:
                raise refusals.shutting_down()
            asked = head.priority.decode("latin-1") if head.priority is not None else None
            call.who = requester(ctx.manager.settings, principal, asked)
            now = lease_now(ctx, call, model_of(head.content_type, body), head.endpoint)
        except Refusal as refusal:
            self._refuse(refusal)
            return
        except Exception as exc:  # noqa: BLE001  # a bug: _failed logs it (a 500)
            self._failed(exc)
            return
        if isinstance(now, Pending):
            self.task = self.plane.loop.create_task(self._leasing(now, head, body))
            return
        self._sending(head, body)

    async def _leasing(self, pending: Pending, head: RequestHead, body: bytes) -> None:
        call = self.call
        assert call is not None
        try:
            await lease_rest(self.plane.ctx, call, pending)
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
        self._sending(head, body)

    def _sending(self, head: RequestHead, body: bytes) -> None:
        try:
            self._send(head, body)
        except Refusal as refusal:
            self._refuse(refusal)
        except Exception as exc:  # noqa: BLE001  # a bug: _failed logs it (a 500)
            self._failed(exc)

    def _send(self, head: RequestHead, body: bytes) -> None:
        """The lease is held: the request goes to the slot's server."""
        call = self.call
        assert call is not None
        if call.alias:  # the member's server sees the model it serves
            body = with_model(head.content_type, body, call.model)
        try:
            endpoint = self.plane.ctx.manager.endpoint(call.slot)
        except SlotctlError as exc:  # e.g. the slot was removed while we looked it up
            raise refusals.slot_refusal(exc) from None
        if endpoint is None:
            raise Refusal(
                503, f"slot {call.slot!r} has no endpoint", code="slot.not_ready", retry_after_s=1
            )
        key, host, prefix = out.address(endpoint)
        self.key = key
        self.request = [
            b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d%s\r\n\r\n"
            % (prefix, head.target, host, len(body), head.forward),
            body,
        ]
        upstream = self.plane.pool.take(key)
        if upstream is None:
            self.state = State.CONNECTING
            self.task = self.plane.loop.create_task(self._connecting())
            return
        self.upstream, self.state = upstream, State.SENT
        upstream.send(self.request, self)

    async def _connecting(self) -> None:
        call = self.call
        assert call is not None
        timeout = min(CONNECT_S, upstream_idle_s(self.plane.ctx, call.slot))
        try:
            upstream = await self.plane.pool.connect(self.key, timeout)
        except asyncio.CancelledError:
            self._cancelled()
            return
        except UpstreamError as exc:
            self.task = None
            if exc.timed_out:
                self._refuse(
                    refusals.upstream_timeout(self.plane.ctx, call, timeout, connecting=True)
                )
            else:
                self._refuse(out.upstream_error(call.slot, exc))
            return
        except Exception as exc:  # noqa: BLE001  # a bug: _failed logs it (a 500)
            self.task = None
            self._failed(exc)
            return
        self.task = None
        if self.paused:
            upstream.pause_reading()
        self.upstream, self.state = upstream, State.SENT
        upstream.send(self.request, self)

    # The upstream's listener.

    def on_head(self, upstream: Upstream) -> None:
        call = self.call
        assert call is not None
        self.state = State.RELAYING
        call.status = upstream.status
        self.pending, self.chunked, self.sse = out.response_head(upstream, close=not self.keep)
        if self.chunked and self.sse:  # an event stream: its head goes out now (the first
            # token may be seconds away); a break before it is then an in-band error event
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

    def on_end(self) -> None:
        self.upstream = None  # back in its pool
        tail = _LAST_CHUNK if self.chunked else b""
        self._write(self.pending + tail if self.pending else tail)
        self.pending = b""
        self._end(True)

    def on_error(self, error: UpstreamError) -> None:
        self.upstream = None  # closed
        call = self.call
        assert call is not None
        if self.state is State.SENT and error.stale and not self.retried:
            self.retried = True  # a kept-alive connection closed while idle: once more
            self.state = State.CONNECTING
            self.task = self.plane.loop.create_task(self._connecting())
            return
        self._end(self._broken(call, out.upstream_error(call.slot, error)))

    # The end.

    def _refuse(self, refusal: Refusal) -> None:
        """A refusal before anything went upstream (after, :meth:`_broken` says it)."""
        call = self.call
        assert call is not None
        call.status = refusal.status
        self._write(out.refusal_answer(refusal, close=not self.keep))
        self._end(True)

    def _failed(self, exc: Exception) -> None:
        """A bug: a 500, logged, the lease released."""
        call = self.call
        assert call is not None
        log.error("router: unexpected error serving a request for %r", call.model, exc_info=exc)
        self._end(self._broken(call, Refusal(500, "internal error (see the log)", code="internal")))

    def _cancelled(self) -> None:
        """A wait was cancelled by :meth:`abort_request`."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        self.task = None
        call = self.call
        assert call is not None
        self._end(self._interrupted(call))

    def _end(self, keep: bool) -> None:
        """The request is over: its upstream exchange dropped if unfinished, its lease
        released, its call recorded; then the next request, or close."""
        call, self.call = self.call, None
        if call is None:
            return
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.abort()  # given up before its end
        if call.lease is not None:
            self.plane.ctx.manager.release(call.lease)
        record_call(self.plane.ctx, call)
        self.plane.ended()
        self._done(keep and self.keep)

    def _done(self, keep: bool) -> None:
        """The request is answered: the next one, or close."""
        if self.state is not State.CLOSED:
            self.state = State.IDLE
        if not keep or self.plane.closing:
            self.close()
        elif self.transport is not None:
            if not self.reading:
                self.reading = True
                self.transport.resume_reading()
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
            self._end(self._interrupted(call))

    def _interrupted(self, call: Call) -> bool:
        """The answer of a request given up; False: close."""
        reason = self.reason
        if reason == "lease":
            return self._broken(call, refusals.revoked(call))
        if reason == "timeout":  # the server went silent (the stall sweep)
            return self._broken(call, refusals.upstream_timeout(self.plane.ctx, call, self.idle_s))
        if reason == "shutdown":
            self.keep = False  # closed after it (and said so)
            self._broken(call, refusals.shutting_down())
            return False
        call.status = CLIENT_CLOSED
        return False

    def _broken(self, call: Call, refusal: Refusal) -> bool:
        """A failed request: the refusal when nothing went out yet; else said in-band
        (an SSE answer's last event) or cut short (closed: never a "complete" body)."""
        call.status = refusal.status
        if not self.sent:
            self.pending = b""
            self._write(out.refusal_answer(refusal, close=not self.keep))
            return True
        if self.sse and self.chunked:
            self._write(out.sse_error_end(refusal))
            return True
        return False
