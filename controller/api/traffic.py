"""``GET /api/traffic``: each slot's request rate, latency and queue over the last minutes,
sampled from the router's own counters (the dashboard draws them as sparklines).

Nothing on the request path: a timer on the event loop reads the router's cumulative
counters (:meth:`~controller.api.metrics._RequestSeries.slot_totals`, what
``/metrics`` serves) every :data:`INTERVAL_S` and keeps, per slot, the difference since
the last sample in a ring of :data:`SAMPLES`: requests, errors (5xx), the latency of that
interval (mean; p50 and p95 from the histogram buckets' difference, as Prometheus'
``histogram_quantile`` does), and the requests in flight and waiting for a cold load as
the manager has them then. Below the dashboard, beside the other route modules' users.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel

from controller.api.app import API_CTX, ApiContext, CtxKey, RouteTable, json_response
from controller.api.metrics import REQUEST_BUCKETS, metrics_of

__all__ = ["INTERVAL_S", "SAMPLES", "Traffic", "quantile", "setup"]

log = logging.getLogger("slotctl.api.traffic")

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

INTERVAL_S: Final = 2.0
SAMPLES: Final = 150  # five minutes


def quantile(q: float, counts: list[float]) -> float | None:
    """The ``q`` quantile of a histogram's counts per bucket of :data:`REQUEST_BUCKETS`
    (then +Inf), interpolated inside its bucket; None without a count. In +Inf it is the
    largest finite bound (as ``histogram_quantile``)."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, below = q * total, 0.0
    for i, n in enumerate(counts):
        if n > 0 and below + n >= rank:
            if i >= len(REQUEST_BUCKETS):
                return REQUEST_BUCKETS[-1]
            low = REQUEST_BUCKETS[i - 1] if i else 0.0
            return low + (REQUEST_BUCKETS[i] - low) * max(0.0, rank - below) / n
        below += n
    return REQUEST_BUCKETS[-1]


_SERIES: Final = ("t", "requests", "errors", "mean_s", "p50_s", "p95_s", "in_flight", "queued")
_Rings = dict[str, collections.deque[Any]]  # one slot's samples, oldest first, by series


def _rings() -> _Rings:
    return {name: collections.deque(maxlen=SAMPLES) for name in _SERIES}


class Traffic:
    """The samples of every slot (see the module docstring)."""

    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx
        self.slots: dict[str, _Rings] = {}
        self.totals: dict[str, int] = {}  # requests through the router since the start
        self._last: dict[str, tuple[int, int, list[float]]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self._timer is None:
            self._last = metrics_of(self.ctx).requests.slot_totals()
            self._timer = asyncio.get_running_loop().call_later(INTERVAL_S, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        try:
            self.sample(time.time())
        except Exception:  # a sampling bug must not stop the samples (or the loop)
            log.exception("traffic: sampling failed")
        finally:
            self._timer = asyncio.get_running_loop().call_later(INTERVAL_S, self._tick)

    def sample(self, now: float) -> None:
        """One sample of every slot: what the counters gained since the last one."""
        totals = metrics_of(self.ctx).requests.slot_totals()
        live = self._live()
        for name in sorted(set(live) | set(totals)):
            if not name:
                continue  # refused before a slot was chosen
            n, errors, buckets = totals.get(name, (0, 0, []))
            n0, errors0, buckets0 = self._last.get(name, (0, 0, [0.0] * len(buckets)))
            delta = [a - b for a, b in zip(buckets, buckets0, strict=False)]
            counts, seconds = delta[:-1], (delta[-1] if delta else 0.0)
            in_flight, queued = live.get(name, (0, 0))
            done = n - n0
            sample = (
                now,
                done,
                errors - errors0,
                seconds / done if done > 0 else None,
                quantile(0.5, counts),
                quantile(0.95, counts),
                in_flight,
                queued,
            )
            rings = self.slots.setdefault(name, _rings())
            for series, value in zip(_SERIES, sample, strict=True):
                rings[series].append(value)
            self.totals[name] = n
        for gone in set(self.slots) - set(live) - set(totals):
            del self.slots[gone]
        self._last = totals

    def _live(self) -> dict[str, tuple[int, int]]:
        manager = self.ctx.manager
        if manager is None:
            return {}
        return {v.name: (v.leases - v.holds, v.waiters) for v in manager.views()}

    def snapshot(self) -> dict[str, Any]:
        manager = self.ctx.manager
        out = []
        for name, rings in self.slots.items():
            spec = manager.known(name) if manager is not None else None
            out.append(
                {
                    "slot": name,
                    "requests_total": self.totals.get(name, 0),
                    "max_queue": spec.max_queue if spec is not None else None,
                    "series": {series: list(ring) for series, ring in rings.items()},
                }
            )
        return {"interval_s": INTERVAL_S, "samples": SAMPLES, "slots": out}


TRAFFIC: Final = CtxKey("traffic", Traffic)


def setup(app: web.Application, ctx: ApiContext) -> None:
    """Called by ``build_app``: the sampler runs while the app does (one per context)."""
    traffic = ctx.store.setdefault(TRAFFIC, lambda: Traffic(ctx))

    async def start(_: web.Application) -> None:
        traffic.start()

    async def stop(_: web.Application) -> None:
        traffic.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)


class TrafficSeries(BaseModel):
    t: list[float]
    requests: list[int]
    errors: list[int]
    mean_s: list[float | None]
    p50_s: list[float | None]
    p95_s: list[float | None]
    in_flight: list[int]
    queued: list[int]


class SlotTraffic(BaseModel):
    slot: str
    requests_total: int
    max_queue: int | None
    series: TrafficSeries


class TrafficOut(BaseModel):
    interval_s: float
    samples: int
    slots: list[SlotTraffic]


@route(
    "GET",
    "/api/traffic",
    summary="each slot's requests, errors, latency and queue per interval over the last "
    "minutes (oldest first), from the router's counters",
    tag="dashboard",
    responses={200: ("samples per slot", TrafficOut)},
)
async def traffic_samples(request: web.Request) -> web.Response:
    ctx = request.app[API_CTX]
    traffic = ctx.store.setdefault(TRAFFIC, lambda: Traffic(ctx))
    return json_response(traffic.snapshot())
