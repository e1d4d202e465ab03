"""The slot records: what the manager knows of each slot, the server it runs, views, settings.

The bottom of ``controller.slots`` but for the coordination objects each record holds.
:class:`SlotRecord` is the live record of one slot, split by owner (docs/design/0016):

* its **facts** (state, binding, placement, residency tier, timestamps, costs, the crash
  breaker) change only through :class:`~.table.SlotTable`'s guarded setters;
* the **server that runs** is one immutable :class:`RunningServer`, replaced whole by
  :meth:`~.table.SlotTable.run` (None: no server);
* the **coordination** of requests and loads is in the objects it holds: leasing's
  :class:`~.leasebook.LeaseBook` (``book``) and loading's :class:`~.flight.LoadFlight`
  (``flight``), each changed by its own methods only.

tests/unit/test_record_owners.py scans the package for writes outside those owners.
:class:`SlotView` is the read-only snapshot every caller gets (and the slot's JSON).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final, NamedTuple

from controller.model.devices import GpuRef, share
from controller.model.lifecycle import IdleReason, SlotState
from controller.model.sizes import GIB
from controller.runtime.base import LaunchSpec
from controller.scheduling.breaker import Breaker
from controller.scheduling.eviction import EvictionCandidate
from controller.scheduling.footprint import Choice, Estimate, choose
from controller.scheduling.rollout import RolloutView
from controller.slots.flight import LoadFlight
from controller.slots.leasebook import Lease, LeaseBook, Requester
from controller.spec.schema import ModelSpec, SlotSpec
from controller.store.files import utcnow
from controller.store.state import ReloadCosts, SeenUse

if TYPE_CHECKING:
    from controller.modelfiles.progress import PullProgress

__all__ = [
    "ADMITTED_STATES",
    "ASLEEP",
    "AWAKE",
    "LOADING_STATES",
    "WAKING",
    "AdapterHold",
    "DeviceFigures",
    "FootprintView",
    "Lease",  # Lease and Requester: leasing's vocabulary (.leasebook), named here too
    "ManagerConfig",
    "PullView",
    "Requester",
    "RunningServer",
    "Sizing",
    "SlotRecord",
    "SlotStatus",
    "SlotView",
    "tier_name",
]

S = SlotState
# Memory is admitted from the moment a load passes admission (pulling) until the server
# is gone (unloading -> offline).
ADMITTED_STATES: Final = frozenset(
    {S.PULLING, S.STARTING, S.WARMING, S.READY, S.SERVING, S.IDLE, S.UNLOADING}
)
# Admitted, but the server is not up yet: a memory probe cannot see these.
LOADING_STATES: Final = frozenset({S.PULLING, S.STARTING, S.WARMING})
# The residency tiers of a slot's server (a view's ``residency``): awake, asleep (device
# memory released; at level 1 its weights held in host memory), waking (a wake holds its
# device memory again, not up yet: reserved, like a load coming up).
AWAKE: Final = "awake"
ASLEEP: Final = "asleep"
WAKING: Final = "waking"


@dataclass(frozen=True, slots=True)
class AdapterHold:
    """A request's use of ``adapter`` in ``slot`` (released once, when it ends); ``index``:
    its position in a start-time engine's ``lora`` list (-1: a runtime engine's)."""

    slot: str
    adapter: str
    api: str
    index: int = -1
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    stop_timeout_s: float = 10.0  # graceful stop before SIGKILL
    exclusive_wait_s: float = 120.0  # bound on waiting for a group peer to unload
    monitor_interval_s: float = 0.25  # exit detection in run()
    tick_interval_s: float = 1.0  # idle/ttl/liveness/pressure in run()
    breaker_base_s: float = 1.0
    breaker_cap_s: float = 300.0
    stable_reset_s: float = 60.0
    elevated_free_frac: float = 0.10
    critical_free_frac: float = 0.05
    models_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class PullView:
    """The pull of a ``pulling`` slot's model files, as its view shows it (the engine's
    :class:`~controller.modelfiles.progress.PullProgress`: bytes done of total, rate, ETA)."""

    source: str
    phase: str  # checking | downloading | verifying | done | failed
    bytes_done: int = 0
    bytes_total: int | None = None
    percent: float | None = None
    rate_bps: float = 0.0
    eta_s: float | None = None
    file: str | None = None
    files_done: int = 0
    files_total: int = 0
    bytes_resumed: int = 0

    @classmethod
    def of(cls, progress: PullProgress) -> PullView:
        percent = progress.percent
        return cls(
            source=progress.source,
            phase=progress.phase,
            bytes_done=progress.bytes_done,
            bytes_total=progress.bytes_total,
            percent=None if percent is None else round(percent, 1),
            rate_bps=round(progress.rate_bps, 1),
            eta_s=None if progress.eta_s is None else round(progress.eta_s, 1),
            file=progress.file,
            files_done=progress.files_done,
            files_total=progress.files_total,
            bytes_resumed=progress.bytes_resumed,
        )


@dataclass(frozen=True, slots=True)
class SlotView:
    """Read-only snapshot of one slot for the API, CLI, metrics and tests.

    Its fields are the slot's JSON too: the API's ``SlotOut`` derives from this class
    (:mod:`controller.api.rest`) and ``slot_out`` is ``dataclasses.asdict`` of it, so a new
    field is declared here once."""

    name: str
    state: SlotState
    idle_reason: str | None
    dispatchable: bool  # lifecycle.can_dispatch(state, idle_reason), taken with the view
    model_id: str
    device: str
    priority: int
    pinned: bool
    autoload: bool
    resident: bool
    memory_bytes: int
    leases: int
    waiters: int
    generation: int
    since: str
    message: str
    endpoint: str | None
    failures: int
    retry_after_s: float
    config_hash: str | None
    stack: str
    waiting: str | None = None  # "waiting_for_memory": a background load waits for room
    paused: bool = False  # an autoload slot a user unloaded: stays unloaded until a load
    held_for_s: float | None = None  # until the last batch hold (``hold``) expires
    holds: int = 0  # batch holds among ``leases`` (the rest are requests in flight)
    node: str | None = None  # kubernetes runtime: the node it is pinned to or landed on
    unit: str | None = None  # its co-loaded unit (docs/design/0013)
    gpus: tuple[int, ...] = ()  # the GPUs it is placed on (indices), while admitted
    devices: tuple[str, ...] = ()  # its admission keys (gpu:N, cpu, NODE/gpu), while admitted
    requests: int = 0  # requests served (leases released, holds aside) since the start
    residency: str = AWAKE  # awake | asleep | waking (the tier of an idle slot's server)
    sleep_level: int = 0  # while asleep or waking: 1 (weights in host memory) or 2
    host_bytes: int = 0  # what it holds in host memory asleep (its weights, level 1)
    can_sleep: bool = False  # its running server can sleep (provider, slot's `sleep`)
    load_s: float | None = None  # measured cold load and wake times (moving averages)
    wake_s: float | None = None
    rollout: RolloutView | None = None  # a rollout in flight (docs/design/0012)
    pull: PullView | None = None  # pulling: its model files' download (bytes, rate, ETA)
    # A replica (issue 38): the slot it is one of (itself for replica 0 of a slot with
    # replicas; None: no replicas) and its index
    replica_of: str | None = None
    replica_index: int = 0
    # which figure ``memory_bytes`` is (issue 36): declared | estimated | observed | none
    memory_basis: str = "none"


def tier_name(level: int, waking: bool) -> str | None:
    """``extra.residency`` of a slot at this sleep level (None: awake)."""
    return (WAKING if waking else ASLEEP) if level else None


@dataclass(frozen=True, slots=True)
class DeviceFigures:
    """One device's memory now, for ``/api/devices``, ``/metrics``, the dashboard and
    ``slot list`` (bytes; None where it is not known: no probe, no budget)."""

    device: str  # the admission key: gpu:N, cpu, npu, NODE/gpu (gpu: no GPU is known)
    kind: str  # gpu | cpu | npu
    total_bytes: int | None
    free_bytes: int | None
    admitted_bytes: int  # promised to slots pulling..unloading
    reserved_bytes: int  # of those, loads still coming up (a probe cannot see them yet)
    resident_bytes: int  # of those, servers that are up
    budget_bytes: int | None
    safety_margin_bytes: int
    source: str | None
    slots: tuple[str, ...]  # the slots admitted here
    index: int | None = None  # a GPU's index
    uuid: str | None = None
    name: str | None = None  # a GPU's product name
    error: str | None = None  # a GPU the probe cannot read now


class SlotStatus(NamedTuple):
    """What a reconcile pass observes of a slot: the planning fields of a :class:`SlotView`,
    taken without building one (a pass over every slot asks this of each)."""

    state: SlotState
    idle_reason: str | None
    config_hash: str | None
    message: str
    retry_after_s: float
    waiting: str | None
    paused: bool


@dataclass(frozen=True, slots=True)
class RunningServer:
    """The server that runs for a slot: one value, replaced whole by
    :meth:`~.table.SlotTable.run` (a start, an adoption, a surge's switch; None when it is
    stopped), never changed in parts."""

    launch: LaunchSpec  # how it was started: placed, reached at the endpoint it answers on
    config_hash: str  # the config it runs: its launch's, or an adopted server's own
    adopted: str | None = None  # the ident of a server adopted after a restart

    @classmethod
    def started(cls, launch: LaunchSpec) -> RunningServer:
        """A server this controller started with ``launch``."""
        return cls(launch, launch.config_hash())

    @classmethod
    def adopted_as(
        cls, launch: LaunchSpec, ident: str | None, config_hash: str | None
    ) -> RunningServer:
        """A running server adopted after a restart: ``launch`` is what the slot would run
        now; ``config_hash`` the server's own (labels), an older config when it drifted
        (it serves until the reconciler recreates it)."""
        return cls(launch, config_hash or launch.config_hash(), ident)

    @property
    def drifted(self) -> bool:
        """It runs a config other than its slot's launch (an adopted, outdated server)."""
        return self.config_hash != self.launch.config_hash()

    @property
    def endpoint(self) -> str:
        return self.launch.endpoint


