"""Forwarding a routed request: lease, proxy, relay, release — and the watch that cuts it.

Part of the OpenAI router (:mod:`controller.api.router` is its route table,
:mod:`controller.api.router_request` reads and refuses). Most routed requests never get
here: the data plane (:mod:`controller.api.dataplane`) serves them at the socket and
shares this module's records, metrics and events (:class:`Call`, :func:`record_call`,
:func:`report_refusal`). This is the path of what it leaves to aiohttp (a chunked
upload, ``HTTP/1.0``, a head it does not take, any server built without it), with the
same answers. One request's path:

1. read the body and take its ``model``; rank the activated slots serving it
   (:func:`~controller.api.selection.serving`, no view built) and lease the best that
   grants one (a cold slot loads; concurrent cold requests join that one load);
2. proxy the body unchanged to the slot's endpoint with one shared keep-alive
   :class:`aiohttp.ClientSession` (:data:`SESSION` in ``ctx.store``; its connector pools
   connections per upstream host and port, closed on app cleanup). Small complete bodies
   are relayed whole; ``text/event-stream`` (and every unsized or large body) is written
   chunk by chunk as it arrives — whatever the upstream delivered since the last write goes
   out as one write — never buffered;
3. release the lease when the response is complete, when the upstream fails, when the
   client disconnects and when the lease is revoked (the slot crashed or was unloaded).

The server does not cancel handlers when a client leaves (aiohttp's default,
``handler_cancellation=False``, which keeps the REST routes' manager operations from
being cut in half). So each routed request carries a :class:`_Watch`: a timer on the
event loop (no task of its own) that looks at the client connection and the lease every
``_WATCH_S`` and cancels the request's own task when the client left or the lease was
revoked; the work's ``finally`` releases the lease, also while it still waits for a cold
load or for the upstream's first byte, and the handler answers (499, or the refusal).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import time
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict

from controller.api.app import API_CTX, REQUEST_RECORDER, ApiContext, CtxKey
from controller.api.router_request import (
    Pending,
    Refusal,
    acquire_now,
    acquire_rest,
    error_body,
    model_not_found,
    read_body,
    requested_model,
    shutting_down,
    slot_refusal,
    upstream_path,
    upstream_refusal,
    wrong_endpoint,
)
from controller.api.selection import endpoint_of, fitting, serving
from controller.errors import ModelNotFound, SlotctlError, SlotUpstreamTimeout
from controller.events import EventKind, Op
from controller.slots import Lease

__all__ = [
    "CLIENT_CLOSED",
    "CLOSED",
    "REQUEST_DROP",
    "RESPONSE_DROP",
    "SESSION",
    "Call",
    "lease_model",
    "lease_now",
    "lease_rest",
    "record_call",
    "report_refusal",
    "revoked",
    "route_request",
    "setup",
    "upstream_idle_s",
    "upstream_timeout",
]

log = logging.getLogger("slotctl.router")

SESSION: Final = CtxKey("router_session", aiohttp.ClientSession)  # the upstream session
CLOSED: Final = CtxKey("router_closed", bool)  # set by the app's cleanup

_RELAY_WHOLE_MAX: Final = 1024 * 1024  # sized non-stream bodies up to this are relayed whole
_WATCH_S: Final = 0.1  # how often the watch looks at the client connection and the lease
CLIENT_CLOSED: Final = 499  # nginx's status for "client closed the request" (metrics only)
_CONNECT_S: Final = 10.0  # connect timeout (the slot's upstream_idle_s when shorter)
_IDLE_DEFAULT_S: Final = 120.0  # a slot the manager no longer knows: the schema's default

# Never forwarded in either direction: hop-by-hop headers (RFC 9110 §7.6.1), the
# controller's own credentials, and lengths/encodings the two connections set themselves.
_HOP_BY_HOP: Final = frozenset(
    h.lower()
    for h in (
        hdrs.CONNECTION,
        hdrs.KEEP_ALIVE,
        hdrs.PROXY_AUTHENTICATE,
        hdrs.PROXY_AUTHORIZATION,
        hdrs.TE,
        hdrs.TRAILER,
        hdrs.TRANSFER_ENCODING,
        hdrs.UPGRADE,
        hdrs.CONTENT_LENGTH,
        hdrs.HOST,
    )
)
REQUEST_DROP: Final = _HOP_BY_HOP | {
    hdrs.AUTHORIZATION.lower(),
    hdrs.COOKIE.lower(),
    hdrs.EXPECT.lower(),  # answered by this server already
}
RESPONSE_DROP: Final = _HOP_BY_HOP | {
    hdrs.SET_COOKIE.lower(),
    hdrs.SERVER.lower(),
    hdrs.DATE.lower(),
}


# ----------------------------------------------------------------------------- session


def setup(app: web.Application) -> None:
    """Close the shared upstream session when the app is cleaned up."""
    app.on_cleanup.append(_close_session)


async def _close_session(app: web.Application) -> None:
    store = app[API_CTX].store
    store.set(CLOSED, True)  # a request still running opens no new session
    session = store.pop(SESSION)
    if session is not None:
        await session.close()


def _session(ctx: ApiContext) -> aiohttp.ClientSession:
    """The shared upstream session, created on first use (inside the running loop); none
    once the app is cleaning up (a request still running then gets a 503)."""
    if ctx.store.get(CLOSED):
        raise shutting_down()
    session = ctx.store.get(SESSION)
    if session is not None and not session.closed:
        return session
    session = aiohttp.ClientSession(
        # Keep-alive pools per upstream (host, port); no cap per host: a slot's server
        # takes as many concurrent requests as clients send (it queues them itself).
        connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=30),
        # No total timeout: a generation may take long, and a client that gives up
        # disconnects (the watch then cancels the upstream request). The read timeout is
        # per request: the slot's upstream_idle_s (_open).
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_S),
        auto_decompress=False,  # bytes pass through with their Content-Encoding
        cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
        skip_auto_headers=(hdrs.USER_AGENT, hdrs.ACCEPT_ENCODING),  # the client's own pass
    )
    ctx.store.set(SESSION, session)
    return session


@dataclass(slots=True)
class Call:
    """One routed request, for the watch, the metrics and the final answer."""

    started: float
    model: str = ""
    slot: str = ""
    status: int = 0
    lease: Lease | None = None
    response: web.StreamResponse | None = None  # set once streaming headers went out


def upstream_idle_s(ctx: ApiContext, slot: str) -> float:
    """The slot's ``upstream_idle_s``: how long its server may send nothing."""
    spec = ctx.manager.known(slot)
    return spec.upstream_idle_s if spec is not None else _IDLE_DEFAULT_S


