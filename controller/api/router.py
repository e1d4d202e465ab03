"""The OpenAI-compatible router (SPEC §7): ``/v1/models``, completions, embeddings, audio.

One request's path through the router:

1. read the body (JSON, or multipart for ``/v1/audio/*``) and take its ``model``;
2. rank the activated slots bound to that model with
   :func:`~controller.lifecycle.rank_candidates` (dispatchable first; ties: priority, most
   recently used, name) and acquire a lease on the best one through the SlotManager. A
   cold slot loads and concurrent cold requests join that one load; ``max_queue`` bounds
   the waiters (429 beyond it). A refusal on one candidate falls through to the next;
3. proxy the body unchanged to the slot's endpoint with one shared
   :class:`aiohttp.ClientSession` (kept in ``ctx.extra``, closed on app cleanup). Small
   complete bodies are relayed whole; ``text/event-stream`` (and every unsized or large
   body) is written chunk by chunk as it arrives, never buffered;
4. release the lease when the response is complete, when the upstream fails, when the
   client disconnects and when the lease is revoked (the slot crashed or was unloaded).

The server does not cancel handlers when a client leaves (aiohttp's default,
``handler_cancellation=False``, which keeps the REST routes' manager operations from
being cut in half), so every router request runs as a *work* task next to a small
*guard* that notices a disconnect (the transport goes away) or a revoked lease and
cancels the work: its ``finally`` releases the lease, also while the request still waits
for a cold load or for the upstream's first byte.

Errors leave in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
unknown model 404 ``model_not_found``, bad body 400, queue full 429, crash looping,
insufficient memory and not-ready 503 (all with ``Retry-After``), an upstream that cannot
be reached or breaks before answering 502. A stream that breaks after its first byte ends
with one ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from email.message import Message
from typing import Any, Final

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict
from pydantic import BaseModel, ConfigDict, Field

from controller.api.app import API_CTX, ApiContext, RouteTable, json_response, openai_error_body
from controller.api.selection import serving
from controller.errors import (
    InsufficientMemory,
    ModelNotFound,
    SlotctlError,
    SlotNotFound,
    SlotNotReady,
)
from controller.events import EventKind, Op
from controller.slots import Lease, SlotManager

__all__ = ["openai_error", "setup"]

log = logging.getLogger("slotctl.router")

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

SESSION_KEY: Final = "router_session"  # ctx.extra: the shared upstream ClientSession
METRICS_KEY: Final = "metrics"  # ctx.extra: optional object with request_done(...)

_JSON_MAX_BYTES: Final = 8 * 1024 * 1024
_AUDIO_MAX_BYTES: Final = 64 * 1024 * 1024  # uploads of a long recording
_RELAY_WHOLE_MAX: Final = 1024 * 1024  # sized non-stream bodies up to this are relayed whole
_GUARD_POLL_S: Final = 0.1  # how often the guard looks at the client connection
_NOT_READY_TRIES: Final = 3  # a slot swapped out between its load and our lease: queue again
_RETRY_S: Final = 1.0  # Retry-After for 503s that carry no figure of their own
_MEMORY_RETRY_S: Final = 5.0  # insufficient memory: leases have to end first
_CLIENT_CLOSED: Final = 499  # nginx's status for "client closed the request" (metrics only)
_CREATED: Final = int(time.time())

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
_REQUEST_DROP: Final = _HOP_BY_HOP | {
    hdrs.AUTHORIZATION.lower(),
    hdrs.COOKIE.lower(),
    hdrs.EXPECT.lower(),  # answered by this server already
}
_RESPONSE_DROP: Final = _HOP_BY_HOP | {
    hdrs.SET_COOKIE.lower(),
    hdrs.SERVER.lower(),
    hdrs.DATE.lower(),
}


# ----------------------------------------------------------------------------- schemas


class OpenAIRequest(BaseModel):
    """An OpenAI request body. The router reads ``model`` only; the rest passes through."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="catalogue model id: picks the slot")
    stream: bool = Field(default=False, description="server-sent events, passed through")


