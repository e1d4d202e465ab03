"""The router's data plane: the OpenAI ``POST`` endpoints served at the socket, aiohttp
for everything else.

Where it sits: :class:`~controller.api.server.ApiServer` listens with :class:`DataPlane` as
the protocol factory, so every connection starts here. A request this module serves —
``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` or
``/v1/audio/…`` over HTTP/1.1 with a ``Content-Length`` body (and ``GET /v1/models``,
``/v1/models/{id}``, answered here) — is read (its head, the
bearer token, the body's ``model``; the body passes upstream unchanged), leased and sent
over :mod:`controller.api.upstream`'s keep-alive pools; the answer's head is rebuilt from
the upstream's and its body relayed as it arrives, from one transport to the other, with
the transports' own flow control. A request is callbacks from its head to its last byte
(no task, no future): a task runs only while it waits for a cold slot's load or for a
new upstream connection. Anything else — the REST API, the dashboard, a
chunked upload, a percent-encoded model id, a head this parser does not take — hands the
connection, with the bytes read so far, to aiohttp's protocol for good, which serves it as
if the data plane were not there (:mod:`controller.api.router` answers the ``/v1``
requests the data plane leaves).

The answers are the aiohttp router's (SPEC §7): the same refusals from
:mod:`controller.api.router_request`, the same events and metrics
(:func:`~controller.api.router_proxy.report_refusal`,
:func:`~controller.api.router_proxy.record_call`). A client that goes away gives its
request up at once (``connection_lost``): the lease is released and the upstream
connection dropped, so the server stops generating. A revoked lease is noticed within
``_WATCH_S`` (one timer of the plane looks at every request's lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import socket
import time
from collections.abc import Callable
from typing import Final

from controller.api.app import ApiContext
from controller.api.dataplane_head import (
    HeadTemplate,
    RequestHead,
    address,
    authorized,
    models_answer,
    parse_head_like,
    refusal_answer,
    response_head,
    sse_error_end,
    unauthorized,
    upstream_error,
)
from controller.api.router_proxy import (
    CLIENT_CLOSED,
    CLOSED,
    Call,
    lease_now,
    lease_rest,
    record_call,
)
from controller.api.router_request import (
    Pending,
    Refusal,
    model_of,
    shutting_down,
    slot_refusal,
)
from controller.api.selection import served_ids
from controller.api.upstream import Upstream, UpstreamError, UpstreamPool
from controller.errors import SlotctlError

__all__ = ["DataPlane"]

log = logging.getLogger("slotctl.router")

KEEPALIVE_S: Final = 75.0  # an idle client connection is closed after this (aiohttp's default)
_SWEEP_S: Final = 15.0  # how often idle connections are looked for
_WATCH_S: Final = 0.1  # how often a request's lease is looked at
_HEAD_MAX: Final = 64 * 1024  # a longer head goes to aiohttp (which refuses it)
_PIPELINE_MAX: Final = 1024 * 1024  # read ahead while a request is served, then pause
_LINGER_S: Final = 10.0  # a refused body is read (and dropped) this long at most, as aiohttp

_BARE_LF: Final = re.compile(rb"(?<!\r)\n")
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK: Final = b"0\r\n\r\n"


# ----------------------------------------------------------------------------- the plane


class DataPlane:
    """The protocol factory of the API's listening socket (see the module docstring)."""

    def __init__(self, ctx: ApiContext, fallback: Callable[[], asyncio.BaseProtocol]) -> None:
        self.ctx = ctx
        self.fallback = fallback  # aiohttp's protocol factory
        self.pool = UpstreamPool()
        self.fronts: set[_Front] = set()
        self.closing = False
        self.in_flight = 0  # requests being served
        self._drained: asyncio.Event | None = None  # set when none is (while stopping)
        self.loop = asyncio.get_running_loop()
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)
        self._watcher = self.loop.call_later(_WATCH_S, self._watch)

    def __call__(self) -> asyncio.Protocol:
        return _Front(self)

    def _watch(self) -> None:
        """Every ``_WATCH_S``: a request whose lease was revoked (its slot crashed or was
        unloaded) is cancelled; one timer for them all, not one per request."""
        try:
            for front in list(self.fronts):  # ending one may hand its connection over
                call = front.call
                if call is not None and call.lease is not None and call.lease.revoked:
                    front.abort_request("lease")
        finally:
            self._watcher = self.loop.call_later(_WATCH_S, self._watch)

    def _sweep(self) -> None:
        horizon = time.monotonic() - KEEPALIVE_S
        for front in list(self.fronts):
            if front.call is None and front.active < horizon:
                front.close()
        self.pool.sweep()
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)

    async def shutdown(self, timeout: float) -> None:
        """Stop: idle connections close now, requests get ``timeout`` to finish."""
        self.closing = True
        self._sweeper.cancel()  # the lease watch goes on: a revoked lease still ends its
        for front in list(self.fronts):  # request with an error (up --keep-running)
            if front.call is None:
                front.close()
        await self._drain(timeout)
        for front in list(self.fronts):
            front.abort_request("shutdown")  # answered (or said in-band), then closed
        await self._drain(1.0)  # their leases are released on the way
        for front in list(self.fronts):
            front.close()
        self._watcher.cancel()
        self.pool.close()

    def ended(self) -> None:
        """A request was served (its lease released, its call recorded)."""
        self.in_flight -= 1
        if not self.in_flight and self._drained is not None:
            self._drained.set()

    async def _drain(self, timeout: float) -> None:
        if self.in_flight:
            self._drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout)