def upstream_timeout(
    ctx: ApiContext, call: Call, seconds: float, *, connecting: bool = False
) -> Refusal:
    """The answer of a request whose server went silent for ``seconds`` (or took no
    connection within them): ``504 slot.upstream_timeout`` (in-band once the answer
    began), reported once (an event; the metrics count it). Both router paths give it."""
    what = (
        f"took no connection within {seconds:g}s"
        if connecting
        else f"sent nothing for {seconds:g}s (upstream_idle_s)"
    )
    error = SlotUpstreamTimeout(
        f"slot {call.slot!r}: its server {what}; the request was ended",
        slot=call.slot,
        idle_s=seconds,
    )
    report_refusal(ctx, error, call.model)
    return slot_refusal(error)


def record_call(ctx: ApiContext, call: Call) -> None:
    recorder = ctx.store.get(REQUEST_RECORDER)
    if recorder is None:
        return
    try:
        recorder.request_done(call.slot, call.model, call.status, time.monotonic() - call.started)
    except Exception:  # metrics must never fail a request: log it and answer anyway
        log.exception("metrics request_done failed")


# ----------------------------------------------------------------------------- forwarding


def _forward_headers(request: web.Request) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in REQUEST_DROP)


def _relay_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    return CIMultiDict(
        (k, v) for k, v in upstream.headers.items() if k.lower() not in RESPONSE_DROP
    )


async def _open(
    session: aiohttp.ClientSession, request: web.Request, url: str, body: bytes, idle_s: float
) -> aiohttp.ClientResponse:
    """Send the request upstream; once more if a kept-alive connection was found closed.
    No byte for ``idle_s`` (the head's wait included; aiohttp's ``sock_read``, whose timer
    stops while reading is paused for a slow client) raises ``ServerTimeoutError``."""
    headers = _forward_headers(request)
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=min(_CONNECT_S, idle_s), sock_read=idle_s
    )

    async def send() -> aiohttp.ClientResponse:
        # aiohttp writes large bytes in one go (and warns); a file-like goes in chunks.
        data = io.BytesIO(body) if len(body) > _RELAY_WHOLE_MAX else body
        return await session.request(
            request.method, url, data=data, headers=headers, allow_redirects=False, timeout=timeout
        )

    try:
        return await send()
    except aiohttp.ServerDisconnectedError:
        return await send()


