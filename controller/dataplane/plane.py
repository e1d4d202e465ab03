"""The router's data plane: every ``/v1`` request served at the socket, aiohttp for the
rest of the API.

Where it sits: :class:`~controller.api.server.ApiServer` listens with :class:`DataPlane`
as the protocol factory, so every connection starts here, as a
:class:`~controller.dataplane.connection.Connection`, and stays here. Each request is
read by llhttp (:mod:`controller.dataplane.request`). A ``/v1`` request, whatever its
version or framing (``HTTP/1.0``, a chunked upload, a percent-encoded model id), is the
data plane's: ``GET /v1/models`` and ``/v1/models/{id}`` are answered here, a 404 or
405 for a path or method the router does not hold, and ``POST /v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v1/audio/…`` are routed calls
(:class:`~controller.router.call.RoutedCall`: the policy; the connection drives it),
sent over :mod:`controller.dataplane.upstream`'s keep-alive pools (their answers read
by llhttp too); the answer's head is rebuilt from the upstream's and its body relayed
as it arrives, from one transport to the other, with the transports' own flow control.
A request is callbacks from its head to its last byte (no task, no future): a task runs
only while it waits for a cold slot's load or for a new upstream connection. Every other
request (the REST API, the dashboard, the event stream) is passed, byte for byte, to the
connection's aiohttp protocol, which answers it on the same transport; the data plane
reads on once it has (the order of answers is the order of requests). A head llhttp
refuses, or an upgrade, hands the connection to aiohttp for good (its ``400``, logged
without the bytes: :mod:`controller.api.refused`).

This package imports nothing of :mod:`controller.api` nor aiohttp (an import contract
says so). A client that goes away gives its
request up at once (``connection_lost``): the lease is released and the upstream
connection dropped, so the server stops generating. A revoked lease is noticed within
``_WATCH_S`` (one timer of the plane looks at every request's lease); a server that sends
nothing for its slot's ``upstream_idle_s`` (a hung one) within a second or two of it
(another timer of the plane, :meth:`DataPlane._stall_sweep`), and the request ends with
``slot.upstream_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Final

from controller.dataplane.connection import Connection, Fallback
from controller.dataplane.upstream import UpstreamPool
from controller.router.context import RouterContext
from controller.router.hosts import HostPolicy

__all__ = ["KEEPALIVE_S", "DataPlane", "stalled"]

KEEPALIVE_S: Final = 75.0  # an idle client connection is closed after this (aiohttp's default)
_SWEEP_S: Final = 15.0  # how often idle connections are looked for
_WATCH_S: Final = 0.1  # how often a request's lease is looked at
_STALL_S: Final = 1.0  # how often a request's upstream is looked at for silence


# ----------------------------------------------------------------------------- the plane


def stalled(front: Connection, now: float) -> bool:
    """The stall sweep's look at one connection: True when the server of its request has
    sent nothing for the slot's ``upstream_idle_s``. The clock starts at the sweep's first
    sight of an exchange and restarts at each look that finds a byte came
    (``Upstream.heard``) or that reading is paused for a slow client."""
    upstream, call = front.upstream, front.call
    if upstream is None or call is None:
        front.watched = None  # waiting for a lease or a connection: not the server's
        return False
    if upstream is not front.watched:
        front.watched, front.quiet_since = upstream, now
        front.idle_s = call.idle_s()
        upstream.heard = False
        return False
    if upstream.heard or upstream.paused:
        upstream.heard = False
        front.quiet_since = now
        return False
    return now - front.quiet_since >= front.idle_s


class DataPlane:
    """The protocol factory of the API's listening socket (see the module docstring)."""

    def __init__(
        self,
        ctx: RouterContext,
        fallback: Callable[[], Fallback],
        *,
        hosts: HostPolicy,
    ) -> None:
        self.ctx = ctx
        self.fallback = fallback  # aiohttp's protocol factory (one a connection)
        self.hosts = hosts  # the Host values answered (others: 421, controller.api.hostcheck)
        self.pool = UpstreamPool()
        self.fronts: set[Connection] = set()
        self.closing = False
        self.in_flight = 0  # requests being served
        self._drained: asyncio.Event | None = None  # set when none is (while stopping)
        self.loop = asyncio.get_running_loop()
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)
        self._watcher = self.loop.call_later(_WATCH_S, self._watch)
        self._staller = self.loop.call_later(_STALL_S, self._stall_sweep)

    def __call__(self) -> asyncio.Protocol:
        return Connection(self)

    def _watch(self) -> None:
        """Every ``_WATCH_S``: a request whose lease was revoked (its slot crashed or was
        unloaded) is cancelled; one timer for them all, not one per request."""
        try:
            for front in list(self.fronts):  # ending one may hand its connection over
                call = front.call
                lease = call.lease if call is not None else None
                if lease is not None and lease.error is not None:  # revoked
                    front.abort_request("lease")
        finally:
            self._watcher = self.loop.call_later(_WATCH_S, self._watch)

    def _stall_sweep(self) -> None:
        """Every ``_STALL_S``: a request whose server sent nothing for its slot's
        ``upstream_idle_s`` is ended with ``slot.upstream_timeout`` (its lease released,
        its upstream connection dropped). One timer for every request, no timer per
        request or per read: a read only sets ``Upstream.heard``."""
        try:
            now = time.monotonic()
            for front in list(self.fronts):  # ending one may hand its connection over
                if stalled(front, now):
                    front.abort_request("timeout")
        finally:
            self._staller = self.loop.call_later(_STALL_S, self._stall_sweep)

    def _sweep(self) -> None:
        horizon = time.monotonic() - KEEPALIVE_S
        for front in list(self.fronts):
            if front.idle and front.active < horizon:
                front.close()
        self.pool.sweep()
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)

    async def shutdown(self, timeout: float) -> None:
        """Stop: idle connections close now, requests get ``timeout`` to finish."""
        self.closing = True
        self._sweeper.cancel()  # the lease watch goes on: a revoked lease still ends its
        for front in list(self.fronts):  # request with an error (up --keep-running)
            if front.idle:
                front.close()
        await self._drain(timeout)
        for front in list(self.fronts):
            front.abort_request("shutdown")  # answered (or said in-band), then closed
        await self._drain(1.0)  # their leases are released on the way
        for front in list(self.fronts):
            if not front.with_aiohttp:  # aiohttp's requests: its own shutdown ends them
                front.close()
        self._watcher.cancel()
        self._staller.cancel()
        self.pool.close()

    def ended(self) -> None:
        """A request was served (its lease released, its call recorded)."""
        self.in_flight -= 1
        if not self.in_flight and self._drained is not None:
            self._drained.set()

    def drained(self) -> None:
        """:meth:`ended`'s wake-up of a stop waiting for the requests (a connection that
        counts a request out itself calls this once :attr:`closing`: only a stop waits)."""
        if not self.in_flight and self._drained is not None:
            self._drained.set()

    async def _drain(self, timeout: float) -> None:
        if self.in_flight:
            self._drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout)