@dataclass(frozen=True, slots=True)
class Sizing:
    """What a slot's model file and launch say its server will hold (``slots.sizing``):
    the estimate for one model and launch config, or why there is none."""

    model: str
    config_hash: str | None
    estimate: Estimate | None
    why_not: str | None = None  # no estimate: no file yet, a format not read, an error
    learns: bool = True  # False: the engine sizes itself to its share (vLLM)


@dataclass(frozen=True, slots=True)
class FootprintView:
    """A slot's footprint explained (``slotctl model footprint``, the dry run, the API):
    each part of the estimate, the declared, estimated and observed figures, and which
    one admission counts (``basis``). Bytes; None where not known."""

    slot: str
    model: str
    provider: str
    device: str
    basis: str  # declared | estimated | observed | none
    admitted_bytes: int  # what admission counts now
    declared_bytes: int | None
    estimated_bytes: int | None  # on the slot's device
    observed_bytes: int | None  # the peak seen on its device (this model and config)
    observed_host_bytes: int | None = None
    observed_source: str | None = None
    observed_at: str | None = None
    source: str | None = None  # gguf | safetensors (the estimate's)
    weights_bytes: int | None = None
    weights_device_bytes: int | None = None
    weights_host_bytes: int | None = None
    weights_by_type: dict[str, int] = field(default_factory=dict)
    kv_bytes: int | None = None
    kv_device_bytes: int | None = None
    kv_host_bytes: int | None = None
    context: int | None = None
    parallel: int | None = None
    cache_type: str | None = None
    buffers_bytes: int | None = None
    prompt_cache_bytes: int | None = None  # llama-server --cache-ram (host)
    engine_bytes: int | None = None  # the engine's own process (host)
    host_bytes: int | None = None  # what stays in host memory besides the device's
    layers: int | None = None
    layers_on_device: int | None = None
    why_not: str | None = None  # no estimate: why
    notes: tuple[str, ...] = ()
    warning: str | None = None  # a declared figure below what was seen

    @classmethod
    def of(cls, slot: SlotRecord) -> FootprintView:
        choice = slot.footprint
        sizing = (
            slot.sizing if slot.sizing is not None and slot.sizing.model == slot.model_id else None
        )
        est = sizing.estimate if sizing is not None else None
        seen = slot.seen if slot.seen is not None and slot.seen.model == slot.model_id else None
        base = cls(
            slot=slot.name,
            model=slot.model_id,
            provider=slot.spec.provider,
            device=slot.spec.device,
            basis=choice.basis,
            admitted_bytes=slot.memory_bytes,
            declared_bytes=choice.declared,
            estimated_bytes=choice.estimated,
            observed_bytes=choice.observed,
            observed_host_bytes=seen.host_bytes if seen is not None else None,
            observed_source=seen.source if seen is not None else None,
            observed_at=seen.at if seen is not None else None,
            why_not=sizing.why_not if sizing is not None else "not estimated yet",
            warning=choice.warning,
        )
        if est is None:
            return base
        return replace(
            base,
            source=est.source,
            weights_bytes=est.weights,
            weights_device_bytes=est.weights_device,
            weights_host_bytes=est.weights_host,
            weights_by_type=dict(est.by_type),
            kv_bytes=est.kv,
            kv_device_bytes=est.kv_device,
            kv_host_bytes=est.kv_host,
            context=est.context,
            parallel=est.parallel,
            cache_type=est.cache_type,
            buffers_bytes=est.buffers,
            prompt_cache_bytes=est.prompt_cache,
            engine_bytes=est.engine,
            host_bytes=est.host,
            layers=est.layers,
            layers_on_device=est.layers_on_device,
            notes=est.notes,
        )


