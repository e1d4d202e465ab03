"""The plan, pure: desired, applied and observed state of a slot in, one action out.

``plan_slot`` is what the reconciler (:mod:`controller.reconcile.reconciler`), ``stack diff`` and
``stack apply`` all run, so ``diff`` prints exactly the plan ``apply`` and the daemon
execute. :func:`requeue_for` is the one mapping from a pass's outcome to what the work
queue (:mod:`controller.reconcile.queue`) does with its key: forget its backoff, look
again after a delay, or retry rate-limited. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from controller.model.errors import (
    InsufficientMemory,
    SlotConfigError,
    SlotCrashLooping,
    StateWriteFailed,
)
from controller.model.lifecycle import SlotState, can_dispatch
from controller.reconcile.queue import Backoff
from controller.scheduling.rollout import RolloutDecision
from controller.spec.loader import DesiredSlot
from controller.spec.schema import SlotSpec

__all__ = [
    "ACTION_KINDS",
    "SCHEDULING_KEYS",
    "Action",
    "ObservedSlot",
    "Requeue",
    "Result",
    "plan_slot",
    "plans_for",
    "requeue_delay",
    "requeue_for",
    "spec_changes",
    "with_rollout",
]


# Keys that change how a slot is scheduled, never how its server runs: applied in place.
SCHEDULING_KEYS: Final = frozenset(
    {
        "priority",
        "pinned",
        "autoload",
        "idle_timeout_s",
        "ttl_s",
        "warmup_timeout_s",
        "drain_timeout_s",
        "liveness_interval_s",
        "liveness_failures",
        "liveness_timeout_s",
        "upstream_idle_s",
        "max_consecutive_failures",
        "max_queue",
        "memory_gb",
        "sleep_level",
        "wake_timeout_s",
        "unit",  # co-loaded units (controller/spec/units.py): who loads with whom
        "rollout",
    }
)
ACTION_KINDS: Final = ("create", "recreate", "load", "unload", "update", "delete", "adopt", "noop")


@dataclass(frozen=True, slots=True)
class Action:
    kind: str
    slot: str
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def shown_kind(self) -> str:
        """The kind as a person reads it: a ``recreate`` that rolls out by surge (the old
        server serves until the new one is ready) is shown as ``surge``."""
        if self.kind == "recreate" and self.details.get("rollout") == "surge":
            return "surge"
        return self.kind


@dataclass(frozen=True, slots=True)
class ObservedSlot:
    """What is known of a slot at run time (from the manager or from files + runtime)."""

    name: str
    state: SlotState | None = None  # None: never seen
    idle_reason: str | None = None
    running: bool = False  # a managed server object exists and runs
    config_hash: str | None = None  # of the running server
    message: str = ""
    blocked: bool = False  # crash-loop breaker holds it
    retry_after_s: float = 0.0
    waiting: str | None = None  # a background load waits for memory
    paused: bool = False  # an autoload slot a user unloaded (until a user's load)

    @property
    def dispatchable(self) -> bool:
        return self.state is not None and can_dispatch(self.state, self.idle_reason)


@dataclass(frozen=True, slots=True)
class Result:
    """What a reconcile pass asks of the queue: nothing, or to look again after a delay."""

    requeue_after: float | None = None


def spec_changes(have: SlotSpec, want: SlotSpec) -> list[tuple[str, Any, Any]]:
    """Top-level keys whose effective values differ, as (key, old, new)."""
    if have is want or have == want:  # the usual pass: nothing to dump (pydantic's == is
        return []  # a field-by-field comparison; the dumps below cost twice that)
    old = have.model_dump(mode="json")
    new = want.model_dump(mode="json")
    return [(k, old.get(k), new.get(k)) for k in new if old.get(k) != new.get(k)]


def _fmt(changes: Iterable[tuple[str, Any, Any]]) -> str:
    parts = []
    for key, old, new in changes:
        if isinstance(old, dict | list) or isinstance(new, dict | list):
            parts.append(f"{key} changed")
        else:
            parts.append(f"{key} {_word(old)} -> {_word(new)}")
    return ", ".join(parts)


def _word(value: Any) -> str:
    """A key's value in a plan line: an absent one is ``unset`` (never Python's None)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def plan_slot(
    name: str,
    want: DesiredSlot | None,
    have: SlotSpec | None,
    obs: ObservedSlot | None,
    *,
    want_hash: str | None,
    resident: bool = False,
    may_delete: bool = True,
    group_holder: str | None = None,
) -> Action:
    """The next action for one slot, with its reason. Pure.

    ``group_holder``: another slot that holds this slot's exclusive group right now; an
    autoload slot does not preempt it (two autoload members would swap each other out
    forever) and comes back once the group is free.
    """
    running = obs is not None and obs.running
    if want is None:
        if (have is not None or running) and may_delete:
            return Action("delete", name, "no longer declared: unload and remove")
        return Action("noop", name, "not declared here")
    if have is None:
        load = want.autoload
        return Action(
            "create", name, "new slot" + (" (autoload: will load)" if load else ""), {"load": load}
        )
    changes = spec_changes(have, want.spec)
    runtime_changes = [c for c in changes if c[0] not in SCHEDULING_KEYS]
    drifted = obs is not None and obs.config_hash is not None and obs.config_hash != want_hash
    if running and want_hash is not None and drifted:
        assert obs is not None
        why = _fmt(runtime_changes) or "running server differs from the declared config"
        return Action(
            "recreate",
            name,
            f"config hash {obs.config_hash} -> {want_hash}: {why}",
            {"from": obs.config_hash, "to": want_hash},
        )
    if changes:
        return Action(
            "update",
            name,
            f"in place, no restart: {_fmt(changes)}",
            {"keys": [c[0] for c in changes]},
        )
    paused = obs is not None and obs.paused
    wants_loaded = (want.autoload and not paused) or resident
    if want.autoload and paused and not resident and not (obs is not None and obs.dispatchable):
        return Action(
            "noop",
            name,
            f"autoload paused by `slotctl slot unload`: `slotctl slot load {name}` resumes it",
            {"paused": True},
        )
    if wants_loaded and want.spec.activated and not (obs is not None and obs.dispatchable):
        if obs is not None and obs.blocked:
            if obs.retry_after_s <= 0:
                return Action(
                    "noop",
                    name,
                    "crash-looping: blocked until its config changes or `slotctl slot reset`",
                )
            return Action(
                "noop",
                name,
                f"crash-looping: next attempt in {obs.retry_after_s:.0f}s "
                "(`slotctl slot reset` retries now)",
                {"retry_after_s": obs.retry_after_s},
            )
        if group_holder is not None:
            return Action("noop", name, f"waiting: {group_holder} holds the exclusive group")
        if obs is not None and obs.state is SlotState.IDLE and obs.idle_reason == "no_model":
            return Action(
                "noop",
                name,
                "the server is up but serves no model (check the model file, then "
                "`slotctl slot unload` and load again)",
            )
        state = obs.state.value if obs is not None and obs.state else "offline"
        if obs is not None and obs.idle_reason == "asleep":
            state += " (asleep: a load wakes it)"
        if obs is not None and obs.waiting:
            state += (
                ", waiting for its GPU"
                if obs.waiting == "waiting_for_device"
                else ", waiting for memory"
            )
        why = "autoload" if want.autoload else "resident"
        return Action("load", name, f"{why} and {state}")
    return Action("noop", name, "in sync")