class OpenAIModel(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str


class OpenAIModelList(BaseModel):
    object: str = "list"
    data: list[OpenAIModel]


_PROXY_RESPONSES: Final = {
    200: ("the upstream's answer (JSON, or text/event-stream when streaming)", None),
    400: ("no JSON body or no model", None),
    404: ("model_not_found", None),
    413: ("body too large", None),
    429: ("queue full (Retry-After)", None),
    502: ("upstream unreachable or failed", None),
    503: ("crash looping, insufficient memory or not ready (Retry-After)", None),
}


# ----------------------------------------------------------------------------- errors


class _Refusal(Exception):
    """A request the router answers itself (rendered by :func:`openai_error`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        return openai_error(
            self.status,
            self.message,
            code=self.code,
            param=self.param,
            retry_after_s=self.retry_after_s,
        )


def openai_error(
    status: int,
    message: str,
    *,
    code: str,
    param: str | None = None,
    retry_after_s: float | None = None,
) -> web.Response:
    """``{"error": {"message", "type", "param", "code"}}`` with ``Retry-After`` if given."""
    headers: dict[str, str] = {}
    if retry_after_s is not None and retry_after_s > 0:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return json_response(_error_body(status, message, code, param), status=status, headers=headers)


def _error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return openai_error_body(status, message, code, param)


def _model_not_found(model: str) -> _Refusal:
    return _Refusal(
        404,
        f"The model '{model}' does not exist or no activated slot serves it",
        code="model_not_found",
        param="model",
    )


def _slot_refusal(error: SlotctlError) -> _Refusal:
    """A typed slot error as the router's answer (SPEC §1 table, router column)."""
    if isinstance(error, ModelNotFound):
        return _model_not_found(str(error.details.get("model", "")))
    status = error.http_status
    retry = error.details.get("retry_after_s")
    retry_s = float(retry) if isinstance(retry, int | float) and retry > 0 else None
    if isinstance(error, InsufficientMemory):
        status, retry_s = 503, retry_s or _MEMORY_RETRY_S
    elif isinstance(error, SlotNotFound) or status == 409:
        status = 503  # removed meanwhile / a pinned exclusive peer: not servable now
    elif status == 500:
        status = 502  # the model server failed to start: a bad gateway, not our bug
    if status in (429, 503):
        retry_s = retry_s or _RETRY_S
    return _Refusal(status, error.message, code=error.code, retry_after_s=retry_s)


def _upstream_refusal(slot: str, exc: BaseException) -> _Refusal:
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        return _Refusal(502, f"slot {slot!r} is unreachable: {detail}", code="upstream.unreachable")
    return _Refusal(502, f"slot {slot!r} failed to answer: {detail}", code="upstream.failed")


# ----------------------------------------------------------------------------- plumbing


def setup(app: web.Application) -> None:
    """Close the shared upstream session when the app is cleaned up."""
    app.on_cleanup.append(_close_session)


async def _close_session(app: web.Application) -> None:
    session = app[API_CTX].extra.pop(SESSION_KEY, None)
    if isinstance(session, aiohttp.ClientSession):
        await session.close()


def _session(ctx: ApiContext) -> aiohttp.ClientSession:
    """The shared upstream session, created on first use (inside the running loop)."""
    session = ctx.extra.get(SESSION_KEY)
    if isinstance(session, aiohttp.ClientSession) and not session.closed:
        return session
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0),
        # No total or read timeout: a generation may take long, and a client that gives
        # up disconnects (the guard then cancels the upstream request).
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
        auto_decompress=False,  # bytes pass through with their Content-Encoding
        cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
        skip_auto_headers=(hdrs.USER_AGENT, hdrs.ACCEPT_ENCODING),  # the client's own pass
    )
    ctx.extra[SESSION_KEY] = session
    return session


@dataclass(slots=True)
class _Call:
    """One routed request, for the guard, the metrics and the final answer."""

    started: float
    model: str = ""
    slot: str = ""
    status: int = 0
    lease: Lease | None = None
    response: web.StreamResponse | None = None  # set once streaming headers went out


def _record(ctx: ApiContext, call: _Call) -> None:
    metrics = ctx.extra.get(METRICS_KEY)
    done = getattr(metrics, "request_done", None)
    if done is None:
        return
    try:
        done(call.slot, call.model, call.status, time.monotonic() - call.started)
    except Exception:  # metrics must never fail a request: log it and answer anyway
        log.exception("metrics request_done failed")