@dataclass(slots=True, eq=False)
class SlotRecord:
    """The live record of one slot (see the module docstring for who writes what).

    Fields, not a dict: every fact has a name and a type. Only :class:`~.table.SlotTable`
    assigns them (``hashed``: :class:`~.core.Core`'s memo); ``lock``, ``book`` and
    ``flight`` are made with the record and never replaced.
    """

    spec: SlotSpec
    stack: str
    model: ModelSpec | None
    breaker: Breaker
    on_nodes: bool = False  # placed on nodes (the kubernetes runtime): keyed per node
    # -- the lifecycle (SlotTable.set and its siblings; state.json follows them)
    state: SlotState = S.OFFLINE
    idle_reason: str | None = None
    message: str = ""
    since: str = field(default_factory=utcnow)
    waiting: str | None = None  # WAITING_FOR_MEMORY while a background load waits
    # The GPUs admission placed the slot on (recorded in state.json with the transition
    # that reserved them; cleared when it goes offline or to error). An asleep server
    # keeps them (it wakes where it sleeps).
    placement: tuple[GpuRef, ...] = ()
    # The residency tier (issue 22): the level its server sleeps at (0: awake), and
    # whether a wake holds its device memory again (reserved until it is ready).
    asleep: int = 0
    waking: bool = False
    costs: ReloadCosts | None = None  # measured reload costs of its model
    # -- its footprint (issue 36): the estimate of its file and launch (SlotTable.sized),
    # the most its server was seen to hold (SlotTable.observed), the warnings said once
    sizing: Sizing | None = None
    seen: SeenUse | None = None
    warned: frozenset[str] = frozenset()
    # -- the server (SlotTable.run) and what is known of it
    server: RunningServer | None = None
    landed: str | None = None  # the node the server last ran on (as the runtime saw it)
    ready_at: float | None = None  # monotonic: its server passed readiness
    last_liveness: float = 0.0
    liveness_misses: int = 0
    # -- use (SlotTable.used, as leases come and go)
    last_used: float = 0.0
    access: int = 0  # a victim is revalidated against it (a request since spares it)
    requests: int = 0  # requests served since the start (the lease flips carry it)
    # The device memory its LoRA adapters may take (controller/slots/adapters.py: the
    # max_loras largest of its base model's), counted in its admission with the model's.
    adapter_bytes: int = 0
    # (spec, model, stack, config hash) as last computed (Core.launch_hash), kept while
    # they stay the same objects (all immutable): a no-op reconcile pass rebuilds nothing.
    hashed: tuple[SlotSpec, ModelSpec | None, str, str | None] | None = None
    # -- coordination, each object its owner's
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    book: LeaseBook = field(default_factory=LeaseBook)  # leasing's
    flight: LoadFlight = field(default_factory=LoadFlight)  # loading's

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def launch(self) -> LaunchSpec | None:
        """The running server's launch (None: no server)."""
        server = self.server
        return server.launch if server is not None else None

    @property
    def config_hash(self) -> str | None:
        """The running server's config hash (None: no server)."""
        server = self.server
        return server.config_hash if server is not None else None

    @property
    def declared_bytes(self) -> int | None:
        """A ``memory_gb`` the stack sets (the slot's, else its model's); None: not set."""
        if self.spec.memory_gb is not None:
            return int(self.spec.memory_gb * GIB)
        if self.model is not None and self.model.memory_gb is not None:
            return self.model.memory_bytes
        return None

    @property
    def footprint(self) -> Choice:
        """What admission counts and why: declared, else the larger of the estimate and
        what its server was seen to hold (this model and launch config's)."""
        sizing = self.sizing
        model = self.model_id
        if sizing is not None and sizing.model != model:
            sizing = None
        estimate = sizing.estimate if sizing is not None else None
        seen = self.seen
        if seen is not None and (
            seen.model != model or (sizing is not None and seen.config_hash != sizing.config_hash)
        ):
            seen = None
        return choose(
            self.declared_bytes,
            estimate.device if estimate is not None else None,
            seen.device_bytes if seen is not None and seen.device_bytes else None,
            learns=sizing.learns if sizing is not None else True,
        )

    @property
    def memory_bytes(self) -> int:
        """Its model's footprint and the room its LoRA adapters may take
        (``adapter_bytes``)."""
        declared = self.declared_bytes
        if declared is not None:
            return declared + self.adapter_bytes
        known = self.sizing is not None or self.seen is not None
        return (self.footprint.bytes if known else 0) + self.adapter_bytes

    @property
    def model_id(self) -> str:
        return self.model.id if self.model else self.spec.model_id

    @property
    def node(self) -> str | None:
        """The node the slot is pinned to, else the one admission placed it on, else the
        one it last landed on (if any)."""
        if not self.on_nodes:
            return None
        placed = self.placement[0].node if self.placement else None
        return self.spec.node or placed or self.landed

    @property
    def where(self) -> str:
        """The admission scope: the device kind (``gpu``: every GPU of the host), or
        ``NODE/DEVICE`` once a node is known.

        The device lock is keyed by it (a GPU load's placement looks at every GPU), so the
        slots of one node never wait for the slots of another.
        """
        node = self.node
        kind = self.spec.device_kind
        return f"{node}/{kind}" if node else kind

    @property
    def lock_key(self) -> str:
        """The device lock admission takes: ``gpu`` for every GPU slot (a placement looks
        at every GPU of the host, or of the cluster's nodes), else :attr:`where`."""
        return "gpu" if self.spec.device_kind == "gpu" else self.where

    @property
    def placed(self) -> tuple[str, ...]:
        """The admission keys of its placement: its GPUs (``gpu:N``, on a cluster
        ``NODE/gpu:N``; none before it is placed), ``cpu``/``npu``, or ``NODE/DEVICE`` on a
        cluster (a slot recorded without GPUs: ``NODE/gpu``)."""
        if self.spec.device_kind == "gpu" and self.placement:
            return tuple(g.key for g in self.placement)
        if self.on_nodes or self.spec.device_kind != "gpu":
            return (self.where,)
        return ()

    @property
    def devices(self) -> tuple[str, ...]:
        """The admission keys the slot holds memory on now: its placement's, or, asleep,
        its host's (level 1: its weights) or none (level 2)."""
        if self.asleep and not self.waking:
            return (self.host,) if self.asleep == 1 else ()
        return self.placed

    @property
    def host(self) -> str:
        """The host memory key a sleeper's weights are counted on (``cpu``, or the node's
        on a cluster)."""
        node = self.node
        return f"{node}/cpu" if node else "cpu"

    @property
    def residency(self) -> str:
        if self.waking:
            return WAKING
        return ASLEEP if self.asleep else AWAKE

    def holdings(self) -> tuple[tuple[str, int, bool], ...]:
        """(key, bytes, coming up) for every key the slot holds memory on now (nothing
        unless admitted). Asleep: its weights on its host (level 1). Waking: its device
        memory again, reserved (a probe cannot see it yet), and the host's until ready."""
        if self.state not in ADMITTED_STATES:
            return ()
        size = self.memory_bytes
        host = ((self.host, size, False),) if self.asleep == 1 else ()
        if self.asleep and not self.waking:
            return host
        placed = self.placed
        each = share(size, len(placed)) if placed else 0
        loading = self.waking or self.state in LOADING_STATES
        return tuple((key, each, loading) for key in placed) + (host if self.waking else ())

    def bytes_on(self, device: str) -> tuple[int, bool]:
        """The bytes it holds on ``device`` (a key, or a kind: all of its GPUs; ``NODE/gpu``:
        all of its GPUs on that node), and whether they are coming up (reserved)."""
        held = self.holdings()
        for key, size, loading in held:
            if key == device:
                return size, loading
        prefix = device + ":"
        gpus = [loading for key, _size, loading in held if key.startswith(prefix)]
        if gpus:
            return self.memory_bytes, gpus[0]  # ``gpu``: the sum over the GPUs
        return 0, False

    def candidate(self, recent_weight: float = 0.0) -> EvictionCandidate:
        """The slot as the eviction planner sees it: where it holds memory now, whether its
        running server can sleep (the launch's capability, the slot's level), its costs;
        ``recent_weight``: the best priority-class weight among its recent users."""
        launch = self.launch
        can = launch is not None and launch.sleep is not None
        level = self.spec.sleep_level if can and self.idle_reason != IdleReason.NO_MODEL else 0
        load_s, wake_s = self.reload_s()
        book = self.book
        return EvictionCandidate(
            name=self.name,
            devices=self.devices,
            bytes=self.memory_bytes,
            priority=self.spec.priority,
            last_used=self.last_used,
            state=self.state,
            pinned=bool(self.spec.pinned),
            leases=len(book.leases),
            busy=self.busy or book.draining or book.waiters > 0 or book.queued > 0 or self.waking,
            access=self.access,
            generation=self.flight.generation,
            sleep_level=0 if self.asleep else level,
            asleep=self.asleep,
            host=self.host,
            placed=self.placed if self.state in ADMITTED_STATES else (),
            load_s=load_s,
            wake_s=wake_s,
            recent_weight=recent_weight,
            unit=self.spec.unit,
            replica_group=self.spec.replica_group,
        )

    def reload_s(self) -> tuple[float, float]:
        """(cold load, wake) seconds of its model: measured (moving averages), else a
        prior — 1 s per GiB of its memory estimate (at least 1 s) for a load, a twentieth
        of that for a wake (vLLM's sleep-mode figures: a wake is 18-200x faster)."""
        prior = max(1.0, self.memory_bytes / GIB)
        costs = self.costs if self.costs is not None and self.costs.model == self.model_id else None
        load = costs.load_s if costs is not None and costs.load_s else prior
        wake = costs.wake_s if costs is not None and costs.wake_s else max(0.05, prior / 20)
        return load, wake

    @property
    def busy(self) -> bool:
        """An operation holds the slot (its lock), or a load of it is in flight."""
        return self.lock.locked() or self.flight.running
