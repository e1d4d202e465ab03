"""The reconciler: observe -> plan -> act for one slot, over a keyed work queue.

``plan_slot`` (:mod:`controller.reconcile.plan`, pure): desired (a stack or the config dir), what is
currently applied, and what is observed go in; one :class:`Action` with its reason comes
out. ``stack diff`` prints exactly the plan ``stack apply`` and the daemon execute.

:class:`Reconciler` is controller-runtime's shape: :meth:`Reconciler.reconcile` takes a slot
*name*, re-reads the desired state from the cache (:class:`~controller.spec.desired.DesiredCache`,
in memory) and the observed state from the manager (through its port,
:class:`~controller.slots.interfaces.ReconcilerPort`), acts, and returns a
:class:`Result` or raises; :func:`~controller.reconcile.plan.requeue_for` maps that outcome
to what the work queue (:class:`~controller.reconcile.queue.WorkQueue`: per-key
serialisation, the dirty mark, requeue-after, rate-limited retry) does with the name. The
names come from the event sources of :mod:`controller.reconcile.triggers`, each of which
enqueues only what its event touches (a desired-state change, a manager event, memory
coming back), and from the periodic resync, which enqueues every slot. Different slots
reconcile concurrently, one slot never twice at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from controller.model.errors import (
    InsufficientMemory,
    SlotctlError,
)
from controller.model.events import EventKind, Op
from controller.model.lifecycle import SlotState
from controller.reconcile.plan import (
    ACTION_KINDS,
    SCHEDULING_KEYS,
    Action,
    ObservedSlot,
    Result,
    plan_slot,
    plans_for,
    requeue_delay,
    requeue_for,
    spec_changes,
    with_rollout,
)
from controller.reconcile.queue import QueueShutDown, WorkQueue
from controller.reconcile.triggers import desired_names, follow_manager, watch_room
from controller.slots.interfaces import ReconcilerPort
from controller.slots.records import SlotStatus
from controller.spec.configdir import ConfigSnapshot
from controller.spec.desired import DesiredCache
from controller.spec.sources import DesiredChange

# The plan lives in controller.reconcile.plan (pure); re-exported for the callers of the loop.
__all__ = [
    "ACTION_KINDS",
    "SCHEDULING_KEYS",
    "Action",
    "ObservedSlot",
    "Reconciler",
    "Result",
    "observe_manager",
    "plan_slot",
    "plans_for",
    "requeue_delay",
    "spec_changes",
]

log = logging.getLogger("slotctl.reconcile")

_DONE = Result()  # frozen: one for every pass that asks nothing of the queue

# Passes at once. A pass that loads holds its worker until the server is ready (or
# fails), so this bounds the loads in flight: with 16, fifty 1 s loads took four rounds.
# Admission (memory) is what limits loads; a worker is an idle task.
WORKERS = 64
# The loop time passes may take in a row before the loop's other callbacks (the API, the
# data plane, probes) get a turn. A pass that never awaits (a no-op, a non-autoload
# slot's first) gives the loop nothing back; 64 workers over a full queue (1,000 new
# slots) held it for seconds (issue 40, item 4).
SLICE_S = 0.01


def observe_manager(manager: ReconcilerPort, name: str) -> ObservedSlot | None:
    status = manager.observe(name)
    return None if status is None else observed_slot(name, status)


def observed_slot(name: str, status: SlotStatus) -> ObservedSlot:
    # Inside a backoff window (or an open breaker's cap): retry when it ends — an open
    # breaker then lets one try through (half-open).
    return ObservedSlot(
        name=name,
        state=status.state,
        idle_reason=status.idle_reason,
        running=status.state not in (SlotState.OFFLINE, SlotState.ERROR),
        config_hash=status.config_hash,
        message=status.message,
        blocked=status.retry_after_s > 0,
        retry_after_s=status.retry_after_s,
        waiting=status.waiting,
        paused=status.paused,
    )


class Reconciler:
    """Drives a SlotManager towards the desired state. See the module docstring."""

    def __init__(
        self,
        manager: ReconcilerPort,
        config_dir: Path,
        *,
        resync_s: float = 30.0,
        workers: int = WORKERS,
        on_plan: Callable[[Action], None] | None = None,
        desired: DesiredCache | None = None,
    ) -> None:
        self.manager = manager
        self.config_dir = Path(config_dir)
        # The desired state's one owner (the daemon's, shared with the API, GitOps and the
        # operator); its every snapshot sets the manager's catalogue.
        self.desired = desired if desired is not None else DesiredCache(self.config_dir)
        self.queue: WorkQueue[str] = WorkQueue()
        self.desired.subscribe(self._desired_changed)  # the first event source
        self._catalogue(self.desired.snapshot)  # read now, as the reconciler starts
        self.resync_s = resync_s
        self.workers = workers
        self.on_plan = on_plan
        # Orphans are stopped at each resync; the operator holds that off until its first
        # sync (before it, a fresh config dir declares nothing: everything would look
        # like an orphan, such as the Deployments a moved operator pod should adopt).
        self.reap = True
        self.errors: dict[str, str] = {}
        # What was last said of each slot (plan, error): a retry that would say the same
        # again is quiet; it is said again once it changes or after a success.
        self._said_plan: dict[str, tuple[str, str]] = {}
        self._said_error: dict[str, tuple[str, str]] = {}
        self.passes = 0
        self._slice_began = time.perf_counter()  # the passes' current slice of the loop
        self._gate: asyncio.Future[None] | None = None  # the next slice, once this one is used
        # The last observation of each slot, reused while the manager reports the same
        # status (an ObservedSlot costs more to build than the status to compare).
        self._observed: dict[str, tuple[SlotStatus, ObservedSlot]] = {}
        # Called after every pass with (slot, seconds, ok): the API's metrics.
        self.pass_observers: list[Callable[[str, float, bool], None]] = []

    # ---------------------------------------------------------------- desired

    @property
    def snapshot(self) -> ConfigSnapshot:
        """The desired state in force (:class:`~controller.spec.desired.DesiredCache`)."""
        return self.desired.snapshot

    @property
    def broken(self) -> set[str]:
        """Slots whose config file is present but invalid right now."""
        return self.desired.broken

    def _catalogue(self, snapshot: ConfigSnapshot) -> None:
        self.manager.set_models(snapshot.models, order=list(snapshot.slots))
        self.manager.set_aliases({i: a.spec for i, a in snapshot.aliases.items()})
        self.manager.set_adapters({i: a.spec for i, a in snapshot.adapters.items()})

    def _desired_changed(self, change: DesiredChange) -> None:
        """A desired-state change (any source): the manager's catalogue follows at once
        when models or aliases changed; the slots it touches are queued."""
        snapshot = self.desired.snapshot
        if change.models or change.aliases or change.adapters or change.settings:
            self._catalogue(snapshot)
        names = sorted(desired_names(change, snapshot.slots, self.manager.names()))
        self._stop_unwanted_pulls(names, snapshot)
        self.queue.add_all(names)

    def _stop_unwanted_pulls(self, names: list[str], snapshot: ConfigSnapshot) -> None:
        """A slot removed or disabled while a pass loads it — its load pulling its model,
        for minutes maybe: the pull is stopped, so that pass ends and the next one acts at
        once (the queue holds a key's next pass until its running one ends)."""
        for name in names:
            if not self.queue.is_processing(name):
                continue
            want = snapshot.slots.get(name)
            if want is None or not want.spec.activated:
                self.manager.stop_pull(name, "removed" if want is None else "disabled")

    def refresh(self, fresh: ConfigSnapshot | None = None) -> ConfigSnapshot:
        """Re-read the config dir (or take ``fresh``): what changed is queued and the
        manager's catalogue follows at once. A missing or unlistable config dir changes
        nothing."""
        return self.desired.refresh(fresh)

    async def refresh_async(self, slots: list[str] | None = None) -> ConfigSnapshot:
        """:meth:`refresh` with the read in a worker thread, one at a time (``slots``:
        only their files)."""
        return await self.desired.refresh_async(slots)

    def all_names(self) -> list[str]:
        names = list(self.snapshot.slots)
        names += [n for n in self.manager.names() if n not in self.snapshot.slots]
        return names

    # ---------------------------------------------------------------- one pass

    def plan(self, name: str) -> Action:
        want = self.snapshot.slots.get(name)
        have = self.manager.known(name)
        obs = self._observe(name)
        want_hash = self.manager.launch_hash(want) if want else None
        resident = self.manager.is_resident(name)
        if (
            want is not None
            and want.spec.model_id
            and want.spec.model_id not in self.manager.models
        ):
            return Action(
                "noop",
                name,
                f"model {want.spec.model_id!r} is not in the catalogue: "
                "fix the config dir; the running server is left as it is",
            )
        holder = self.manager.group_holder(name) if want is not None else None
        action = plan_slot(
            name, want, have, obs, want_hash=want_hash, resident=resident, group_holder=holder
        )
        if action.kind == "recreate" and want is not None:
            return with_rollout(action, self.manager.rollout_for(want))
        return action

    def _observe(self, name: str) -> ObservedSlot | None:
        status = self.manager.observe(name)
        if status is None:
            self._observed.pop(name, None)
            return None
        last = self._observed.get(name)
        if last is not None and last[0] == status:
            return last[1]
        observed = observed_slot(name, status)
        self._observed[name] = (status, observed)
        return observed

    async def reconcile(self, name: str) -> Result:
        """Observe, plan and act for one slot. Raises typed errors; returns a requeue."""
        action = self.plan(name)
        if action.kind != "noop" and self._said_plan.get(name) != (action.kind, action.reason):
            self._said_plan[name] = (action.kind, action.reason)
            self.manager.events.emit(
                EventKind.PLAN,
                Op.RECONCILE,
                slot=name,
                message=action.reason,
                details={
                    "action": action.kind,
                    **{k: v for k, v in action.details.items() if k.startswith("rollout")},
                },
            )
            if self.on_plan is not None:
                self.on_plan(action)
        await self.act(action)
        retry = action.details.get("retry_after_s")  # backing off: look again when it ends
        if retry:
            return Result(requeue_after=max(0.05, float(retry)))
        if action.kind == "update":
            return Result(requeue_after=0.01)  # applied in place: it may also need a load
        return _DONE

    async def act(self, action: Action) -> None:
        manager, name = self.manager, action.slot
        want = self.snapshot.slots.get(name)
        if action.kind == "delete":
            if manager.known(name) is not None:
                await manager.remove(name)
            return
        if want is None:
            return
        if action.kind == "recreate":
            manager.upsert(want)
            decision = await manager.roll_out(name, want)
            if decision.surge:
                return  # the new server serves; the old one drained and stopped
            with manager.recreating(name, decision.reason):  # the slot's view shows it
                await manager.unload(
                    name,
                    force=True,
                    clear_residency=False,
                    reason=f"recreate: {action.reason}",
                    op=Op.RECONCILE,
                )
                manager.upsert(want)
                if want.autoload or manager.is_resident(name):
                    await manager.load(name, resident=False, background=True)
            return
        manager.upsert(want)
        if action.kind == "load" or (action.kind == "create" and want.autoload):
            await manager.load(name, resident=False, background=True)

    # ---------------------------------------------------------------- the queue

    def enqueue(self, name: str, after: float = 0.0) -> None:
        self.queue.add_after(name, after) if after > 0 else self.queue.add(name)

    def enqueue_all(self) -> None:
        """The resync's event: every slot, declared or known to the manager."""
        self.queue.add_all(self.all_names())

    async def _worker(self) -> None:
        while True:
            try:
                name = await self.queue.get()
            except QueueShutDown:
                return
            try:
                await self._run_one(name)
            except Exception:  # a bug outside the pass (an observer): the worker lives on
                log.exception("reconcile worker: unexpected error around %s", name)
            finally:
                self.queue.done(name)
            await self._take_turn()

    async def _take_turn(self) -> None:
        """Wait for the next slice of the loop once the passes used :data:`SLICE_S` of
        this one: the gate opens at the loop's next iteration, after its I/O is polled."""
        while time.perf_counter() - self._slice_began >= SLICE_S:
            gate = self._gate
            if gate is None or gate.done():
                loop = asyncio.get_running_loop()
                gate = self._gate = loop.create_future()
                loop.call_soon(self._open_gate, gate)
            await asyncio.shield(gate)  # a cancelled worker leaves the gate to the others

    def _open_gate(self, gate: asyncio.Future[None]) -> None:
        self._slice_began = time.perf_counter()
        if not gate.done():
            gate.set_result(None)

    async def _run_one(self, name: str) -> None:
        started = time.perf_counter()
        outcome: Result | BaseException
        try:
            outcome = await self.reconcile(name)
        except SlotctlError as exc:
            outcome = exc
        except Exception as exc:  # one broken slot must not stop the rest; it is retried
            log.exception("reconcile %s: unexpected error", name)
            outcome = exc
        self.passes += 1
        requeue = requeue_for(outcome)  # the one outcome -> queue mapping
        delay = requeue.delay(self.queue.retries(name))
        if requeue.forget:
            self.queue.forget(name)
        if requeue.after is not None:
            self.queue.add_after(name, requeue.after)
        elif requeue.backoff is not None:
            self.queue.add_rate_limited(name, requeue.backoff)
        if isinstance(outcome, BaseException):
            message = getattr(outcome, "message", str(outcome))
            self.errors[name] = message
            self._report(name, outcome, message, delay)
        else:
            self.errors.pop(name, None)
            self._said_plan.pop(name, None)
            self._said_error.pop(name, None)
        took = time.perf_counter() - started
        log.debug("reconcile %s took %.1f ms", name, took * 1000)
        for observe in self.pass_observers:
            observe(name, took, not isinstance(outcome, BaseException))

    def _report(self, name: str, error: BaseException, message: str, delay: float | None) -> None:
        """One error event per distinct failure; a slot waiting for memory is no error (the
        manager said once that it waits)."""
        if isinstance(error, InsufficientMemory) and error.details.get("waiting"):
            log.debug("reconcile %s: waiting for memory", name)
            return
        code = getattr(error, "code", "internal")
        said = (code, message)
        if self._said_error.get(name) == said:
            log.debug("reconcile %s: %s (again)", name, message)
            return
        self._said_error[name] = said
        self.manager.events.emit(
            EventKind.ERROR,
            Op.RECONCILE,
            slot=name,
            message=message,
            error=code,
            # said already (a failed load's transition to error carries it): counted as
            # a failed pass, not printed again by `up` (issue 40)
            details={"retry_in_s": delay, "said": bool(getattr(error, "reported", False))},
        )

    async def run(self, stop: asyncio.Event, *, read_first: bool = True) -> None:
        """Workers plus a periodic resync; also follows manager events (evictions, faults).

        A worker or the follower that ends (they never return) ends ``run`` with an error,
        so the daemon's supervisor reports it and restarts the reconciler whole.
        ``read_first=False``: the caller has just read the config dir and queued every
        slot, so the first resync (a read of every file) waits for the period.
        """
        workers = [asyncio.create_task(self._worker()) for _ in range(self.workers)]
        follower = asyncio.create_task(
            follow_manager(self.manager, lambda: self.desired.snapshot.slots, self.queue)
        )
        room = asyncio.create_task(watch_room(self.manager, self.queue, stop))
        stopping = asyncio.create_task(stop.wait())
        try:
            fresh = not read_first
            while not stop.is_set():
                try:
                    if not fresh:  # the periodic resync: read everything, queue everything
                        await self.refresh_async()
                        self.enqueue_all()
                    fresh = False
                    await self.reap_orphans()
                except Exception:  # a failed resync (I/O, engine) is retried next period
                    log.exception("resync failed; retrying in %.0fs", self.resync_s)
                done, _ = await asyncio.wait(
                    {stopping, follower, *workers},
                    timeout=self.resync_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                ended = [t for t in done if t is not stopping]
                if ended:
                    error = None if ended[0].cancelled() else ended[0].exception()
                    raise RuntimeError(f"a reconciler task ended: {error!r}") from error
        finally:
            stopping.cancel()
            for task in [*workers, follower, room]:
                task.cancel()
            # Their outcomes (a crashed one's error is raised above) are collected, not raised.
            await asyncio.gather(stopping, *workers, follower, room, return_exceptions=True)
            self.queue.cancel_delayed()  # a restarted loop (the supervisor's) looks again anyway

    async def reap_orphans(self) -> list[str]:
        """Stop managed runtime objects that no slot declares any more."""
        reaped: list[str] = []
        if not self.reap or not self.desired.synced:
            return reaped
        for observed in await self.manager.runtime.list_managed():
            if observed.slot in self.snapshot.slots or self.manager.known(observed.slot):
                continue
            if observed.slot in self.broken:  # declared by a file that is invalid right now
                continue
            with contextlib.suppress(SlotctlError):
                if await self.manager.reap_orphan(observed.slot):
                    reaped.append(observed.slot)
        return reaped

    async def wait_idle(self) -> None:
        await self.queue.wait_idle()

    async def converge(self, *, timeout: float, poll_s: float = 0.2) -> bool:
        """For ``apply --once``: reconcile until every slot plans ``noop`` (or time out)."""
        # Read the desired state (and hand the catalogue to the manager) before the first
        # look: until then every slot plans a no-op ("model not in the catalogue") and
        # a look that came before run()'s own first read would call it converged.
        await self.refresh_async()
        self.enqueue_all()
        stop = asyncio.Event()
        runner = asyncio.create_task(self.run(stop, read_first=False))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(poll_s)
                if self.queue.idle and not self.queue.delayed:
                    if all(self.plan(n).kind == "noop" for n in self.all_names()):
                        return True
                    self.enqueue_all()
            return False
        finally:
            stop.set()
            await runner