# ----------------------------------------------------------------------------- request


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (413)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise _Refusal(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _requested_model(request: web.Request, body: bytes) -> str:
    """``model`` from a JSON object body or a multipart form field (400 otherwise)."""
    if request.content_type == "multipart/form-data":
        model = _multipart_field(request.headers.get(hdrs.CONTENT_TYPE, ""), body, "model")
    else:
        if not body.strip():
            raise _Refusal(400, "a JSON request body is required", code="invalid_body")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise _Refusal(
                400, f"request body is not valid JSON: {exc}", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise _Refusal(400, "request body must be a JSON object", code="invalid_body")
        model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _Refusal(
            400,
            "'model' is required and must be a non-empty string",
            code="invalid_model",
            param="model",
        )
    return model


def _multipart_field(content_type: str, body: bytes, name: str) -> str | None:
    """The value of one text field of a multipart/form-data body (None when absent)."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise _Refusal(400, "multipart body without a boundary", code="invalid_body")
    delimiter = b"--" + boundary.encode("latin-1")
    position = body.find(delimiter)
    while position >= 0:
        start = position + len(delimiter)
        if body.startswith(b"--", start):
            return None  # the closing delimiter
        end = body.find(delimiter, start)
        part = body[start : end if end >= 0 else len(body)]
        head, sep, value = part.lstrip(b"\r\n").partition(b"\r\n\r\n")
        if sep and _form_name(head) == name:
            return value.removesuffix(b"\r\n").decode("utf-8", errors="replace").strip()
        position = end
    return None


def _form_name(head: bytes) -> str | None:
    for line in head.decode("latin-1").split("\r\n"):
        key, _, value = line.partition(":")
        if key.strip().lower() == "content-disposition":
            disposition = Message()
            disposition["content-disposition"] = value.strip()
            found = disposition.get_param("name", header="content-disposition")
            return found if isinstance(found, str) else None
    return None


# ----------------------------------------------------------------------------- routing


def _candidates(manager: SlotManager, model: str) -> list[str]:
    """The activated slots serving ``model``, best first (:mod:`.selection`)."""
    return [view.name for view in serving(manager, model)]


async def _acquire(manager: SlotManager, candidates: list[str]) -> Lease:
    """A lease on the best candidate that grants one; else the best one's refusal."""
    errors: list[SlotctlError] = []
    for name in candidates:
        try:
            return await _acquire_one(manager, name)
        except SlotctlError as exc:
            errors.append(exc)
    raise errors[0]


async def _acquire_one(manager: SlotManager, name: str) -> Lease:
    attempt = 1
    while True:
        try:
            return await manager.acquire(name)
        except SlotNotReady:
            # Unloading (an exclusive peer's swap, an eviction) or a superseded load just
            # before our turn: queue again (bounded) rather than answer 503 at once.
            if attempt >= _NOT_READY_TRIES:
                raise
            attempt += 1


def _forward_headers(request: web.Request) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _REQUEST_DROP)


def _relay_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    return CIMultiDict(
        (k, v) for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP
    )


async def _open(
    session: aiohttp.ClientSession, request: web.Request, url: str, body: bytes
) -> aiohttp.ClientResponse:
    """Send the request upstream; once more if a kept-alive connection was found closed."""
    headers = _forward_headers(request)

    def data() -> bytes | io.BytesIO:
        # aiohttp writes large bytes in one go (and warns); a file-like goes in chunks.
        return io.BytesIO(body) if len(body) > _RELAY_WHOLE_MAX else body

    try:
        return await session.request(
            request.method, url, data=data(), headers=headers, allow_redirects=False
        )
    except aiohttp.ServerDisconnectedError:
        return await session.request(
            request.method, url, data=data(), headers=headers, allow_redirects=False
        )


_AUDIO_TAIL = re.compile(r"[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*")


def _upstream_path(request: web.Request) -> str:
    """The path (and query) to forward: only the OpenAI endpoint itself, never more.

    ``/v1/audio/{path}`` takes plain segments only, so ``..`` or ``%2e%2e`` cannot reach a
    server's other routes (llama-server's ``/slots``, vLLM's admin endpoints).
    """
    tail = request.match_info.get("path")
    if tail is not None and not _AUDIO_TAIL.fullmatch(tail):
        raise _Refusal(400, f"invalid audio endpoint {tail!r}", code="invalid_request_error")
    path = request.path  # decoded and matched by the router; never the raw path
    query = request.query_string
    return f"{path}?{query}" if query else path


async def _proxy(
    request: web.Request, ctx: ApiContext, call: _Call, body: bytes
) -> web.StreamResponse:
    endpoint = ctx.manager.view(call.slot).endpoint
    if endpoint is None:
        raise _Refusal(
            503, f"slot {call.slot!r} has no endpoint", code="slot.not_ready", retry_after_s=1
        )
    try:
        upstream = await _open(_session(ctx), request, endpoint + _upstream_path(request), body)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise _upstream_refusal(call.slot, exc) from None
    async with upstream:
        headers = _relay_headers(upstream)
        sse = upstream.content_type == "text/event-stream"
        size = upstream.content_length
        if not sse and size is not None and size <= _RELAY_WHOLE_MAX:
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, OSError) as exc:
                raise _upstream_refusal(call.slot, exc) from None
            call.status = upstream.status
            return web.Response(status=upstream.status, body=data, headers=headers)
        return await _relay_stream(request, upstream, headers, call, sse=sse)


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    headers: CIMultiDict[str],
    call: _Call,
    *,
    sse: bool,
) -> web.StreamResponse:
    """Write each upstream chunk as soon as it arrives (no buffering, no re-framing)."""
    response = web.StreamResponse(status=upstream.status, headers=headers)
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    await response.prepare(request)
    call.response = response
    call.status = upstream.status
    while True:
        try:
            chunk = await upstream.content.readany()
        except (aiohttp.ClientError, OSError) as exc:
            call.status = 502
            await _end_broken(request, response, _upstream_refusal(call.slot, exc), sse=sse)
            return response
        if not chunk:
            break
        try:
            await response.write(chunk)
        except ConnectionError:
            call.status = _CLIENT_CLOSED
            return response
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response