class _Front(asyncio.Protocol):
    """One client connection, until it is handed to aiohttp."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.head: RequestHead | None = None
        self.template: HeadTemplate | None = None  # the last head, to read the next one
        self.head_end = 0
        self.head_at = 0.0  # when the head of the request whose body is read came
        self.call: Call | None = None  # the request being served (None: none is)
        self.task: asyncio.Task[None] | None = None  # while it waits: a cold lease, a connect
        self.reason: str | None = None  # why it was given up: client, lease, shutdown
        self.upstream: Upstream | None = None  # its exchange, once sent
        self.keep = True  # the client wants the connection kept after this request
        self.key: tuple[str, int] = ("", 0)  # its upstream
        self.request: list[bytes] = []  # what was sent there (sent again on a stale one)
        self.retried = False  # sent again already
        self.headed = False  # the upstream's answer head came
        self.paused = False  # the client's transport asked for no more writes for now
        self.chunked = False  # the current answer is re-chunked
        self.pending = b""  # the current answer's head, written with its first body bytes
        self.sent = False  # the current answer's head went out
        self.sse = False  # the current answer is an event stream
        self.reading = True  # reading from the client (paused while a request is served)
        self.discard = 0  # bytes of a refused body still to read and drop before closing
        self.serving = False  # in _next (a request answered at once asks for the next)
        self.more = False  # _next goes round again
        self.active = time.monotonic()

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.plane.fronts.add(self)

    def data_received(self, data: bytes) -> None:
        if self.discard:
            self.discard -= len(data)
            if self.discard <= 0:
                self.close()
            return
        self.buffer += data
        if self.call is None:
            self._next()
        elif len(self.buffer) > _PIPELINE_MAX and self.transport is not None and self.reading:
            self.reading = False
            self.transport.pause_reading()  # resumed once the request in flight is done

    def eof_received(self) -> bool:
        return False  # as aiohttp: a client that half-closes has left

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.plane.fronts.discard(self)
        head = self.head
        if head is not None and authorized(head.authorization, self.plane.ctx.token):
            # Gone before its whole body: recorded as aiohttp's router records it.
            record_call(self.plane.ctx, Call(started=self.head_at, status=CLIENT_CLOSED))
            self.head = None
        self.abort("client")

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
        """Serve the complete requests in the buffer, in turn, or hand the connection
        over. A request answered at once (a refusal, a 401, the models list) asks for
        the next one from inside this call: that is a turn of this loop, not a deeper
        call (thousands pipelined in one read would reach the recursion limit)."""
        if self.serving:
            self.more = True
            return
        self.serving = True
        try:
            self.more = True
            while self.more:
                self.more = False
                self._next_one()
        finally:
            self.serving = False

    def _next_one(self) -> None:
        transport = self.transport
        if transport is None:
            return
        self.active = time.monotonic()
        buffer, head = self.buffer, self.head
        if not buffer:
            return
        if head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _HEAD_MAX or _BARE_LF.search(buffer):
                    self._hand_over()  # a bare LF never ends in CRLFCRLF: aiohttp's 400
                return
            head, self.template = parse_head_like(bytes(buffer[:end]), self.template)
            if head is None:
                self._hand_over()
                return
            refusal = None
            if self.plane.closing:
                refusal = shutting_down()
            elif head.length > head.limit:
                if not authorized(head.authorization, self.plane.ctx.token):
                    # As aiohttp's: the token first, no body read (a copy: the head may
                    # be the connection's template's).
                    self._unauthorized(dataclasses.replace(head, close=True))
                    self._linger(head.length - (len(buffer) - end - 4))
                    return
                refusal = Refusal(
                    413, f"request body exceeds {head.limit} bytes", code="request_too_large"
                )
            if refusal is not None:
                transport.write(refusal_answer(refusal, close=True))
                self._linger(head.length - (len(buffer) - end - 4))  # the body is never used
                call = Call(started=self.active, status=refusal.status)
                record_call(self.plane.ctx, call)  # as aiohttp's router records them
                return
            self.head, self.head_end, self.head_at = head, end + 4, self.active
            if head.expect and len(buffer) < end + 4 + head.length:
                transport.write(_CONTINUE)
        need = self.head_end + head.length
        if len(buffer) < need:
            return
        body = bytes(buffer[self.head_end : need])
        del buffer[:need]
        self.head = None  # a leave from now on gives this request up
        self._start(head, body)

    def _linger(self, left: int) -> None:
        """Close once the ``left`` bytes of a refused body are in (dropped), or after
        ``_LINGER_S``: closed at once, the unread bytes reset the connection, and a client
        still sending its body (http.client, requests) never reads the answer."""
        self.buffer.clear()
        if left <= 0:
            self.close()
            return
        self.discard = left
        self.plane.loop.call_later(_LINGER_S, self.close)

    def _hand_over(self) -> None:
        """aiohttp serves this connection from here on, from the bytes read so far."""
        transport = self.transport
        assert transport is not None
        self.plane.fronts.discard(self)
        self.transport = None
        protocol = self.plane.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        data = bytes(self.buffer)
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
        if not authorized(head.authorization, ctx.token):
            self._unauthorized(head)  # as the API's auth: no event, no router metrics
            self._done(keep=not head.close)
            return
        if head.method == b"GET":
            self._write(models_answer(served_ids(self.plane.ctx.manager), head))
            self._done(keep=not head.close)
            return
        call = self.call = Call(started=time.monotonic())
        self.plane.in_flight += 1
        self.keep, self.reason, self.retried, self.headed = not head.close, None, False, False
        try:
            if ctx.store.get(CLOSED):
                raise shutting_down()
            now = lease_now(ctx, call, model_of(head.content_type, body))
        except Refusal as refusal:
            self._refuse(refusal)
            return
        except Exception as exc:  # a bug: a 500, logged
            log.error("router: unexpected error in POST %r", head.target, exc_info=exc)
            self._failed()
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
        except Exception as exc:  # a bug in the load path: a 500, logged (as _start)
            self.task = None
            log.error("router: unexpected error in POST %r", head.target, exc_info=exc)
            self._failed()
            return
        self.task = None
        self._sending(head, body)

    def _sending(self, head: RequestHead, body: bytes) -> None:
        try:
            self._send(head, body)
        except Refusal as refusal:
            self._refuse(refusal)
        except Exception as exc:  # a bug: a 500, logged, the lease released
            log.error("router: unexpected error in POST %r", head.target, exc_info=exc)
            self._failed()

    def _send(self, head: RequestHead, body: bytes) -> None:
        """The lease is held: the request goes to the slot's server."""
        call = self.call
        assert call is not None
        try:
            endpoint = self.plane.ctx.manager.endpoint(call.slot)
        except SlotctlError as exc:  # e.g. the slot was removed while we looked it up
            raise slot_refusal(exc) from None
        if endpoint is None:
            raise Refusal(
                503, f"slot {call.slot!r} has no endpoint", code="slot.not_ready", retry_after_s=1
            )
        key, host, prefix = address(endpoint)
        self.key = key
        self.request = [
            b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d%s\r\n\r\n"
            % (prefix, head.target, host, len(body), head.forward),
            body,
        ]
        upstream = self.plane.pool.take(key)
        if upstream is None:
            self.task = self.plane.loop.create_task(self._connecting())
            return
        self.upstream = upstream
        upstream.send(self.request, self)

    async def _connecting(self) -> None:
        call = self.call
        assert call is not None
        try:
            upstream = await self.plane.pool.connect(self.key)
        except asyncio.CancelledError:
            self._cancelled()
            return
        except UpstreamError as exc:
            self.task = None
            self._refuse(upstream_error(call.slot, exc))
            return
        except Exception as exc:  # a bug: a 500, logged
            self.task = None
            log.error("router: unexpected error connecting for slot %r", call.slot, exc_info=exc)
            self._failed()
            return
        self.task = None
        if self.paused:
            upstream.pause_reading()
        self.upstream = upstream
        upstream.send(self.request, self)

    # The upstream's listener.

    def on_head(self, upstream: Upstream) -> None:
        call = self.call
        assert call is not None
        self.headed = True
        call.status = upstream.status
        self.pending, self.chunked, self.sse = response_head(upstream, close=not self.keep)
        if self.chunked and self.sse:  # an event stream: its head goes out now (the first
            # token may be seconds away); a break before it is then an in-band error event
            self._write(self.pending)
            self.pending = b""
        if self.paused:
            upstream.pause_reading()
        upstream.attach()

    def relay(self, data: bytes) -> None:
        """A piece of the upstream's body."""
        transport = self.transport
        if transport is None:
            return  # the client left: connection_lost gives the request up
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
        if not self.headed and error.stale and not self.retried:
            self.retried = True  # a kept-alive connection closed while idle: once more
            self.task = self.plane.loop.create_task(self._connecting())
            return
        self._end(self._broken(call, upstream_error(call.slot, error)))

    # The end.

    def _refuse(self, refusal: Refusal) -> None:
        """A refusal before anything went upstream (after, :meth:`_broken` says it)."""
        call = self.call
        assert call is not None
        call.status = refusal.status
        self._write(refusal_answer(refusal, close=not self.keep))
        self._end(True)

    def _failed(self) -> None:
        call = self.call
        assert call is not None
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
        if not keep or self.plane.closing:
            self.close()
        elif self.transport is not None:
            if not self.reading:
                self.reading = True
                self.transport.resume_reading()
            self._next()

    def _unauthorized(self, head: RequestHead) -> None:
        self._write(unauthorized(head.authorization, close=head.close))

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
            error = call.lease.error if call.lease is not None else None
            refusal = (
                slot_refusal(error)
                if error is not None
                else Refusal(502, f"slot {call.slot!r} went away", code="upstream.failed")
            )
            return self._broken(call, refusal)
        if reason == "shutdown":
            refusal = shutting_down()
            self.keep = False  # closed after it (and said so)
            self._broken(call, refusal)
            return False
        call.status = CLIENT_CLOSED
        return False

    def _broken(self, call: Call, refusal: Refusal) -> bool:
        """A failed request: the refusal when nothing went out yet; else said in-band
        (an SSE answer's last event) or cut short (closed: never a "complete" body)."""
        call.status = refusal.status
        if not self.sent:
            self.pending = b""
            self._write(refusal_answer(refusal, close=not self.keep))
            return True
        if self.sse and self.chunked:
            self._write(sse_error_end(refusal))
            return True
        return False