def with_rollout(action: Action, decision: RolloutDecision | None) -> Action:
    """A ``recreate`` with the way it will roll out (surge or recreate, and why)."""
    if action.kind != "recreate" or decision is None:
        return action
    details = {**action.details, **decision.to_dict()}
    return Action(action.kind, action.slot, f"{action.reason}; {decision.text}", details)


@dataclass(frozen=True, slots=True)
class Requeue:
    """What the work queue does with a key after a pass (:func:`requeue_for`)."""

    forget: bool  # reset the key's backoff: the pass succeeded, or nothing will retry it
    after: float | None = None  # look again after this long (a requeue, not a retry)
    backoff: Backoff | None = None  # a failure: retry after the key's next backoff step

    def delay(self, retries: int) -> float | None:
        """Seconds until the next pass, the key having had ``retries`` (None: none)."""
        if self.after is not None:
            return self.after
        return self.backoff.delay(retries) if self.backoff is not None else None


_DONE: Final = Requeue(forget=True)
_WAIT: Final = Requeue(forget=False)  # woken by an event (memory came back), not by time
_MEMORY: Final = Backoff(base=2.0, cap=60.0)  # memory may come back
_OTHER: Final = Backoff(base=1.0, cap=300.0)


def requeue_for(outcome: Result | BaseException) -> Requeue:
    """The one mapping from a reconcile outcome to a queue decision."""
    if isinstance(outcome, Result):
        return _DONE if outcome.requeue_after is None else Requeue(True, outcome.requeue_after)
    if isinstance(outcome, SlotCrashLooping):
        return Requeue(False, max(0.5, outcome.retry_after_s))  # when the breaker lets go
    if isinstance(outcome, SlotConfigError):
        return _DONE  # terminal: only a config change (which requeues) can fix it
    if isinstance(outcome, InsufficientMemory):
        return _WAIT if outcome.details.get("waiting") else Requeue(False, backoff=_MEMORY)
    if isinstance(outcome, StateWriteFailed):  # disk space: up to 8 times the error's hint
        base = outcome.retry_after_s
        return Requeue(False, backoff=Backoff(base=base, cap=min(30.0, base * 8)))
    return Requeue(False, backoff=_OTHER)


def requeue_delay(outcome: Result | BaseException, failures: int) -> float | None:
    """Seconds until the next pass after ``outcome``, the key having failed ``failures``
    times in a row (None: no pass is scheduled): :func:`requeue_for`'s delay."""
    return requeue_for(outcome).delay(failures)


def plans_for(
    names: Iterable[str],
    want: Mapping[str, DesiredSlot],
    have: Mapping[str, SlotSpec],
    observed: Mapping[str, ObservedSlot],
    hashes: Mapping[str, str | None],
    *,
    residents: Iterable[str] = (),
    deletable: Callable[[str], bool] = lambda name: True,
) -> list[Action]:
    """Plan many slots at once (for ``stack apply``/``stack diff``)."""
    resident = set(residents)
    return [
        plan_slot(
            name,
            want.get(name),
            have.get(name),
            observed.get(name),
            want_hash=hashes.get(name),
            resident=name in resident,
            may_delete=deletable(name),
        )
        for name in names
    ]