async def _end_broken(
    request: web.Request, response: web.StreamResponse, refusal: _Refusal, *, sse: bool
) -> None:
    """A response whose headers went out fails: say so in-band (SSE) or cut it short."""
    if sse:
        event = _error_body(refusal.status, refusal.message, refusal.code)
        with contextlib.suppress(ConnectionError):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await response.write_eof()
            return
    transport = request.transport
    if transport is not None:
        transport.close()  # the client sees a truncated body, never a "complete" one


async def _work(
    request: web.Request, ctx: ApiContext, call: _Call, limit: int
) -> web.StreamResponse:
    """Read, pick, lease, proxy; the lease is released however this ends."""
    manager: SlotManager = ctx.manager
    try:
        body = await _read_body(request, limit)
        model = _requested_model(request, body)
        candidates = _candidates(manager, model)
        if not candidates:
            _report(ctx, ModelNotFound(model), model)
            raise _model_not_found(model)
        call.model = model
        try:
            lease = await _acquire(manager, candidates)
        except SlotctlError as exc:
            _report(ctx, exc, model)
            raise _slot_refusal(exc) from None
        call.lease, call.slot = lease, lease.slot
        try:
            return await _proxy(request, ctx, call, body)
        finally:
            manager.release(lease)
    except _Refusal as refusal:
        return refusal.response()
    except SlotctlError as exc:  # e.g. the slot was removed while we looked it up
        return _slot_refusal(exc).response()


def _report(ctx: ApiContext, error: SlotctlError, model: str) -> None:
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


async def _guard(request: web.Request, call: _Call) -> str:
    """Returns ``"client"`` when the client disconnects, ``"lease"`` when it is revoked."""
    while True:
        if request.transport is None:
            return "client"
        lease = call.lease
        if lease is not None and lease.lost.is_set():
            return "lease"
        if lease is None:
            await asyncio.sleep(_GUARD_POLL_S)
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_GUARD_POLL_S):
                await lease.lost.wait()


