"""``GET /metrics``: Prometheus exposition, one :class:`CollectorRegistry` per app.

Two kinds of series:

* **counters and histograms fed by events** — a synchronous listener on the event bus
  (:meth:`EventBus.add_listener`) counts transitions, admission refusals, evictions (by a
  short reason class), reconcile errors, background-task failures (contained and
  restarted by the daemon), refused state writes, routed requests ended by an upstream
  timeout (``slot.upstream_timeout``), sleeps and wakes (by reason), and measures load
  durations (the transition into ``pulling``/``starting`` of a load to ``ready``) and
  wake durations (``slotctl_wake_seconds``); the router reports each request with
  :meth:`Metrics.call_done`, the reconciler each pass through its pass observers;
* **gauges computed at scrape time** from the SlotManager
  (:class:`controller.api.gauges.LiveCollector`): the one-hot slot state and residency
  tier, active leases, cold waiters, crash-loop blocked slots, the host memory sleepers
  hold and device memory (total and free from the probe, admitted by slotctl, configured
  budget); the model files engine's pull counters (bytes pulled, pulls by outcome, in
  flight: :class:`controller.api.gauges.PullCollector`).

Names follow the Prometheus conventions: ``slotctl_`` prefix, base units in the name
(``_seconds``, ``_bytes``), ``_total`` on counters. ``promtool check metrics`` lints the
output in the integration tests.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Final, cast

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from controller.api.app import API_CTX, REQUEST_RECORDER, ApiContext, CtxKey, RouteTable
from controller.api.gauges import LiveCollector, PullCollector, device_figures
from controller.model.errors import SlotUpstreamTimeout
from controller.model.events import Event, EventKind, Op
from controller.model.lifecycle import SlotState

__all__ = [
    "METRICS",
    "Metrics",
    "device_figures",
    "eviction_reason",
    "setup",
]

log = logging.getLogger("slotctl.api.metrics")

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route


_LOAD_START: Final = frozenset({SlotState.PULLING.value, SlotState.STARTING.value})
_LOAD_END: Final = frozenset({SlotState.OFFLINE.value, SlotState.ERROR.value})

# Loads take seconds to many minutes (a pull); requests milliseconds to minutes (long
# generations); a reconcile pass microseconds (noop) to minutes (a load it waits for).
LOAD_BUCKETS: Final = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
REQUEST_BUCKETS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
RECONCILE_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)
# A wake: tens of milliseconds (the demo server) to tens of seconds (a big level-2 reload).
WAKE_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
QUEUE_BUCKETS: Final = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def eviction_reason(event: Event) -> str | None:
    """The reason class of an eviction event (a field of the event), else None.

    ``preload`` (room for a load), ``pressure`` (low free memory), ``ttl`` (unused past
    ``ttl_s``), ``exclusive`` (swapped out by an exclusive-group peer), ``orphan`` (a
    managed server nobody declares).
    """
    if event.kind is not EventKind.EVICTION or event.reason is None:
        return None
    return event.reason.value


_go_float = cast(Callable[[float], str], floatToGoString)  # the bound's text, as theirs


_STATUS_TEXTS: dict[int | str, str] = {}  # a status label's text, made once (twice a request)
_CELLS_MAX: Final = 4096  # call_done's label sets kept (Metrics._cells_of)


def _status_text(status: int | str) -> str:
    """``str(status)``, kept (``_STATUS_TEXTS.get(status) or _status_text(status)``)."""
    if len(_STATUS_TEXTS) >= 1024:
        _STATUS_TEXTS.clear()
    text = _STATUS_TEXTS[status] = str(status)
    return text


class _Counts(Collector):
    """A labelled counter counted with plain updates (a prometheus_client ``Counter``'s
    ``labels()`` checks and joins the values and takes a lock on every update: twice a
    request for its lease flips, once for its key), turned into the same family, its
    ``_created`` samples included, at scrape time."""

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self.name = name.removesuffix("_total")
        self.documentation, self.labels = documentation, labels
        # [value, created] by the labels' values (Metrics.call_done counts in it itself)
        self.counts: dict[tuple[str, ...], list[float]] = {}

    def inc(self, *values: str, amount: float = 1.0) -> None:
        found = self.counts.get(values)
        if found is None:
            found = self.counts[values] = [0.0, time.time()]
        found[0] += amount

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, (value, created) in list(self.counts.items()):
            family.add_metric(list(values), value, created=created)
        yield family


class _RequestSeries(Collector):
    """``slotctl_requests_total`` and ``slotctl_request_duration_seconds``: counted with
    plain integer updates on the request path (a labelled prometheus_client Counter and
    Histogram take a lock and scan the buckets on every update, for each request), turned
    into the same families, ``_created`` samples included, at scrape time."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], list[float]] = {}  # [count, created]
        self.durations: dict[tuple[str, str], list[float]] = {}  # buckets, +Inf, sum, created

    def done(self, slot: str, model: str, status: int | str, seconds: float) -> None:
        key = (slot, model, _STATUS_TEXTS.get(status) or _status_text(status))
        count = self.counts.get(key)
        if count is None:
            count = self.counts[key] = [0, time.time()]
        count[0] += 1
        series = self.durations.get((slot, model))
        if series is None:
            series = self.new(slot, model)
        if seconds < 0.0:
            seconds = 0.0
        series[bisect_left(REQUEST_BUCKETS, seconds)] += 1
        series[-2] += seconds

    def new(self, slot: str, model: str) -> list[float]:
        """The latency series of ``(slot, model)``, made empty: per bucket of
        REQUEST_BUCKETS, then +Inf, the sum of seconds, when it was made."""
        series = self.durations[(slot, model)] = [0.0] * (len(REQUEST_BUCKETS) + 2) + [time.time()]
        return series

    def slot_totals(self) -> dict[str, tuple[int, int, list[float]]]:
        """Per slot, summed over models and statuses: requests, errors (5xx) and the
        latency histogram's counts (per bucket of REQUEST_BUCKETS, then +Inf, then the sum
        of seconds) — cumulative, for :mod:`controller.api.traffic`'s sampler."""
        out: dict[str, tuple[int, int, list[float]]] = {}
        for (slot, _, status), (count, _) in list(self.counts.items()):
            n, errors, series = out.get(slot, (0, 0, [0.0] * (len(REQUEST_BUCKETS) + 2)))
            failed = count if status.isdigit() and int(status) >= 500 else 0
            out[slot] = (n + int(count), errors + int(failed), series)
        for (slot, _), durations in list(self.durations.items()):
            if slot in out:
                series = out[slot][2]
                for i, value in enumerate(durations[:-1]):
                    series[i] += value
        return out

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            "slotctl_requests",
            "Requests through the router by slot, model and HTTP status",
            labels=["slot", "model", "status"],
        )
        for key, (count, created) in list(self.counts.items()):
            requests.add_metric(list(key), count, created=created)
        yield requests
        duration = HistogramMetricFamily(
            "slotctl_request_duration_seconds",
            "Router request latency (until the last byte of the answer)",
            labels=["slot", "model"],
        )
        bounds = [*(_go_float(b) for b in REQUEST_BUCKETS), "+Inf"]
        for (slot, model), series in list(self.durations.items()):
            cumulative, buckets = 0.0, []
            for bound, n in zip(bounds, series[:-2], strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            duration.add_metric([slot, model], buckets, series[-2])
            duration.samples.append(
                Sample(
                    "slotctl_request_duration_seconds_created",
                    {"slot": slot, "model": model},
                    series[-1],
                )
            )
        yield duration


class Metrics:
    """The app's metrics: its own registry, event-fed counters, scrape-time gauges."""

    def __init__(self, ctx: ApiContext) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.transitions = _Counts(
            "slotctl_transitions_total", "Slot state transitions", ["slot", "from", "to"]
        )
        r.register(self.transitions)
        self.load_duration = Histogram(
            "slotctl_load_duration_seconds",
            "Time from a load's start (pulling or starting) to ready",
            ["slot"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.refusals = Counter(
            "slotctl_admission_refusals_total",
            "Loads refused (insufficient memory, crash loop, not activated, ...)",
            ["slot"],
            registry=r,
        )
        self.evictions = Counter(
            "slotctl_evictions_total",
            "Slots unloaded by slotctl to make room, relieve pressure, expire a TTL or "
            "swap an exclusive group",
            ["slot", "reason"],
            registry=r,
        )
        self.adapter_events = Counter(
            "slotctl_adapter_events_total",
            "LoRA adapters in slots: loaded, evicted (room for another), unloaded, failed "
            "(the server refused a load), reapplied (after a restart)",
            ["slot", "adapter", "action"],
            registry=r,
        )
        self.requests = _RequestSeries()  # per request: plain updates, families at scrape
        # call_done's series by its labels (_cells_of)
        self._cells: dict[
            tuple[str, str, int | str, str | None, str],
            tuple[list[float], list[float], list[float] | None],
        ] = {}
        r.register(self.requests)
        # One request counted in the series (call_done does it in line for the router).
        self.request_done = self.requests.done
        self.reconcile_duration = Histogram(
            "slotctl_reconcile_duration_seconds",
            "Duration of one reconcile pass of one slot",
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        self.reconcile_errors = Counter(
            "slotctl_reconcile_errors_total", "Reconcile passes that failed", registry=r
        )
        self.background_failures = Counter(
            "slotctl_background_failures_total",
            "Unexpected failures of a controller background task (contained and restarted)",
            ["task"],
            registry=r,
        )
        self.state_write_failures = Counter(
            "slotctl_state_write_failures_total",
            "Slot state transitions refused because state.json could not be written",
            ["slot"],
            registry=r,
        )
        self.upstream_timeouts = Counter(
            "slotctl_upstream_timeouts_total",
            "Routed requests ended because the slot's server sent nothing for "
            "upstream_idle_s (or took no connection)",
            ["slot"],
            registry=r,
        )
        self.wake_duration = Histogram(
            "slotctl_wake_seconds",
            "Time a wake of an asleep server took (its wake calls and the readiness probe)",
            ["slot"],
            buckets=WAKE_BUCKETS,
            registry=r,
        )
        self.sleeps = Counter(
            "slotctl_sleeps_total",
            "Servers put to sleep instead of unloaded, by eviction reason",
            ["slot", "reason"],
            registry=r,
        )
        self.wakes = Counter(
            "slotctl_wakes_total",
            "Asleep servers woken, by reason (request, load, background; wake_failed: "
            "restarted instead)",
            ["slot", "reason"],
            registry=r,
        )
        self.key_requests = _Counts(
            "slotctl_key_requests_total",
            "Routed requests by API key (its name; @token: the API token), priority class "
            "and answer status (429: over a key's or a queue's limit)",
            ["key", "class", "code"],
        )
        r.register(self.key_requests)
        self.key_tokens_total = _Counts(
            "slotctl_key_tokens_total",
            "Tokens of keys' routed requests, as their servers reported them (usage)",
            ["key", "class", "kind"],
        )
        r.register(self.key_tokens_total)
        self.slot_tokens_total = _Counts(
            "slotctl_slot_prompt_tokens_total",
            "Prompt tokens of the requests routed to a slot's replicas, and of those the "
            "ones its server's prefix cache held (kind=cached: usage.prompt_tokens_details"
            ".cached_tokens or llama.cpp's timings.cache_n), by replica and its slot",
            ["slot", "replica_of", "kind"],
        )
        r.register(self.slot_tokens_total)
        self.queue_wait = Histogram(
            "slotctl_queue_wait_seconds",
            "Time routed requests waited for their lease (a cold load, a wake, a swap, a "
            "slot at its max_concurrency), by priority class",
            ["class"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self._load_started: dict[str, float] = {}
        r.register(LiveCollector(lambda: ctx.manager))
        r.register(PullCollector(lambda: f.stats if (f := ctx.manager.files) else None))

    # ---------------------------------------------------------------- feeds

    def on_event(self, event: Event) -> None:
        """The bus listener: synchronous, fast, never raises."""
        try:
            self._on_event(event)
        except Exception:  # a metrics bug must never break the manager that emits
            log.exception("metrics: cannot account for event %s", event.id)

    def _on_event(self, event: Event) -> None:
        slot = event.slot or ""
        if event.op is Op.LEASE and event.kind is EventKind.TRANSITION:
            # A request's ready <-> serving flip: counted, and nothing else concerns it
            # (no load starts or ends, no refusal, no eviction).
            self.transitions.inc(slot, event.from_state or "", event.to_state or "")
            return
        if event.kind == "transition" and event.from_state and event.to_state:
            self.transitions.inc(slot, event.from_state, event.to_state)
            self._load_timing(event)
        elif event.kind == "refusal" and event.op in ("admit", "load"):
            self.refusals.labels(slot).inc()
        elif event.kind == "refusal" and event.error == SlotUpstreamTimeout.code:
            self.upstream_timeouts.labels(slot).inc()
        elif event.kind == "error" and event.op == "reconcile":
            self.reconcile_errors.inc()
        elif event.kind == "error" and event.op == "background":
            self.background_failures.labels(str(event.details.get("task", ""))).inc()
        elif event.kind == "error" and event.error == "state.write_failed":
            self.state_write_failures.labels(slot).inc()
        elif event.kind == "residency":
            self._residency(slot, event)
        elif event.kind == "adapter":
            details = event.details
            adapter, action = str(details.get("adapter", "")), str(details.get("action", ""))
            self.adapter_events.labels(slot, adapter, action).inc()
        reason = eviction_reason(event)
        if reason is not None:
            self.evictions.labels(slot, reason).inc()
            if event.details.get("action") == "sleep":
                self.sleeps.labels(slot, reason).inc()

    def _residency(self, slot: str, event: Event) -> None:
        """A wake that ended (woken, or failed and restarted)."""
        reason = str(event.details.get("reason", ""))
        if event.details.get("residency") == "awake":
            self.wakes.labels(slot, reason).inc()
            seconds = event.details.get("seconds")
            if isinstance(seconds, int | float):
                self.wake_duration.labels(slot).observe(max(0.0, float(seconds)))
        elif reason == "wake_failed":
            self.wakes.labels(slot, reason).inc()

    def _load_timing(self, event: Event) -> None:
        slot, to = event.slot or "", event.to_state
        now = time.monotonic()
        if to in _LOAD_START and event.op == "load":
            self._load_started.setdefault(slot, now)  # pulling -> starting keeps the start
        elif to == SlotState.READY.value and event.from_state == SlotState.WARMING.value:
            started = self._load_started.pop(slot, None)
            if started is not None:
                self.load_duration.labels(slot).observe(now - started)
        elif to in _LOAD_END or to == SlotState.IDLE.value:
            self._load_started.pop(slot, None)

    def key_tokens(self, key: str, cls: str, prompt: int, completion: int) -> None:
        self.key_tokens_total.inc(key or "@token", cls, "prompt", amount=prompt)
        self.key_tokens_total.inc(key or "@token", cls, "completion", amount=completion)

    def slot_tokens(self, slot: str, group: str, prompt: int, cached: int) -> None:
        """A replica's request: prompt tokens, and of those the cached ones."""
        self.slot_tokens_total.inc(slot, group, "prompt", amount=prompt)
        self.slot_tokens_total.inc(slot, group, "cached", amount=cached)

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
        """One routed request ended (the router calls this, once a request):
        :meth:`request_done` in line, and a request with a requester (``key`` not None)
        counted for its key and class: one call, where a request's code runs from cold
        caches and each function more it touches costs (docs/performance.md, the router)."""
        cells = self._cells.get((slot, model, status, key, cls))
        if cells is None:
            cells = self._cells_of(slot, model, status, key, cls)
        count, durations, found = cells
        count[0] += 1
        if seconds < 0.0:
            seconds = 0.0
        durations[bisect_left(REQUEST_BUCKETS, seconds)] += 1
        durations[-2] += seconds
        if found is None:
            return
        found[0] += 1.0
        if waited is not None:
            self.queue_wait.labels(cls).observe(max(0.0, waited))

    def _cells_of(
        self, slot: str, model: str, status: int | str, key: str | None, cls: str
    ) -> tuple[list[float], list[float], list[float] | None]:
        """The series :meth:`call_done` counts a request of these labels in: its request
        count, its latency histogram, its key's request count (None: no requester). Made
        at the first such request and kept (a series is never dropped), so each next one
        is one dict lookup, not three."""
        text = _STATUS_TEXTS.get(status) or _status_text(status)
        series = self.requests
        values = (slot, model, text)
        count = series.counts.get(values)
        if count is None:
            count = series.counts[values] = [0, time.time()]
        durations = series.durations.get((slot, model))
        if durations is None:
            durations = series.new(slot, model)
        found = None
        if key is not None:
            counts = self.key_requests.counts
            labels = (key or "@token", cls, text)
            found = counts.get(labels)
            if found is None:
                found = counts[labels] = [0.0, time.time()]
        cells = self._cells
        if len(cells) >= _CELLS_MAX:
            cells.clear()
        cells[(slot, model, status, key, cls)] = found_cells = (count, durations, found)
        return found_cells

    def reconcile_pass(self, slot: str, seconds: float, ok: bool) -> None:
        """One reconcile pass finished (a reconciler pass observer)."""
        self.reconcile_duration.observe(max(0.0, seconds))

    def prime(self, slots: Iterator[str] | list[str]) -> None:
        """Zero-valued per-slot refusal series, so ``increase()`` sees the first one."""
        for slot in slots:
            self.refusals.labels(slot)

    # ---------------------------------------------------------------- exposition

    def render(self, accept: str | None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


METRICS: Final = CtxKey("metrics", Metrics)  # the context's one Metrics


def metrics_of(ctx: ApiContext) -> Metrics:
    metrics = ctx.store.get(METRICS)
    if metrics is None:
        metrics = Metrics(ctx)
        ctx.store.set(METRICS, metrics)
        ctx.store.set(REQUEST_RECORDER, metrics)  # the router reports its requests here
        # The lease flips of every request are only counted (see Metrics._on_event): told
        # as (slot, from, to), with no event built for them.
        ctx.events.add_listener(metrics.on_event, on_flip=metrics.transitions.inc)
        if ctx.reconciler is not None:
            ctx.reconciler.pass_observers.append(metrics.reconcile_pass)
    return metrics


def setup(app: web.Application, ctx: ApiContext) -> None:
    """Called by ``build_app``: the metrics object into ``ctx.store`` (:data:`METRICS`; once per
    context: a second app on the same context shares it)."""
    metrics_of(ctx)


@route(
    "GET",
    "/metrics",
    summary="Prometheus metrics (text exposition format; OpenMetrics when asked)",
    tag="observability",
    responses={200: ("metrics", str)},
    content_type="text/plain",
)
async def metrics_endpoint(request: web.Request) -> web.Response:
    ctx = request.app[API_CTX]
    metrics = metrics_of(ctx)
    if ctx.manager is not None:
        metrics.prime(ctx.manager.names())
    body, content_type = metrics.render(request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})
