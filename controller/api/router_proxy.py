"""Forwarding a routed request: lease, proxy, relay, release — and the watch that cuts it.

Part of the OpenAI router's aiohttp path (:mod:`controller.api.router` is its route
table, :mod:`controller.api.router_answers` reads and renders refusals). Most routed
requests never get here: the data plane (:mod:`controller.dataplane`) serves them at the
socket; both paths share :mod:`controller.router` (the records, the lease, the refusals,
the headers passed). This is the path of what the data plane leaves to aiohttp (a chunked
upload, ``HTTP/1.0``, a head it does not take, any server built without it), with the
same answers. One request's path:

1. read the body and take its ``model``; rank the activated slots serving it
   (:func:`~controller.router.selection.serving`, no view built) and lease the best that
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict

from controller.api.app import API_CTX, CLOSED, ApiContext, CtxKey, principal_of
from controller.api.router_answers import (
    read_body,
    refusal_response,
    requested_model,
    upstream_path,
    upstream_refusal,
)
from controller.model.errors import SlotctlError
from controller.router.access import PRIORITY_HEADER, requester
from controller.router.body import with_model
from controller.router.context import CLIENT_CLOSED, Call, record_call, upstream_idle_s
from controller.router.headers import REQUEST_DROP, RESPONSE_DROP, connection_names, passes
from controller.router.leasing import lease_model
from controller.router.refusals import (
    Refusal,
    error_body,
    revoked,
    shutting_down,
    slot_refusal,
    upstream_timeout,
)
from controller.router.selection import endpoint_of

__all__ = ["SESSION", "route_request", "setup"]

log = logging.getLogger("slotctl.router")

SESSION: Final = CtxKey("router_session", aiohttp.ClientSession)  # the upstream session

_RELAY_WHOLE_MAX: Final = 1024 * 1024  # sized non-stream bodies up to this are relayed whole
_WATCH_S: Final = 0.1  # how often the watch looks at the client connection and the lease
_CONNECT_S: Final = 10.0  # connect timeout (the slot's upstream_idle_s when shorter)


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
    if ctx.closed:
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
class ProxyCall(Call):
    """A routed request on aiohttp's path: its streamed response once the head went out."""

    response: web.StreamResponse | None = None


# ----------------------------------------------------------------------------- forwarding


def _passed(headers: Mapping[str, str], drop: frozenset[str]) -> CIMultiDict[str]:
    """The headers passed on (:mod:`controller.router.headers`)."""
    named = connection_names(headers.getall("Connection", ()))  # type: ignore[attr-defined]
    return CIMultiDict((k, v) for k, v in headers.items() if passes(k.lower(), drop, named))


def _forward_headers(request: web.Request) -> CIMultiDict[str]:
    return _passed(request.headers, REQUEST_DROP)


def _relay_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    return _passed(upstream.headers, RESPONSE_DROP)


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


def _failed(ctx: ApiContext, call: ProxyCall, exc: BaseException, idle_s: float) -> Refusal:
    """The refusal of an upstream failure: a timeout is ``slot.upstream_timeout``."""
    if isinstance(exc, aiohttp.ServerTimeoutError):
        connecting = isinstance(exc, aiohttp.ConnectionTimeoutError)
        return upstream_timeout(ctx, call, idle_s, connecting=connecting)
    return upstream_refusal(call.slot, exc)


async def _proxy(
    request: web.Request, ctx: ApiContext, call: ProxyCall, body: bytes
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
            call.keep(data)
            return web.Response(status=upstream.status, body=data, headers=headers)
        return await _relay_stream(request, upstream, headers, call, sse=sse, idle_s=idle_s)


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    headers: CIMultiDict[str],
    call: ProxyCall,
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
        call.keep(chunk)
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
    request: web.Request, ctx: ApiContext, call: ProxyCall, limit: int
) -> web.StreamResponse:
    """Read, pick, lease, proxy; the lease is released however this ends."""
    manager = ctx.manager
    try:
        principal = call.principal = principal_of(request)
        if principal is not None:
            asked = request.headers.get(PRIORITY_HEADER)
            call.who = requester(manager.settings, principal, asked)
        body = await read_body(request, limit)
        model = requested_model(request, body)
        lease = await lease_model(ctx, call, model, endpoint_of(request.path))
        if call.alias:  # the member's server sees the model it serves
            body = with_model(request.headers.get(hdrs.CONTENT_TYPE, ""), body, call.model)
        try:
            return await _proxy(request, ctx, call, body)
        finally:
            manager.release(lease)
    except Refusal as refusal:
        return refusal_response(refusal)
    except SlotctlError as exc:  # e.g. the slot was removed while we looked it up
        return refusal_response(slot_refusal(exc))


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
    call = ProxyCall(started=time.monotonic())
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


async def _internal_error(request: web.Request, call: ProxyCall) -> web.StreamResponse:
    call.status = 500
    refusal = Refusal(500, "internal error (see the log)", code="internal")
    if call.response is None:
        return refusal_response(refusal)
    await _end_broken(request, call.response, refusal, sse=_is_sse(call.response))
    return call.response


async def _interrupted(request: web.Request, call: ProxyCall, reason: str) -> web.StreamResponse:
    """The answer after the watch cancelled the work (its lease is already released)."""
    if reason == "client":
        call.status = CLIENT_CLOSED
        return call.response or web.Response(status=CLIENT_CLOSED)
    refusal = revoked(call)
    call.status = refusal.status
    if call.response is None:
        return refusal_response(refusal)
    await _end_broken(request, call.response, refusal, sse=_is_sse(call.response))
    return call.response


def _is_sse(response: web.StreamResponse) -> bool:
    return response.content_type == "text/event-stream"