async def _route(request: web.Request, *, limit: int = _JSON_MAX_BYTES) -> web.StreamResponse:
    ctx = request.app[API_CTX]
    call = _Call(started=time.monotonic())
    work = asyncio.create_task(_work(request, ctx, call, limit))
    guard = asyncio.create_task(_guard(request, call))
    try:
        await asyncio.wait((work, guard), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (guard, work):
            if not task.done():
                task.cancel()
        await asyncio.gather(guard, work, return_exceptions=True)
    try:
        response = await _outcome(request, call, work, guard)
        call.status = call.status or response.status
        return response
    except BaseException:
        call.status = call.status or 500
        raise
    finally:
        _record(ctx, call)


async def _outcome(
    request: web.Request,
    call: _Call,
    work: asyncio.Task[web.StreamResponse],
    guard: asyncio.Task[str],
) -> web.StreamResponse:
    """The response once the work ended or the guard cut it short."""
    if not work.cancelled():
        exc = work.exception()
        if exc is None:
            return work.result()
        if isinstance(exc, ConnectionError):  # the client left while we read its body
            call.status = _CLIENT_CLOSED
            return web.Response(status=_CLIENT_CLOSED)
        log.error("router: unexpected error in %s %s", request.method, request.path, exc_info=exc)
        call.status = 500
        if call.response is not None:
            await _end_broken(
                request,
                call.response,
                _Refusal(500, "internal error (see the log)", code="internal"),
                sse=_is_sse(call.response),
            )
            return call.response
        return openai_error(500, "internal error (see the log)", code="internal")
    reason = guard.result() if guard.done() and not guard.cancelled() else "client"
    return await _interrupted(request, call, reason)


async def _interrupted(request: web.Request, call: _Call, reason: str) -> web.StreamResponse:
    """The answer after the guard cancelled the work (its lease is already released)."""
    if reason == "client":
        call.status = _CLIENT_CLOSED
        return call.response or web.Response(status=_CLIENT_CLOSED)
    error = call.lease.error if call.lease is not None else None
    refusal = (
        _slot_refusal(error)
        if error is not None
        else _Refusal(502, f"slot {call.slot!r} went away", code="upstream.failed")
    )
    call.status = refusal.status
    if call.response is None:
        return refusal.response()
    await _end_broken(request, call.response, refusal, sse=_is_sse(call.response))
    return call.response


def _is_sse(response: web.StreamResponse) -> bool:
    return response.content_type == "text/event-stream"


# ----------------------------------------------------------------------------- routes


@route(
    "GET",
    "/v1/models",
    summary="OpenAI model list: catalogue models with an activated slot",
    tag="openai",
    responses={200: ("models", OpenAIModelList)},
)
async def v1_models(request: web.Request) -> web.Response:
    manager: SlotManager = request.app[API_CTX].manager
    data = [_openai_model(model_id) for model_id in served_ids(manager)]
    return json_response({"object": "list", "data": data})


def _openai_model(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": _CREATED, "owned_by": "slotctl"}


@route(
    "GET",
    "/v1/models/{model_id:.+}",
    summary="OpenAI model retrieve: one model of /v1/models (404 in OpenAI's shape)",
    tag="openai",
    responses={200: ("model", OpenAIModel), 404: ("unknown model", None)},
)
async def v1_model(request: web.Request) -> web.Response:
    manager: SlotManager = request.app[API_CTX].manager
    model_id = request.match_info["model_id"]
    if model_id not in served_ids(manager):
        return _model_not_found(model_id).response()
    return json_response(_openai_model(model_id))


def served_ids(manager: SlotManager) -> list[str]:
    """What ``model`` may name: catalogue models with an activated slot, in catalogue
    order, then the model-less (self-managed) activated slots by name."""
    served: set[str] = set()
    modelless: list[str] = []
    for view in manager.views():
        spec = manager.known(view.name)
        if spec is None or not spec.activated:
            continue
        if view.model_id:
            served.add(view.model_id)
        else:
            modelless.append(view.name)
    return [m for m in manager.models if m in served] + [
        n for n in modelless if n not in manager.models
    ]


@route(
    "POST",
    "/v1/chat/completions",
    summary="OpenAI chat completions, routed by model (streaming passes through)",
    tag="openai",
    body=OpenAIRequest,
    responses=_PROXY_RESPONSES,
)
async def v1_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _route(request)


@route(
    "POST",
    "/v1/completions",
    summary="OpenAI text completions, routed by model (streaming passes through)",
    tag="openai",
    body=OpenAIRequest,
    responses=_PROXY_RESPONSES,
)
async def v1_completions(request: web.Request) -> web.StreamResponse:
    return await _route(request)


@route(
    "POST",
    "/v1/embeddings",
    summary="OpenAI embeddings, routed by model",
    tag="openai",
    body=OpenAIRequest,
    responses=_PROXY_RESPONSES,
)
async def v1_embeddings(request: web.Request) -> web.StreamResponse:
    return await _route(request)


@route(
    "POST",
    "/v1/audio/{path:.+}",
    summary="OpenAI audio (speech, transcriptions, translations): body passed through as-is",
    tag="openai",
    responses=_PROXY_RESPONSES,
)
async def v1_audio(request: web.Request) -> web.StreamResponse:
    if not _AUDIO_TAIL.fullmatch(request.match_info["path"]):  # before any lease or load
        return openai_error(
            400,
            f"invalid audio endpoint {request.match_info['path']!r}",
            code="invalid_request_error",
        )
    return await _route(request, limit=_AUDIO_MAX_BYTES)
