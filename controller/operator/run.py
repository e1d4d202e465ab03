"""``slotctl operator``: kopf handlers on the controller core (CRs in, status out).

Composition only, like ``slotctl up`` (it runs the same :class:`~controller.daemon.Controller`
— SlotManager, Reconciler, API and router — and adds two things):

* a *source*: kopf's watch is the informer. Each create/update/resume/delete handler hands
  its one resource to :class:`~controller.operator.source.CrSource`, which judges it (and
  what it touches) with the loader's rules in memory and tells the desired-state cache
  which slots, models and aliases changed; the reconciler queues those slots. Nothing is
  written as TOML. kopf also indexes every ``Model``/``Slot``/``Alias``/``Adapter``: the first
  handler to run (kopf runs none before every index holds its initial listing; one on the
  slotctl.io CRDs runs even when there is no resource) primes the source with the whole
  listing, and the controller adopts what runs only once the source is primed, so a
  restarted operator never prunes nor restarts a slot it has not seen yet; a resync
  compares the source with the indexes every ``resync_s`` (a deletion missed);
* a *sink*: one kopf timer per CR waits for the manager's next event, or a judging of the
  source that moved a verdict (whatever caused it: the CR's own event, a resync, the config
  dir's files), or a resync period, and patches ``status`` from what is observed, so a
  server that dies shows up without any CR change; every transition also becomes a
  Kubernetes Event on its Slot.

Deleting a Slot: kopf's finalizer holds the object until the slot's server is stopped.
kopf keeps its progress and diff-base in annotations (``slotctl.io/...``), never in
``status``, which the structural schema would prune. Servers outlive the operator process
(like ``up --keep-running``): a restarted operator adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, cast

import kopf

from controller.daemon.main import Controller, DaemonOptions
from controller.model.errors import SlotctlError
from controller.operator.board import StatusBoard
from controller.operator.bodies import (
    CrKey,
    Essence,
    ModelStatus,
    ReplicasStatus,
    RolloutStatus,
    SlotStatus,
    Status,
    cr_key,
    essence_of,
)
from controller.operator.crd import GROUP, VERSION
from controller.operator.pools import PoolSync
from controller.operator.source import STACK, CrSource
from controller.operator.source_adapters import adapter_status
from controller.operator.source_aliases import alias_status
from controller.operator.status import (
    Observed,
    Verdict,
    Written,
    changed_fields,
    model_status,
    replicas_status,
    rollout_status,
    slot_status,
)
from controller.reconcile.apply import apply_to_config
from controller.runtime.kubernetes.api import KubernetesApi
from controller.runtime.kubernetes.pools import InferencePools
from controller.runtime.kubernetes.poolspec import Picker
from controller.scheduling.rollout import RolloutView
from controller.slots.manager import SlotManager
from controller.spec.configdir import read_config_dir
from controller.spec.loader import DesiredState
from controller.spec.replicas import replica_names

__all__ = ["INDEXES", "Operator", "OperatorOptions", "forget_written_files"]

log = logging.getLogger("slotctl.operator")

ANNOTATION_PREFIX: Final = GROUP
DELETE_WAIT_S: Final = 30.0
# kopf's index of each kind (what the source is primed and resynced from), by kind.
INDEXES: Final = {
    "Model": "models_index",
    "Slot": "slots_index",
    "Alias": "aliases_index",
    "Adapter": "adapters_index",
}
# No handler ran this long after kopf started (it runs them once every index holds its
# listing; the CRD handler then runs at once): the source is primed from what is indexed.
PRIME_LATE_S: Final = 60.0
# The states a load or an unload passes through, and "pending" (the controller has not
# picked the slot up yet): the status waits a moment for the next.
PASSING: Final = frozenset({"pending", "pulling", "starting", "warming", "unloading"})

Handler = Callable[..., Awaitable[None]]  # a kopf handler (kopf passes its kwargs by name)


@dataclass(slots=True)
class OperatorOptions:
    state_dir: Path
    config_dir: Path | None = None  # default: <state_dir>/config
    runtime: str = "process"
    namespaces: list[str] = field(default_factory=list)
    all_namespaces: bool = False
    listen: str | None = None  # the slotctl API and router (None: off)
    token: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # --allowed-host: the Service's names
    liveness: str | None = None  # kopf's probe, e.g. http://0.0.0.0:8080/healthz
    resync_s: float = 30.0
    # A status timer with no change to write looks again this often (a lost patch, a body
    # edited by someone else); every change wakes it at once. 5 s was 200 kopf timer runs a
    # second for nothing at 1,000 Slots (issue 28).
    status_resync_s: float = 30.0
    # The timers that read every slot (a Model's, an Alias's, a Slot's not in force) wake
    # on any slot's event: they recompute at most this often, a burst's events as one.
    status_gap_s: float = 1.0
    # A Slot in a passing state (pending, pulling, starting, warming, unloading) waits this long for
    # its next change before its status says so: a load's steps come seconds apart, and a
    # patch for each was ~3 patches a Slot at 300 Slots where one or two say the same.
    status_settle_s: float = 2.0
    status_trust_s: float = 30.0  # a status write kopf's view does not show by then: again
    quiet: bool = False
    # kubernetes runtime: one InferencePool per model, its Ready slots' pods (pools.py)
    inference_pools: bool = False
    endpoint_picker: str | None = None  # the pools' endpointPickerRef: NAME:PORT[:MODE]


class Operator:
    """One process: the controller core plus kopf. See the module docstring."""

    def __init__(self, opts: OperatorOptions) -> None:
        self.opts = opts
        config_dir = opts.config_dir or opts.state_dir / "config"
        self.controller = Controller(
            DaemonOptions(
                config_dir=config_dir,
                state_dir=opts.state_dir,
                runtime=opts.runtime,
                keep_running=True,
                resync_s=opts.resync_s,
                listen=opts.listen,
                token=opts.token,
                allowed_hosts=opts.allowed_hosts,
                quiet=opts.quiet,
            )
        )
        self.config_dir = config_dir
        self.source = CrSource()
        self.controller.desired.add_source(self.source)  # after the config dir's files
        self.board = StatusBoard()
        # every judging that moves a verdict wakes the status timers (whatever judged it)
        self.source.on_moved = self.board.wake
        self.registry = kopf.OperatorRegistry()
        self._handled: set[CrKey] = set()  # CRs whose own handler ran (status may follow)
        self._indexes: Mapping[str, object] | None = None  # kopf's (live), from a handler
        self._seen: dict[CrKey, Hashable] = {}  # the board stamp each status timer last saw
        self._looked: dict[CrKey, float] = {}  # when a timer of every slot's last woke
        self._written = Written(opts.status_trust_s)  # status patched, maybe not seen yet
        self.kopf_stop = asyncio.Event()
        self.kopf_ready = asyncio.Event()
        self.pools: PoolSync | None = None
        # refused before anything starts (ValueError): a picker that does not parse
        self._picker = Picker.parse(opts.endpoint_picker)
        if opts.inference_pools and opts.runtime != "kubernetes":
            raise ValueError("--inference-pools needs --runtime kubernetes")
        self._register()

    @property
    def manager(self) -> SlotManager:
        assert self.controller.manager is not None
        return self.controller.manager

    # ------------------------------------------------------------------ running

    async def run(self) -> int:
        """kopf and the controller core together: the core recovers (adopts what runs)
        once the source is primed, which kopf's first handler does."""
        self.config_dir.mkdir(parents=True, exist_ok=True)
        removed = forget_written_files(self.config_dir)
        if removed:
            log.info("removed what an older operator wrote to %s: %s", self.config_dir, removed)
        # kopf reports per-object failures (a 403 on a status patch, a handler's error)
        # on its ``kopf.objects`` logger, whose only handler posts Kubernetes Events; so
        # that they are not lost when the Event cannot be posted either, its warnings and
        # errors also go to stderr while kopf runs.
        stderr = _kopf_stderr_handler()
        logging.getLogger("kopf").addHandler(stderr)
        core = asyncio.create_task(self.controller.run(), name="controller")
        operator = asyncio.create_task(
            kopf.operator(
                registry=self.registry,
                clusterwide=self.opts.all_namespaces,
                namespaces=self.opts.namespaces,
                standalone=True,  # one replica (the chart's Deployment: Recreate)
                liveness_endpoint=self.opts.liveness,
                stop_flag=self.kopf_stop,
                ready_flag=self.kopf_ready,
            ),
            name="kopf",
        )
        background = [
            asyncio.create_task(self._prime_late()),
            asyncio.create_task(self._resync()),
        ]
        ready = asyncio.create_task(self.controller.ready.wait())
        stopping = asyncio.create_task(self.controller.stop.wait())
        try:
            await asyncio.wait(
                {core, ready, operator, stopping}, return_when=asyncio.FIRST_COMPLETED
            )
            if ready.done() and not core.done():
                self.manager.events.add_listener(self.board.on_event)
                if self.opts.inference_pools:
                    background.append(asyncio.create_task(self._keep_pools(), name="pools"))
                await asyncio.wait({core, operator, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            stopping.cancel()
            self.kopf_stop.set()
            for task in background:
                task.cancel()
            try:
                with contextlib.suppress(asyncio.CancelledError):
                    await operator
            finally:
                logging.getLogger("kopf").removeHandler(stderr)
            self.controller.stop.set()
        return await core

    async def _keep_pools(self) -> None:
        """The InferencePools (``--inference-pools``): started once the controller is
        ready, so after the source is primed (a half-known catalogue would drop a model's
        pool for a moment)."""
        root = self.controller.root
        assert root is not None
        runtime = root.runtime
        if not isinstance(runtime, KubernetesApi):
            log.error("--inference-pools needs the kubernetes runtime: no pools kept")
            return
        self.pools = PoolSync(self.manager, self.board, InferencePools(runtime, self._picker))
        await self.pools.run(self.opts.resync_s)

    async def _prime_late(self) -> None:
        """kopf runs no handler until every index holds its listing, and then the CRD
        handler at once; should none run for :data:`PRIME_LATE_S` after kopf started (a
        cluster without the CRD events: nothing else waits that long), the source is
        primed from what is indexed, so the controller does not wait for ever."""
        await self.kopf_ready.wait()
        await asyncio.sleep(max(PRIME_LATE_S, self.opts.resync_s))
        if not self.source.synced:
            log.warning(
                "no handler ran %.0fs after kopf started: priming the custom "
                "resources from what kopf has indexed",
                PRIME_LATE_S,
            )
            self._prime(self._indexes or {})

    async def _resync(self) -> None:
        """The informer's resync: every ``resync_s``, the source compared with kopf's
        indexes (a deletion whose handler did not run, an event missed): only what
        differs is judged."""
        while True:
            await asyncio.sleep(self.opts.resync_s)
            indexes = self._indexes
            if indexes is None or not self.source.synced:
                continue
            for kind, index in INDEXES.items():
                self.source.replace(kind, _values(indexes.get(index)))  # wakes what moved

    def _index(self, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Essence]:
        essence = essence_of(body)
        meta = essence["metadata"]
        return {(meta["namespace"], meta["name"]): essence}

    # ------------------------------------------------------------------ kopf wiring

    def _register(self) -> None:
        reg = self.registry
        kopf.on.startup(registry=reg)(self._configure)
        kopf.on.login(registry=reg)(_login)
        kopf.on.cleanup(registry=reg)(self._cleanup)
        for plural, kind in (
            ("models", "Model"),
            ("slots", "Slot"),
            ("aliases", "Alias"),
            ("adapters", "Adapter"),
        ):
            kopf.index(GROUP, VERSION, plural, registry=reg, id=f"{plural}_index")(self._index)
            changed = self._changed_handler(kind)
            for decorator in (kopf.on.create, kopf.on.update, kopf.on.resume):
                decorator(GROUP, VERSION, plural, registry=reg, id=f"{plural}-sync")(changed)
            kopf.timer(GROUP, VERSION, plural, registry=reg, interval=0.01, id=f"{plural}-status")(
                self._status_handler(kind)
            )
        # Runs once every index holds its listing (kopf runs no handler before), even when
        # there is no resource at all: it primes the source (the controller waits for it).
        kopf.on.event(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            registry=reg,
            id="listed",
            field="spec.group",
            value=GROUP,
        )(self._listed)
        # A Slot's finalizer holds it until its server is stopped; a Model needs none.
        kopf.on.delete(GROUP, VERSION, "slots", registry=reg, id="slots-delete")(
            self._delete_handler("Slot")
        )
        kopf.on.delete(GROUP, VERSION, "models", registry=reg, id="models-delete", optional=True)(
            self._delete_handler("Model")
        )
        kopf.on.delete(GROUP, VERSION, "aliases", registry=reg, id="aliases-delete", optional=True)(
            self._delete_handler("Alias")
        )
        kopf.on.delete(
            GROUP, VERSION, "adapters", registry=reg, id="adapters-delete", optional=True
        )(self._delete_handler("Adapter"))

    async def _configure(self, settings: kopf.OperatorSettings, **_: Any) -> None:
        # Status is pruned to its schema: kopf's state lives in annotations instead.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=ANNOTATION_PREFIX
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{GROUP}/finalizer"
        # Events: the operator's own (Applied, Stopped, one per transition: kopf.event) and
        # kopf's warnings and errors; not kopf's INFO lines ("Handler ... succeeded", "Creation
        # is processed"), three a Slot that said nothing its own events do not.
        settings.posting.level = logging.WARNING
        # A 409 (someone wrote the object meanwhile) is retried at once, then backs off.
        settings.queueing.error_delays = (0.1, 0.5, 1, 2, 5, 10, 30, 60)
        # A status timer exits at once when its object is deleted; look again soon.
        settings.background.cancellation_polling = 0.5
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60

    async def _cleanup(self, **_: Any) -> None:
        log.info("operator stopping; servers keep running for the next start to adopt")

    # ------------------------------------------------------------------ the source

    async def _listed(self, **kwargs: Any) -> None:
        self._prime(kwargs)

    def _prime(self, indexes: Mapping[str, object]) -> None:
        """The first handler's: the source takes kopf's whole listing (every index is
        complete before kopf runs a handler) and is synced."""
        if self._indexes is None and indexes:
            self._indexes = indexes
        if self.source.synced:
            return
        self.source.prime({kind: _values(indexes.get(index)) for kind, index in INDEXES.items()})
        self.board.wake(self.source.slots)

    def _changed_handler(self, kind: str) -> Handler:
        async def changed(body: kopf.Body, **kwargs: Any) -> None:
            self._prime(kwargs)
            key = cr_key(kind, body)
            if body.get("metadata", {}).get("deletionTimestamp"):
                return  # its delete handler takes it out
            self.source.apply(kind, body)  # wakes the timers of what its judging moved
            if key not in self._handled:
                self._handled.add(key)
                slot = self.source.slot_of(key)  # its timer may have looked before this
                self.board.wake({slot} if slot else ())
            verdict = self.source.verdicts.get(key)
            if verdict is not None and verdict.problems:
                first = verdict.problems[0]
                kept = "; the last good spec stays in force" if verdict.accepted else ""
                kopf.warn(
                    body,
                    reason="InvalidSpec",
                    message=f"[{first.code}] {first.message}{kept}",
                )
            elif (what := self._applied(kind, key, body)) is not None:
                kopf.event(body, type="Normal", reason="Applied", message=f"applied: {what}")

        return changed

    def _applied(self, kind: str, key: CrKey, body: Mapping[str, object]) -> str | None:
        """What this resource's own generation put in force, the first time a handler
        sees it (its status has not observed the generation yet; None: nothing new):
        the slot of a Slot, the catalogue for a Model, the aliases for an Alias."""
        verdict = self.source.verdicts.get(key)
        if verdict is None or not verdict.current:
            return None
        status = body.get("status")
        observed = status.get("observedGeneration") if isinstance(status, Mapping) else None
        if observed == verdict.generation:
            return None  # a resume of what was in force before (a restart): said then
        if kind == "Slot":
            slot = self.source.slot_of(key)
            return f"slot {slot}" if slot is not None else None
        return {"Model": "models", "Alias": "aliases", "Adapter": "adapters"}.get(kind)

    def _delete_handler(self, kind: str) -> Handler:
        async def deleted(body: kopf.Body, **kwargs: Any) -> None:
            self._prime(kwargs)
            key = cr_key(kind, body)
            slot = self.source.slot_of(key)
            self.source.remove(key)  # wakes the timers of what its judging moved
            self._handled.discard(key)
            self._seen.pop(key, None)
            self._looked.pop(key, None)
            self._written.forget(key)
            if kind != "Slot" or slot is None:
                return
            await self.controller.ready.wait()
            if slot not in self.controller.desired.snapshot.slots:  # nobody declares it now
                await self._wait_stopped(slot)
                kopf.event(
                    body, type="Normal", reason="Stopped", message=f"slot {slot}: server stopped"
                )

        return deleted

    async def _wait_stopped(self, slot: str) -> None:
        """Until the manager forgot the slot and no server of it runs (or retry later)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DELETE_WAIT_S
        seen: Hashable = self.board.version
        while loop.time() < deadline:
            if self.manager.known(slot) is None:
                observed = await self.manager.runtime.inspect(slot)
                if not observed.running:
                    return
            seen = await self.board.wait(seen, 0.2)
        raise kopf.TemporaryError(f"slot {slot}: its server is still stopping", delay=2)

    # ------------------------------------------------------------------ the sink

    def _status_handler(self, kind: str) -> Handler:
        async def status(
            body: kopf.Body, patch: kopf.Patch, stopped: kopf.DaemonStopped, **_: Any
        ) -> None:
            key = cr_key(kind, body)
            if not self.controller.ready.is_set():
                await self._until_ready(stopped)
                return  # looked at again at the timer's next run
            await self._next_change(key, stopped)
            if stopped or key not in self._handled:
                return  # not handled yet: nothing true to say (and no racing kopf's patches)
            now = asyncio.get_running_loop().time()
            if kind != "Slot" or self.source.slot_of(key) is None:
                self._looked[key] = now  # a look at every slot: the next one a gap later
            old = self._written.believed(key, body.get("status") or {}, now)
            new: Status
            if kind == "Slot":
                new = self._slot_status(key, old)
                slot = self.source.slot_of(key)
                if new.get("state") in PASSING and new.get("state") != old.get("state"):
                    await self._settle(key, slot, stopped)  # a later step may follow soon
                    if stopped:
                        return
                    now = asyncio.get_running_loop().time()
                    new = self._slot_status(key, old)
                for event_type, reason, message in self.board.take_events(slot or ""):
                    kopf.event(body, type=event_type, reason=reason, message=message)
            elif kind == "Alias":
                new = alias_status(self.source.alias_ids.get(key), self._verdict(key), old)
            elif kind == "Adapter":
                new = adapter_status(self.source.adapter_ids.get(key), self._verdict(key), old)
            else:
                new = self._model_status(key, old)
            changes = changed_fields(new, old)
            for name, value in changes.items():
                patch.status[name] = value
            self._written.wrote(key, changes, now)

        return status

    async def _settle(self, key: CrKey, slot: str | None, stopped: kopf.DaemonStopped) -> None:
        """Until the slot's next change, ``status_settle_s`` or kopf stops the timer."""
        change = asyncio.ensure_future(
            self.board.wait(self.board.stamp(slot), self.opts.status_settle_s, slot)
        )
        stop = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({change, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            change.cancel()
            stop.cancel()
        if change.done() and not change.cancelled():
            self._seen[key] = change.result()

    async def _until_ready(self, stopped: kopf.DaemonStopped) -> None:
        """Until the controller is ready (a manager to ask) or kopf stops the timer."""
        ready = asyncio.ensure_future(self.controller.ready.wait())
        stop = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            stop.cancel()

    async def _next_change(self, key: CrKey, stopped: kopf.DaemonStopped) -> None:
        """The next manager event or source sync (or the resync period), unless kopf stops
        the timer first (the object is being deleted: its finalizer waits for us)."""
        slot = self.source.slot_of(key) if key[0] == "Slot" else None
        loop = asyncio.get_running_loop()
        stop = asyncio.ensure_future(stopped.wait())
        change: asyncio.Future[Hashable] | None = None
        try:
            if slot is None:  # every slot's events wake it: a burst's are one look
                gap = self._looked.get(key, -math.inf) + self.opts.status_gap_s - loop.time()
                if gap > 0:
                    await asyncio.wait({stop}, timeout=gap)
            if not stop.done():
                change = asyncio.ensure_future(
                    self.board.wait(self._seen.get(key), self.opts.status_resync_s, slot)
                )
                await asyncio.wait({change, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if change is not None:
                change.cancel()
        if change is not None and change.done() and not change.cancelled():
            self._seen[key] = change.result()

    def _verdict(self, key: CrKey) -> Verdict:
        return self.source.verdicts.get(key) or Verdict()

    def _observed(self, slot: str | None) -> Observed | None:
        if slot is None:
            return None
        try:
            view = self.manager.view(slot)
        except SlotctlError:
            return None
        return Observed(
            state=view.state,
            idle_reason=view.idle_reason,
            model=view.model_id,
            endpoint=view.endpoint,
            device=view.device,
            memory_bytes=view.memory_bytes,
            message=view.message,
            dispatchable=view.dispatchable,
            last_error=self.board.last_error.get(slot),
            node=view.node,
            waiting=view.waiting,
            rollout=self._rollout(slot, view.rollout),
        )

    def _rollout(self, slot: str, live: RolloutView | None) -> RolloutStatus | None:
        """The rollout in flight (the slot's view), else the last one decided (the board)."""
        if live is not None:
            self.board.rollouts[slot] = (live.way, live.reason)  # (its end may say less)
            return rollout_status(live.way, live.phase, live.reason, live.message, live.since)
        last = self.board.rollouts.get(slot)
        return None if last is None else rollout_status(last[0], "done", last[1])

    def _slot_status(self, key: CrKey, old: Mapping[str, object]) -> SlotStatus:
        slot = self.source.slot_of(key)
        observed = self._observed(slot)
        return slot_status(observed, self._verdict(key), old, replicas=self._replicas(slot))

    def _replicas(self, slot: str | None) -> ReplicasStatus | None:
        """The slot's replicas summed up (None: it has none)."""
        spec = self.manager.known(slot) if slot is not None else None
        if slot is None or spec is None or spec.max_count <= 1:
            return None
        members = [(slot, 0, self._observed(slot))]
        members += [(n, i, self._observed(n)) for i, n in enumerate(replica_names(spec), 1)]
        return replicas_status(spec.min_count, spec.max_count, members)

    def _model_status(self, key: CrKey, old: Mapping[str, object]) -> ModelStatus:
        model_id = self.source.model_ids.get(key)
        slots = self.manager.model_states(model_id) if model_id is not None else {}
        return model_status(model_id, self._verdict(key), slots, old)


def _kopf_stderr_handler() -> logging.Handler:
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s kopf   %(message)s", datefmt="%H:%M:%S"))
    return handler


def _login(**kwargs: Any) -> Any:
    """In a pod: the service account; elsewhere: ``KUBECONFIG`` or ``~/.kube/config``."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


class _Index(Protocol):
    """What the operator reads of one of kopf's indexes (``kopf.Index``): its stores."""

    def values(self) -> Iterable[Iterable[Essence]]: ...


def _values(index: object) -> Iterable[Essence]:
    """The resources in one of kopf's indexes but the ones being deleted (their delete
    handler takes them out; a finalizer may hold them a while)."""
    if index is None:
        return []
    stores = cast(_Index, index).values()
    return [v for store in stores for v in store if not v["metadata"]["deleting"]]


def forget_written_files(config_dir: Path) -> list[str]:
    """What an older operator wrote to its config dir (its custom resources as the stack
    :data:`~controller.operator.source.STACK`: slot files and aliases), removed through
    the guard: the resources are held in memory now, and the files would come first.
    The catalogue's models it wrote stay (a Model resource replaces the entry of its id).
    Returns what was removed."""
    if not config_dir.is_dir():
        return []
    snapshot = read_config_dir(config_dir)
    if not any(s.stack == STACK for s in snapshot.slots.values()) and not any(
        a.stack == STACK for a in snapshot.aliases.values()
    ):
        return []
    empty = DesiredState(stacks=(STACK,), models={}, slots={}, aliases={})
    return apply_to_config(empty, config_dir, prune=True, snapshot=snapshot, force=True)
