"""``slotctl operator``: kopf handlers on the controller core (CRs in, status out).

Composition only, like ``slotctl up`` (it runs the same :class:`~controller.daemon.Controller`
— SlotManager, Reconciler, API and router — and adds two things):

* a *source*: kopf indexes every ``Model``/``Slot`` (kopf fills indexes from the initial
  listing before any handler runs, so a restarted operator never prunes a slot it has not
  seen yet); the create/update/resume/delete handlers hand the whole set to
  :class:`~controller.operator.source.CrSource`, which validates it with the loader's
  checks and writes it through the guard; the reconciler converges as for a stack file;
* a *sink*: one kopf timer per CR waits for the manager's next event (or a resync period)
  and patches ``status`` from what is observed, so a server that dies shows up without any
  CR change; every transition also becomes a Kubernetes Event on its Slot.

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
import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import kopf

from controller.daemon.main import Controller, DaemonOptions
from controller.model.errors import SlotctlError
from controller.operator.board import StatusBoard
from controller.operator.crd import GROUP, VERSION
from controller.operator.source import CrKey, CrSource, SyncResult, cr_key
from controller.operator.source_aliases import alias_status
from controller.operator.status import (
    Observed,
    Verdict,
    Written,
    changed_fields,
    model_status,
    slot_status,
)
from controller.slots.manager import SlotManager

__all__ = ["Operator", "OperatorOptions", "SyncPacer"]

log = logging.getLogger("slotctl.operator")

ANNOTATION_PREFIX: Final = GROUP
DELETE_WAIT_S: Final = 30.0
# The CR handlers of a burst (1,000 Slots applied at once) share one judging of every CR
# that starts this long after the first of them (each judging is O(CRs)), and no sooner
# than SYNC_SPACING times what the last judging cost after it ended (at most
# SYNC_GAP_MAX_S): while CRs keep coming, judging takes at most 1/(1 + SYNC_SPACING) of the
# event loop (while one costs under SYNC_GAP_MAX_S / SYNC_SPACING), the rest is left to the
# loads and the status writes.
SYNC_BATCH_S: Final = 0.05
SYNC_SPACING: Final = 4.0
SYNC_GAP_MAX_S: Final = 1.0


@dataclass(slots=True)
class SyncPacer:
    """When the next shared judging of every CR may start (see :data:`SYNC_SPACING`)."""

    cost: float = 0.0  # seconds the last judging held the loop
    ended: float = -math.inf  # when it ended (time.monotonic)

    def delay(self, now: float) -> float:
        """Seconds from ``now`` (a handler asks) to the judging it will share."""
        rest = self.ended + min(SYNC_GAP_MAX_S, SYNC_SPACING * self.cost) - now
        return max(SYNC_BATCH_S, rest)

    def took(self, started: float, ended: float) -> None:
        self.cost, self.ended = max(0.0, ended - started), ended


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
    status_trust_s: float = 30.0  # a status write kopf's view does not show by then: again
    quiet: bool = False


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
                reap_orphans=False,  # from the first sync on (see _sync)
            )
        )
        self.source = CrSource(config_dir, desired=self.controller.desired)
        self.board = StatusBoard()
        self.registry = kopf.OperatorRegistry()
        self._handled: set[CrKey] = set()  # CRs whose own handler ran (status may follow)
        self._next_sync: asyncio.Future[SyncResult] | None = None  # shared by a burst
        self._pacer = SyncPacer()
        self._sync_indexes: Mapping[str, Any] = {}
        self._seen: dict[CrKey, Hashable] = {}  # the board stamp each status timer last saw
        self._looked: dict[CrKey, float] = {}  # when a timer of every slot's last woke
        self._written = Written(opts.status_trust_s)  # status patched, maybe not seen yet
        self.kopf_stop = asyncio.Event()
        self.kopf_ready = asyncio.Event()
        self.indexed = False  # a Model or Slot was listed: its handler's sync enables reaping
        self._register()

    @property
    def manager(self) -> SlotManager:
        assert self.controller.manager is not None
        return self.controller.manager

    # ------------------------------------------------------------------ running

    async def run(self) -> int:
        core = asyncio.create_task(self.controller.run(), name="controller")
        ready = asyncio.create_task(self.controller.ready.wait())
        await asyncio.wait({core, ready}, return_when=asyncio.FIRST_COMPLETED)
        if core.done():
            ready.cancel()
            return core.result()
        self.manager.events.add_listener(self.board.on_event)
        # kopf reports per-object failures (a 403 on a status patch, a handler's error)
        # on its ``kopf.objects`` logger, whose only handler posts Kubernetes Events; so
        # that they are not lost when the Event cannot be posted either, its warnings and
        # errors also go to stderr while kopf runs.
        stderr = _kopf_stderr_handler()
        logging.getLogger("kopf").addHandler(stderr)
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
        stopping = asyncio.create_task(self.controller.stop.wait())
        reaping = asyncio.create_task(self._reap_without_resources())
        await asyncio.wait({core, operator, stopping}, return_when=asyncio.FIRST_COMPLETED)
        self.kopf_stop.set()
        stopping.cancel()
        reaping.cancel()
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await operator
        finally:
            logging.getLogger("kopf").removeHandler(stderr)
        self.controller.stop.set()
        return await core

    async def _reap_without_resources(self) -> None:
        """No Model or Slot to sync: orphans are reaped one resync period after kopf's
        initial listing (a sync enables it at once). When one was listed, only its sync
        does: until then the config dir may not declare what runs (a slow handler must
        not let the reconciler stop an adopted server that a Slot declares)."""
        await self.kopf_ready.wait()
        await asyncio.sleep(self.opts.resync_s)
        if self.controller.reconciler is not None and not self.indexed:
            self.controller.reconciler.reap = True

    def _index(self, body: kopf.Body, **kwargs: Any) -> dict[tuple[str, str], dict[str, Any]]:
        self.indexed = True
        return _essence(body, **kwargs)

    # ------------------------------------------------------------------ kopf wiring

    def _register(self) -> None:
        reg = self.registry
        kopf.on.startup(registry=reg)(self._configure)
        kopf.on.login(registry=reg)(_login)
        kopf.on.cleanup(registry=reg)(self._cleanup)
        for plural, kind in (("models", "Model"), ("slots", "Slot"), ("aliases", "Alias")):
            kopf.index(GROUP, VERSION, plural, registry=reg, id=f"{plural}_index")(self._index)
            changed = self._changed_handler(kind)
            for decorator in (kopf.on.create, kopf.on.update, kopf.on.resume):
                decorator(GROUP, VERSION, plural, registry=reg, id=f"{plural}-sync")(changed)
            kopf.timer(GROUP, VERSION, plural, registry=reg, interval=0.01, id=f"{plural}-status")(
                self._status_handler(kind)
            )
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

    async def _sync_soon(self, indexes: Mapping[str, Any]) -> SyncResult:
        """:meth:`_sync`, shared by the handlers that ask before it starts (paced by
        :class:`SyncPacer`): kopf's indexes are updated before a handler runs, so the shared
        judging (later than any one handler's event) sees every CR at least as new as its
        event."""
        self._sync_indexes = indexes
        if self._next_sync is None:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[SyncResult] = loop.create_future()
            self._next_sync = future

            def run() -> None:
                self._next_sync = None
                started = time.monotonic()
                try:
                    future.set_result(self._sync(self._sync_indexes))
                except Exception as exc:  # noqa: BLE001 - handed to every waiting handler (kopf retries each)
                    future.set_exception(exc)
                finally:
                    self._pacer.took(started, time.monotonic())

            loop.call_later(self._pacer.delay(time.monotonic()), run)
        return await asyncio.shield(self._next_sync)

    def _sync(self, indexes: Mapping[str, Any]) -> SyncResult:
        verdicts, names = dict(self.source.verdicts), dict(self.source.slot_names)
        self.source.load("Model", _values(indexes.get("models_index")))
        self.source.load("Slot", _values(indexes.get("slots_index")))
        self.source.load("Alias", _values(indexes.get("aliases_index")))
        result = self.source.sync()
        # The Slots whose verdict or slot changed (their timers wait on their slot's name:
        # the old one and the new); the timers of no slot wake on any change. Told even if
        # the refresh below fails: a retried sync finds these verdicts recorded already.
        moved = {k for k, v in result.verdicts.items() if verdicts.get(k) != v}
        moved |= verdicts.keys() - result.verdicts.keys()
        moved |= {
            k
            for k in names.keys() | self.source.slot_names.keys()
            if names.get(k) != self.source.slot_names.get(k)
        }
        woken = {n for k in moved for n in (names.get(k), self.source.slot_names.get(k)) if n}
        try:
            reconciler = self.controller.reconciler
            if reconciler is not None:
                reconciler.reap = True  # the CRs are in the config dir now: orphans are orphans
            if reconciler is not None and result.changed:
                reconciler.refresh()
                reconciler.enqueue_all()
        finally:
            self.board.wake(woken)
        return result

    def _changed_handler(self, kind: str) -> Any:
        async def changed(body: kopf.Body, **kwargs: Any) -> None:
            result = await self._sync_soon(kwargs)
            key = cr_key(kind, body)
            if key not in self._handled:
                self._handled.add(key)
                slot = self.source.slot_of(key)  # its timer may have looked before this
                self.board.wake([slot] if slot else [])
            verdict = result.verdicts.get(key)
            if verdict is not None and verdict.problems:
                first = verdict.problems[0]
                kept = "; the last good spec stays in force" if verdict.accepted else ""
                kopf.warn(
                    body,
                    reason="InvalidSpec",
                    message=f"[{first.code}] {first.message}{kept}",
                )
            elif (what := _own_change(kind, self.source.slot_of(key), result.changed)) is not None:
                kopf.event(body, type="Normal", reason="Applied", message=f"applied: {what}")

        return changed

    def _delete_handler(self, kind: str) -> Any:
        async def deleted(body: kopf.Body, **kwargs: Any) -> None:
            key = cr_key(kind, body)
            slot = self.source.slot_of(key)
            # The index no longer offers a CR being deleted; deletions of a burst (a
            # `kubectl delete` of 1,000 Slots) share one judging, as changes do.
            await self._sync_soon(kwargs)
            self.source.remove(key)
            self._handled.discard(key)
            self._seen.pop(key, None)
            self._looked.pop(key, None)
            self._written.forget(key)
            if kind == "Slot" and slot is not None and slot not in self.source.slot_names.values():
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

    def _status_handler(self, kind: str) -> Any:
        async def status(body: kopf.Body, patch: kopf.Patch, stopped: Any, **_: Any) -> None:
            key = cr_key(kind, body)
            await self._next_change(key, stopped)
            if stopped or key not in self._handled:
                return  # not handled yet: nothing true to say (and no racing kopf's patches)
            now = asyncio.get_running_loop().time()
            old = self._written.believed(key, body.get("status") or {}, now)
            if kind == "Slot":
                new = self._slot_status(key, old)
                slot = self.source.slot_of(key)
                for event_type, reason, message in self.board.take_events(slot or ""):
                    kopf.event(body, type=event_type, reason=reason, message=message)
            elif kind == "Alias":
                new = alias_status(self.source.alias_ids.get(key), self._verdict(key), old)
            else:
                new = self._model_status(key, old)
            changes = changed_fields(new, old)
            for name, value in changes.items():
                patch.status[name] = value
            self._written.wrote(key, changes, now)

        return status

    async def _next_change(self, key: CrKey, stopped: Any) -> None:
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
            if slot is None:
                self._looked[key] = loop.time()

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
        )

    def _slot_status(self, key: CrKey, old: Mapping[str, Any]) -> dict[str, Any]:
        return slot_status(self._observed(self.source.slot_of(key)), self._verdict(key), old)

    def _model_status(self, key: CrKey, old: Mapping[str, Any]) -> dict[str, Any]:
        model_id = self.source.model_ids.get(key)
        slots = {
            view.name: view.state
            for view in self.manager.views()
            if model_id is not None and view.model_id == model_id
        }
        return model_status(model_id, self._verdict(key), slots, old)


def _own_change(kind: str, slot: str | None, changed: list[str]) -> str | None:
    """What a sync wrote of this resource's own (None: nothing): a Slot's slot file, the
    models' catalogue for a Model, the aliases' file for an Alias. A burst's handlers share
    one sync; each resource tells only its own part."""
    if kind == "Slot":
        return f"slot {slot}" if slot is not None and slot in changed else None
    part = {"Model": "models", "Alias": "aliases"}.get(kind)
    return part if part in changed else None


def _kopf_stderr_handler() -> logging.Handler:
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s kopf   %(message)s", datefmt="%H:%M:%S"))
    return handler


def _login(**kwargs: Any) -> Any:
    """In a pod: the service account; elsewhere: ``KUBECONFIG`` or ``~/.kube/config``."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _essence(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """What the source needs of a CR, under (namespace, name) in kopf's index."""
    meta = body.get("metadata", {})
    essence = {
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "generation": meta.get("generation"),
            "creationTimestamp": meta.get("creationTimestamp"),
            "deleting": bool(meta.get("deletionTimestamp")),
        },
        "spec": dict(body.get("spec") or {}),
    }
    return {(str(meta.get("namespace") or ""), str(meta.get("name") or "")): essence}


def _values(index: Any) -> Iterable[Mapping[str, Any]]:
    if index is None:
        return []
    return [v for store in index.values() for v in store if not v["metadata"]["deleting"]]
