"""What a routed request needs of the API it runs in, and its record: :class:`RouterContext`
(the manager as the router's port, the events, the token, the recorder, whether the API is
closing), :class:`Call` (one routed request), :func:`record_call`.

At the bottom of :mod:`controller.router`. Both router paths take a :class:`RouterContext`:
aiohttp's (:mod:`controller.api.router_proxy`) and the data plane
(:mod:`controller.dataplane`); :class:`controller.api.app.ApiContext` satisfies it, so
neither path imports the API's kernel.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Final, Protocol

from controller.events import EventBus
from controller.slots.ports import RouterPort
from controller.slots.records import Lease

__all__ = [
    "CLIENT_CLOSED",
    "Call",
    "RequestRecorder",
    "RouterContext",
    "record_call",
    "upstream_idle_s",
]

log = logging.getLogger("slotctl.router")

CLIENT_CLOSED: Final = 499  # nginx's status for "client closed the request" (metrics only)
_IDLE_DEFAULT_S: Final = 120.0  # a slot the manager no longer knows: the schema's default


class RequestRecorder(Protocol):
    """What the router reports each routed request to (the metrics implement it)."""

    def request_done(self, slot: str, model: str, status: int | str, seconds: float) -> None: ...


class RouterContext(Protocol):
    """What the router uses of the API it runs in (``ApiContext`` satisfies it)."""

    @property
    def manager(self) -> RouterPort: ...

    @property
    def events(self) -> EventBus: ...

    @property
    def token(self) -> str: ...

    @property
    def recorder(self) -> RequestRecorder | None:
        """Where routed requests are reported (None: nowhere, e.g. no metrics)."""

    @property
    def closed(self) -> bool:
        """The API is cleaning up: a request still running opens nothing new (503)."""


@dataclass(slots=True)
class Call:
    """One routed request, for the watch, the metrics and the final answer."""

    started: float
    model: str = ""
    slot: str = ""
    status: int = 0
    lease: Lease | None = None


def upstream_idle_s(ctx: RouterContext, slot: str) -> float:
    """The slot's ``upstream_idle_s``: how long its server may send nothing."""
    spec = ctx.manager.known(slot)
    return spec.upstream_idle_s if spec is not None else _IDLE_DEFAULT_S


def record_call(ctx: RouterContext, call: Call) -> None:
    recorder = ctx.recorder
    if recorder is None:
        return
    try:
        recorder.request_done(call.slot, call.model, call.status, time.monotonic() - call.started)
    except Exception:  # metrics must never fail a request: log it and answer anyway
        log.exception("metrics request_done failed")
