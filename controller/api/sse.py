"""``GET /api/events``: the event bus as Server-Sent Events, resumable.

Each event leaves as::

    id: <event id>
    event: <kind>
    data: <one-line JSON of Event.to_dict()>

A client that reconnects with ``Last-Event-ID`` (header, or ``?last_event_id=`` for
clients that cannot set headers) first gets the buffered events after that id
(:meth:`EventBus.since`), then the live ones, without duplicates: the subscription is
taken *before* the replay and live events already replayed are skipped. When events the
client asked for are no longer buffered — its id is older than the bounded buffer, the
controller restarted (ids start again at 1), or a slow client's queue overflowed — an
``event: gap`` says so first and the client should re-read the full state
(``GET /api/slots``). A comment line every 15 s keeps proxies from closing an idle stream.
The subscription is dropped when the client goes away and every stream ends when the
server shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any, Final

from aiohttp import web

from controller.access.withheld import sees_secrets, withhold_strings
from controller.api.app import API_CTX, ApiContext, CtxKey, Query, RouteTable, principal_of
from controller.kit.eventbus import EventBus, Subscription
from controller.model.errors import InvalidRequest
from controller.model.events import Event

__all__ = ["KEEPALIVE", "format_event", "setup"]

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

KEEPALIVE_S: Final = 15.0
KEEPALIVE: Final = CtxKey("sse_keepalive_s", float)  # an override of KEEPALIVE_S (tests)
_POLL_S: Final = 1.0  # how often an idle stream checks that its client is still there
_RETRY_MS: Final = 2000

_CLOSING: Final = web.AppKey("slotctl_sse_closing", asyncio.Event)


def setup(app: web.Application) -> None:
    """End every open stream when the server shuts down (instead of waiting for them)."""
    closing = asyncio.Event()
    app[_CLOSING] = closing

    async def on_shutdown(_: web.Application) -> None:
        closing.set()

    app.on_shutdown.append(on_shutdown)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _frame(event_id: int | None, kind: str, data: Any) -> bytes:
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append(f"event: {kind}")
    # json.dumps escapes newlines inside strings: the data is always one line.
    lines.append("data: " + json.dumps(_clean(data), default=str, separators=(",", ":")))
    return ("\n".join(lines) + "\n\n").encode()


def format_event(event: Event, *, withheld: bool = False) -> bytes:
    """One event as an SSE frame (``id``, ``event``, ``data``); ``withheld``: for a key
    below ``admin`` (the URLs' credentials in its messages cut)."""
    data = event.to_dict()
    return _frame(event.id, event.kind, withhold_strings(data) if withheld else data)


def _last_event_id(request: web.Request) -> int | None:
    raw = request.headers.get("Last-Event-ID")
    if raw is None or not raw.strip():
        raw = request.query.get("last_event_id")
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise InvalidRequest(
            f"Last-Event-ID must be an event id (a non-negative integer), got {raw!r}"
        ) from None
    if value < 0:
        raise InvalidRequest(f"Last-Event-ID must not be negative, got {value}")
    return value


def _replay(bus: EventBus, last: int) -> tuple[list[Event], dict[str, Any] | None]:
    """Buffered events after ``last`` and, when some are gone, what the gap says."""
    if last > bus.last_id:  # ids from before a controller restart
        return bus.since(0), {
            "reason": "reset",
            "last_event_id": last,
            "message": "the controller restarted: event ids start again; re-read the state",
        }
    events = bus.since(last)
    missed = bus.last_id - last - len(events)  # left the buffers (lease flips sooner)
    if missed > 0:
        return events, {
            "reason": "expired",
            "last_event_id": last,
            "first_available": events[0].id if events else None,
            "missed": missed,
            "message": "events after Last-Event-ID left the buffer; re-read the state",
        }
    return events, None


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@route(
    "GET",
    "/api/events",
    summary="Server-Sent Events: transitions, refusals, evictions, reconcile plans and "
    "errors; resume with Last-Event-ID",
    tag="events",
    query=[
        Query(
            "last_event_id",
            "integer",
            "resume after this event id (as the Last-Event-ID header does)",
        )
    ],
    responses={200: ("text/event-stream of events (never ends by itself)", str)},
    content_type="text/event-stream",
)
async def event_stream(request: web.Request) -> web.StreamResponse:
    ctx: ApiContext = request.app[API_CTX]
    bus = ctx.events
    last = _last_event_id(request)
    keepalive = ctx.store.get(KEEPALIVE) or KEEPALIVE_S
    closing = request.app.get(_CLOSING) or asyncio.Event()
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache, no-store",
            "X-Accel-Buffering": "no",  # nginx and friends: do not buffer the stream
        },
    )
    with bus.subscribe() as sub:  # before the replay: nothing falls between the two
        # Synchronously with subscribing: what to replay, and the id the live feed starts
        # after (events queued meanwhile with smaller ids were replayed: skipped).
        events, gap = _replay(bus, last) if last is not None else ([], None)
        sent = events[-1].id if events else bus.last_id
        await response.prepare(request)
        withheld = not sees_secrets(principal_of(request))
        with contextlib.suppress(ConnectionError):
            await _stream(request, response, sub, events, gap, sent, keepalive, closing, withheld)
    return response


async def _stream(
    request: web.Request,
    response: web.StreamResponse,
    sub: Subscription,
    replay: list[Event],
    gap: dict[str, Any] | None,
    sent: int,
    keepalive: float,
    closing: asyncio.Event,
    withheld: bool = False,
) -> None:
    loop = asyncio.get_running_loop()
    poll = min(_POLL_S, keepalive)
    await response.write(f"retry: {_RETRY_MS}\n: slotctl event stream\n\n".encode())
    if gap is not None:
        await response.write(_frame(None, "gap", gap))
    if replay:
        await response.write(b"".join(format_event(e, withheld=withheld) for e in replay))
    dropped = sub.dropped
    last_write = loop.time()
    closed = asyncio.ensure_future(closing.wait())
    pending: asyncio.Future[Event] = asyncio.ensure_future(sub.get())
    try:
        while not closing.is_set():
            waiting: set[asyncio.Future[Any]] = {pending, closed}
            done, _ = await asyncio.wait(waiting, timeout=poll, return_when=asyncio.FIRST_COMPLETED)
            if closed in done:
                break
            if pending in done:
                batch = [pending.result()]
                while (more := sub.get_nowait()) is not None:
                    batch.append(more)
                pending = asyncio.ensure_future(sub.get())
                if sub.dropped != dropped:  # a slow client: its queue overflowed
                    lost = sub.dropped - dropped
                    dropped = sub.dropped
                    await response.write(
                        _frame(
                            None,
                            "gap",
                            {
                                "reason": "overflow",
                                "last_event_id": sent,
                                "missed": lost,
                                "message": "this client fell behind; re-read the state",
                            },
                        )
                    )
                chunk = b"".join(format_event(e, withheld=withheld) for e in batch if e.id > sent)
                if chunk:
                    await response.write(chunk)
                    sent = max(sent, batch[-1].id)
                    last_write = loop.time()
                continue
            if _client_gone(request):
                break
            if loop.time() - last_write >= keepalive:
                await response.write(b": keep-alive\n\n")
                last_write = loop.time()
    finally:
        for future in (pending, closed):
            future.cancel()
        for future in (pending, closed):
            with contextlib.suppress(asyncio.CancelledError):
                await future