def _failed(ctx: ApiContext, call: Call, exc: BaseException, idle_s: float) -> Refusal:
    """The refusal of an upstream failure: a timeout is ``slot.upstream_timeout``."""
    if isinstance(exc, aiohttp.ServerTimeoutError):
        connecting = isinstance(exc, aiohttp.ConnectionTimeoutError)
        return upstream_timeout(ctx, call, idle_s, connecting=connecting)
    return upstream_refusal(call.slot, exc)


async def _proxy(
    request: web.Request, ctx: ApiContext, call: Call, body: bytes
) -> web.StreamResponse:
    endpoint = ctx.manager.endpoint(call.slot)
    if endpoint is None:
        raise Refusal(
            503, f"slot {call.slot!r} has no endpoint", code="slot.not_ready", retry_after_s=1
        )
    idle_s = upstream_idle_s(ctx, call.slot)
    url = endpoint + upstream_path(request)
    try:
        upstream = await _open(_session(ctx), request, url, body, idle_s)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise _failed(ctx, call, exc, idle_s) from None
    async with upstream:
        headers = _relay_headers(upstream)
        sse = upstream.content_type == "text/event-stream"
        size = upstream.content_length
        if not sse and size is not None and size <= _RELAY_WHOLE_MAX:
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, OSError) as exc:
                raise _failed(ctx, call, exc, idle_s) from None
            call.status = upstream.status
            return web.Response(status=upstream.status, body=data, headers=headers)
        return await _relay_stream(request, upstream, headers, call, sse=sse, idle_s=idle_s)


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    headers: CIMultiDict[str],
    call: Call,
    *,
    sse: bool,
    idle_s: float,
) -> web.StreamResponse:
    """Write what arrived as soon as it arrives (no buffering, no re-framing): each
    ``readany`` returns everything the upstream delivered since the last one."""
    response = web.StreamResponse(status=upstream.status, headers=headers)
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    await response.prepare(request)
    call.response = response
    call.status = upstream.status
    content, write = upstream.content, response.write
    while True:
        try:
            chunk = await content.readany()
        except (aiohttp.ClientError, OSError) as exc:
            refusal = _failed(request.app[API_CTX], call, exc, idle_s)
            call.status = refusal.status
            await _end_broken(request, response, refusal, sse=sse)
            return response
        if not chunk:
            break
        try:
            await write(chunk)
        except ConnectionError:
            call.status = CLIENT_CLOSED
            return response
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response


async def _end_broken(
    request: web.Request, response: web.StreamResponse, refusal: Refusal, *, sse: bool
) -> None:
    """A response whose headers went out fails: say so in-band (SSE) or cut it short."""
    if sse:
        event = error_body(refusal.status, refusal.message, refusal.code)
        with contextlib.suppress(ConnectionError):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await response.write_eof()
            return
    transport = request.transport
    if transport is not None:
        transport.close()  # the client sees a truncated body, never a "complete" one


# ----------------------------------------------------------------------------- a request's life


async def _work(
    request: web.Request, ctx: ApiContext, call: Call, limit: int
) -> web.StreamResponse:
    """Read, pick, lease, proxy; the lease is released however this ends."""
    manager = ctx.manager
    try:
        body = await read_body(request, limit)
        model = requested_model(request, body)
        lease = await lease_model(ctx, call, model, endpoint_of(request.path))
        try:
            return await _proxy(request, ctx, call, body)
        finally:
            manager.release(lease)
    except Refusal as refusal:
        return refusal.response()
    except SlotctlError as exc:  # e.g. the slot was removed while we looked it up
        return slot_refusal(exc).response()


async def lease_model(ctx: ApiContext, call: Call, model: str, endpoint: str | None) -> Lease:
    """A lease on the best activated slot serving ``model`` whose type serves
    ``endpoint`` (:func:`~controller.api.selection.endpoint_of`; ``call`` records the
    model and the slot); else the refusal, reported once. Both router paths lease
    through it (the data plane in its two steps)."""
    now = lease_now(ctx, call, model, endpoint)
    return now if isinstance(now, Lease) else await lease_rest(ctx, call, now)


