"""The gauges of ``/metrics`` computed at scrape time from the slot manager.

One collector reads the manager's metrics port as it is at each scrape: the one-hot slot
state and residency tier, static slot facts, active leases, cold waiters, crash-loop
blocked and memory-waiting slots, each slot's GPUs, the host memory sleepers hold, and
device memory (per GPU; a cluster's nodes as their own family). Another reads the model
files engine's pull counters (:class:`PullCollector`): bytes pulled, pulls by outcome,
pulls in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller import __version__
from controller.model.lifecycle import SlotState
from controller.modelfiles.stats import OUTCOMES, PullStats
from controller.slots.interfaces import MetricsPort
from controller.slots.records import DeviceFigures

__all__ = ["LiveCollector", "PullCollector", "device_figures"]

_STATES: Final = tuple(s.value for s in SlotState)
_TIERS: Final = ("awake", "asleep", "waking")


def device_figures(manager: MetricsPort | None) -> list[DeviceFigures]:
    """Every device (each GPU, cpu, npu, a cluster's nodes) with its memory figures."""
    return manager.devices() if manager is not None else []


class LiveCollector(Collector):
    """Gauges read from the slot manager at scrape time, through its metrics port."""

    def __init__(self, manager: Callable[[], MetricsPort | None]) -> None:
        self._manager = manager  # the context's manager, as it is at each scrape

    def collect(self) -> Iterable[Metric]:
        manager = self._manager()
        info = GaugeMetricFamily(
            "slotctl_build_info", "slotctl version (always 1)", labels=["version"]
        )
        info.add_metric([__version__], 1.0)
        yield info
        if manager is None:
            return
        state = GaugeMetricFamily(
            "slotctl_slot_state",
            "Slot lifecycle state, one-hot: 1 for the current state, 0 for the others",
            labels=["slot", "state"],
        )
        slot_info = GaugeMetricFamily(
            "slotctl_slot_info",
            "Static facts of a slot (always 1): model, device, priority, pinned",
            labels=["slot", "model", "device", "priority", "pinned"],
        )
        leases = GaugeMetricFamily(
            "slotctl_leases_active", "Leases (requests and batch holds) held now", labels=["slot"]
        )
        queue = GaugeMetricFamily(
            "slotctl_queue_depth",
            "Requests waiting for a cold slot to finish loading",
            labels=["slot"],
        )
        blocked = GaugeMetricFamily(
            "slotctl_crash_loop_blocked",
            "1 while the crash-loop breaker refuses loads of the slot (backing off, or open "
            "until its next half-open try)",
            labels=["slot"],
        )
        waiting = GaugeMetricFamily(
            "slotctl_slot_waiting_for_memory",
            "1 while a background load of the slot (autoload, resident) waits for memory "
            "instead of evicting",
            labels=["slot"],
        )
        placed = GaugeMetricFamily(
            "slotctl_slot_gpu",
            "1 for each GPU a slot is placed on (while it is admitted: pulling..unloading)",
            labels=["slot", "gpu"],
        )
        tier = GaugeMetricFamily(
            "slotctl_slot_residency",
            "Residency tier of a slot's server, one-hot: awake, asleep (device memory "
            "released) or waking",
            labels=["slot", "residency"],
        )
        replica = GaugeMetricFamily(
            "slotctl_slot_replica",
            "A replica (always 1): the slot whose replica it is and its index (issue 38; "
            "the slot itself is replica 0 of a slot with replicas)",
            labels=["slot", "replica_of", "index"],
        )
        sleepers = GaugeMetricFamily(
            "slotctl_sleeper_host_bytes",
            "Host memory held by asleep servers' weights (sleep level 1), per host key",
            labels=["device"],
        )
        held: dict[str, float] = {}
        for view in manager.views():
            for name in _TIERS:
                tier.add_metric([view.name, name], 1.0 if view.residency == name else 0.0)
            if view.host_bytes and view.devices:
                held[view.devices[0]] = held.get(view.devices[0], 0.0) + view.host_bytes
            for index in view.gpus:
                placed.add_metric([view.name, str(index)], 1.0)
            for name in _STATES:
                state.add_metric([view.name, name], 1.0 if view.state.value == name else 0.0)
            slot_info.add_metric(
                [
                    view.name,
                    view.model_id or "",
                    view.device,
                    str(view.priority),
                    "true" if view.pinned else "false",
                ],
                1.0,
            )
            if view.replica_of:
                replica.add_metric([view.name, view.replica_of, str(view.replica_index)], 1.0)
            leases.add_metric([view.name], float(view.leases))
            queue.add_metric([view.name], float(view.waiters))
            blocked.add_metric([view.name], 1.0 if view.retry_after_s > 0 else 0.0)
            waiting.add_metric([view.name], 1.0 if view.waiting else 0.0)
        for device, host_bytes in sorted(held.items()):
            sleepers.add_metric([device], host_bytes)
        yield from (
            state,
            slot_info,
            placed,
            replica,
            leases,
            queue,
            blocked,
            waiting,
            tier,
            sleepers,
        )
        memory = GaugeMetricFamily(
            "slotctl_device_memory_bytes",
            "Device memory: total and free as probed, admitted by slotctl (resident: servers "
            "up; reserved: loads coming up), configured budget; one series set per GPU",
            labels=["device", "gpu", "kind"],
        )
        nodes = GaugeMetricFamily(
            "slotctl_node_memory_bytes",
            "A cluster node's device memory as the kubernetes runtime admits on it: its "
            "budget (total), admitted by slotctl (resident, reserved)",
            labels=["node", "device", "kind"],
        )
        for figures in device_figures(manager):
            node, _, kind_of = figures.device.rpartition("/")
            gpu = str(figures.index) if figures.index is not None else ""
            for kind, value in _memory_kinds(figures):
                if node:
                    nodes.add_metric([node, kind_of, kind], float(value))
                else:
                    memory.add_metric([figures.kind, gpu, kind], float(value))
        yield memory
        yield nodes


def _memory_kinds(figures: DeviceFigures) -> Iterator[tuple[str, int]]:
    """The figures of one device that are known, by kind."""
    for kind, value in (
        ("total", figures.total_bytes),
        ("free", figures.free_bytes),
        ("admitted", figures.admitted_bytes),
        ("resident", figures.resident_bytes),
        ("reserved", figures.reserved_bytes),
        ("budget", figures.budget_bytes),
    ):
        if value is not None:
            yield kind, value


class PullCollector(Collector):
    """The model files engine's pull counters, read at scrape time
    (:class:`~controller.modelfiles.stats.PullStats`; nothing when this controller manages
    no model files)."""

    def __init__(self, stats: Callable[[], PullStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        if stats is None:
            return
        now = stats.snapshot()
        pulled = CounterMetricFamily(
            "slotctl_model_pull_bytes",
            "Bytes of model files fetched over the network and written (resumed bytes "
            "already on disk are not counted again)",
        )
        pulled.add_metric([], float(now["bytes_pulled"]))  # type: ignore[arg-type]
        yield pulled
        outcomes = CounterMetricFamily(
            "slotctl_model_pulls",
            "Pulls of model files by outcome (pulled, resumed, present, verified, "
            "verify_failed, access_denied, insufficient_disk, failed, cancelled)",
            labels=["outcome"],
        )
        counts: dict[str, int] = now["outcomes"]  # type: ignore[assignment]
        for outcome in OUTCOMES:
            outcomes.add_metric([outcome], float(counts.get(outcome, 0)))
        yield outcomes
        flying = GaugeMetricFamily(
            "slotctl_model_pulls_in_flight", "Pulls of model files running now"
        )
        flying.add_metric([], float(now["in_flight"]))  # type: ignore[arg-type]
        yield flying
