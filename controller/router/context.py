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
import re
import time
from dataclasses import dataclass
from typing import Final, Protocol

from controller.access.keys import KeyLimits, KeyRing, Principal
from controller.kit.eventbus import EventBus
from controller.slots.interfaces import RouterPort
from controller.slots.records import Lease, Requester

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
USAGE_TAIL: Final = 1024  # bytes of a key's answer kept for its ``usage``
_TOKENS: Final = re.compile(rb'"(prompt_tokens|completion_tokens)"\s*:\s*([0-9]{1,12})')
_IDLE_DEFAULT_S: Final = 120.0  # a slot the manager no longer knows: the schema's default


class RequestRecorder(Protocol):
    """What the router reports each routed request to (the metrics implement it)."""

    def request_done(self, slot: str, model: str, status: int | str, seconds: float) -> None: ...

    def key_tokens(self, key: str, cls: str, prompt: int, completion: int) -> None:
        """The tokens a key's request used, as its server reported them (``usage``)."""

    def key_done(self, key: str, cls: str, status: int | str, waited: float | None) -> None:
        """One request of ``key`` (its name; "" the API token) in class ``cls`` ended;
        ``waited``: the seconds it waited for its turn (None: it did not wait)."""


class RouterContext(Protocol):
    """What the router uses of the API it runs in (``ApiContext`` satisfies it)."""

    @property
    def manager(self) -> RouterPort: ...

    @property
    def events(self) -> EventBus: ...

    @property
    def keys(self) -> KeyRing:
        """The API token and the keys of ``keys.json``: who a request is."""

    @property
    def limits(self) -> KeyLimits:
        """The keys' requests in flight and a minute (their 429s)."""

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
    alias: str = ""  # the alias the request named (``model``: the member that serves it)
    status: int = 0
    lease: Lease | None = None
    principal: Principal | None = None  # who asks (the key; the token's admin)
    who: Requester | None = None  # the key and the class it waits in
    counted: bool = False  # in the key's limits until the call is recorded
    waited: float | None = None  # seconds it waited for its lease (None: no wait)
    # A key's call keeps the last bytes of its answer, where a server reports ``usage``
    # (None: not kept: the API token's calls, which no key's figures count).
    tail: bytearray | None = None

    def keep(self, data: bytes) -> None:
        """The answer's bytes as they pass (only their last :data:`USAGE_TAIL` kept)."""
        tail = self.tail
        if tail is not None:
            tail += data
            if len(tail) > 2 * USAGE_TAIL:
                del tail[:-USAGE_TAIL]


def usage_of(tail: bytes | bytearray) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` of the last ``usage`` object in an answer's
    tail (a JSON answer's, or a stream's last event with ``include_usage``); None: none."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    found = dict(_TOKENS.findall(bytes(tail[at : at + 400])))
    if b"prompt_tokens" not in found:
        return None
    return int(found[b"prompt_tokens"]), int(found.get(b"completion_tokens", b"0"))


def upstream_idle_s(ctx: RouterContext, slot: str) -> float:
    """The slot's ``upstream_idle_s``: how long its server may send nothing."""
    spec = ctx.manager.known(slot)
    return spec.upstream_idle_s if spec is not None else _IDLE_DEFAULT_S


def record_call(ctx: RouterContext, call: Call) -> None:
    """The call ended: out of its key's limits, reported to the metrics (once)."""
    if call.counted and call.principal is not None:
        call.counted = False
        ctx.limits.done(call.principal)
    recorder = ctx.recorder
    if recorder is None:
        return
    try:
        recorder.request_done(call.slot, call.model, call.status, time.monotonic() - call.started)
        who = call.who
        if who is not None:
            recorder.key_done(who.key, who.cls, call.status, call.waited)
            used = usage_of(call.tail) if call.tail else None
            if used is not None:
                recorder.key_tokens(who.key, who.cls, *used)
    except Exception:  # metrics must never fail a request: log it and answer anyway
        log.exception("metrics request_done failed")