def lease_now(ctx: ApiContext, call: Call, model: str, endpoint: str | None) -> Lease | Pending:
    """:func:`lease_model` without a wait: the lease, or where it has to wait
    (:func:`lease_rest` goes on from there). A model whose slots' type does not serve
    ``endpoint`` is refused here, before anything is leased or loaded (400)."""
    manager = ctx.manager
    candidates = serving(manager, model)
    if not candidates:
        report_refusal(ctx, ModelNotFound(model), model)
        raise model_not_found(model)
    call.model = model
    if endpoint is not None:
        candidates, refused = fitting(manager, candidates, endpoint)
        if not candidates:
            raise wrong_endpoint(model, endpoint, refused)
    try:
        now = acquire_now(manager, candidates)
    except SlotctlError as exc:
        report_refusal(ctx, exc, model)
        raise slot_refusal(exc) from None
    if isinstance(now, Lease):
        call.lease, call.slot = now, now.slot
    return now


async def lease_rest(ctx: ApiContext, call: Call, pending: Pending) -> Lease:
    try:
        lease = await acquire_rest(ctx.manager, pending)
    except SlotctlError as exc:
        report_refusal(ctx, exc, call.model)
        raise slot_refusal(exc) from None
    call.lease, call.slot = lease, lease.slot
    return lease


def report_refusal(ctx: ApiContext, error: SlotctlError, model: str) -> None:
    """A refusal the manager did not report already gets its one event and log line."""
    if error.reported:
        return
    error.reported = True
    ctx.events.emit(
        EventKind.REFUSAL,
        Op.ROUTE,
        slot=error.details.get("slot"),
        model=model,
        message=error.message,
        error=error.code,
    )


class _Watch:
    """Cancels the request's task once the client left (``"client"``) or its lease was
    revoked (``"lease"``): a re-armed loop timer, no task and no wake-up per event."""

    __slots__ = ("_call", "_request", "_task", "_timer", "reason")

    def __init__(self, request: web.Request, call: Call, task: asyncio.Task[object]) -> None:
        self._request, self._call, self._task = request, call, task
        self.reason: str | None = None
        self._timer = asyncio.get_running_loop().call_later(_WATCH_S, self._look)

    def _look(self) -> None:
        lease = self._call.lease
        if self._request.transport is None:
            self.reason = "client"
        elif lease is not None and lease.revoked:
            self.reason = "lease"
        else:
            self._timer = asyncio.get_running_loop().call_later(_WATCH_S, self._look)
            return
        self._task.cancel()

    def stop(self) -> None:
        self._timer.cancel()


async def route_request(request: web.Request, *, limit: int) -> web.StreamResponse:
    """One routed request, from its body to its last byte (see the module docstring)."""
    ctx = request.app[API_CTX]
    call = Call(started=time.monotonic())
    task = asyncio.current_task()
    assert task is not None  # a handler always runs in a task
    watch = _Watch(request, call, task)
    try:
        try:
            response = await _work(request, ctx, call, limit)
        finally:
            watch.stop()
        if watch.reason is not None and task.cancelling():
            task.uncancel()  # the work finished before the cancel reached it
    except asyncio.CancelledError:
        if watch.reason is None:  # not ours (the server shuts down): let it through
            call.status = call.status or CLIENT_CLOSED
            record_call(ctx, call)
            raise
        task.uncancel()
        response = await _interrupted(request, call, watch.reason)
    except ConnectionError:  # the client left while we read its body
        call.status = CLIENT_CLOSED
        response = web.Response(status=CLIENT_CLOSED)
    except Exception as exc:
        log.error("router: unexpected error in %s %s", request.method, request.path, exc_info=exc)
        response = await _internal_error(request, call)
    call.status = call.status or response.status
    record_call(ctx, call)
    return response


async def _internal_error(request: web.Request, call: Call) -> web.StreamResponse:
    call.status = 500
    refusal = Refusal(500, "internal error (see the log)", code="internal")
    if call.response is None:
        return refusal.response()
    await _end_broken(request, call.response, refusal, sse=_is_sse(call.response))
    return call.response


def revoked(call: Call) -> Refusal:
    """The answer of a request whose lease was revoked (its slot crashed or went away);
    both router paths give it."""
    error = call.lease.error if call.lease is not None else None
    if error is not None:
        return slot_refusal(error)
    return Refusal(502, f"slot {call.slot!r} went away", code="upstream.failed")


async def _interrupted(request: web.Request, call: Call, reason: str) -> web.StreamResponse:
    """The answer after the watch cancelled the work (its lease is already released)."""
    if reason == "client":
        call.status = CLIENT_CLOSED
        return call.response or web.Response(status=CLIENT_CLOSED)
    refusal = revoked(call)
    call.status = refusal.status
    if call.response is None:
        return refusal.response()
    await _end_broken(request, call.response, refusal, sse=_is_sse(call.response))
    return call.response


def _is_sse(response: web.StreamResponse) -> bool:
    return response.content_type == "text/event-stream"
