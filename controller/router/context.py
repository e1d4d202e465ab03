"""What a routed request needs of the API it runs in: :class:`RouterContext` (the manager
as the router's port, the events, the keys and their limits, the recorder, whether the
API is closing), :class:`RequestRecorder` (where a routed request is reported), a slot's
``upstream_idle_s``, the ``usage`` in an answer's tail.

At the bottom of :mod:`controller.router`. The routed call (:mod:`controller.router.call`)
and the data plane (:mod:`controller.dataplane`) take a :class:`RouterContext`;
:class:`controller.api.app.ApiContext` satisfies it, so neither imports the API's kernel.
"""

from __future__ import annotations

import logging
import re
from typing import Final, Protocol

from controller.access.keys import KeyLimits, KeyRing
from controller.kit.eventbus import EventBus
from controller.slots.interfaces import RouterPort

__all__ = [
    "CLIENT_CLOSED",
    "USAGE_TAIL",
    "RequestRecorder",
    "RouterContext",
    "cached_of",
    "upstream_idle_s",
    "usage_of",
]

log = logging.getLogger("slotctl.router")

CLIENT_CLOSED: Final = 499  # nginx's status for "client closed the request" (metrics only)
USAGE_TAIL: Final = 1024  # bytes of a key's answer kept for its ``usage``
_TOKENS: Final = re.compile(rb'"(prompt_tokens|completion_tokens)"\s*:\s*([0-9]{1,12})')
_CACHED: Final = re.compile(
    rb'"(prompt_tokens|cached_tokens|cache_n|prompt_n)"\s*:\s*([0-9]{1,12})'
)
_IDLE_DEFAULT_S: Final = 120.0  # a slot the manager no longer knows: the schema's default


class RequestRecorder(Protocol):
    """What the router reports each routed request to (the metrics implement it)."""

    def call_done(
        self,
        slot: str,
        model: str,
        status: int | str,
        seconds: float,
        key: str | None,
        cls: str,
        waited: float | None,
    ) -> None:
        """One routed request ended with ``status`` after ``seconds``, served by ``slot``
        for ``model`` ("": none chosen); its requester ``key`` (its name; "" the API
        token; None: no requester was resolved, e.g. refused from its head) in class
        ``cls``, ``waited``: the seconds it waited for its turn (None: it did not wait).
        One call a request: its code runs from cold caches (docs/performance.md)."""

    def key_tokens(self, key: str, cls: str, prompt: int, completion: int) -> None:
        """The tokens a key's request used, as its server reported them (``usage``)."""

    def slot_tokens(self, slot: str, group: str, prompt: int, cached: int) -> None:
        """A replica's request: its prompt tokens and those its server's prefix cache
        held, as the server reported them (issue 38)."""


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


def cached_of(tail: bytes | bytearray) -> tuple[int, int] | None:
    """``(prompt tokens, cached prompt tokens)`` an answer's tail reports: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` (with ``usage.prompt_tokens``), else
    llama.cpp's ``timings.cache_n`` (with ``timings.prompt_n``: the tokens evaluated past
    the cache); None: neither is there."""
    at = tail.rfind(b'"usage"')
    if at >= 0:
        found = dict(_CACHED.findall(bytes(tail[at : at + 600])))
        if b"cached_tokens" in found and b"prompt_tokens" in found:
            return int(found[b"prompt_tokens"]), int(found[b"cached_tokens"])
    at = tail.rfind(b'"timings"')
    if at >= 0:
        found = dict(_CACHED.findall(bytes(tail[at : at + 600])))
        if b"cache_n" in found and b"prompt_n" in found:
            cached = int(found[b"cache_n"])
            return cached + int(found[b"prompt_n"]), cached
    return None


def upstream_idle_s(ctx: RouterContext, slot: str) -> float:
    """The slot's ``upstream_idle_s``: how long its server may send nothing."""
    spec = ctx.manager.known(slot)
    return spec.upstream_idle_s if spec is not None else _IDLE_DEFAULT_S
