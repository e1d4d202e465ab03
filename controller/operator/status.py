"""CR status from observed state (pure): conditions, state, model, endpoint, memory, error.

The operator's status sink calls these with the SlotManager's :class:`SlotView` (what the
controller observes, level-triggered) and the source's verdict on the CR (what the loader
said about its spec). Conditions follow the Kubernetes API conventions: ``Ready``,
``Progressing`` and ``Degraded``, each with ``observedGeneration``, a CamelCase ``reason``,
a ``message`` and a ``lastTransitionTime`` that moves only when ``status`` flips.
:class:`Written` remembers the sink's recent patches while kopf's view of an object lags
behind them (no I/O either: the sink passes the clock).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from controller.model.lifecycle import SlotState
from controller.operator.bodies import (
    Condition,
    CrKey,
    LastError,
    ModelStatus,
    ReplicasStatus,
    ReplicaStatus,
    RolloutStatus,
    SlotStatus,
)
from controller.spec.problems import Problem

__all__ = [
    "Verdict",
    "Written",
    "changed_fields",
    "condition",
    "model_status",
    "old_conditions",
    "reason_of",
    "replicas_status",
    "rollout_status",
    "slot_reason",
    "slot_status",
]

_GIB: Final = 1024**3
_PROGRESSING: Final = frozenset(
    {SlotState.PULLING, SlotState.STARTING, SlotState.WARMING, SlotState.UNLOADING}
)
_ADMITTED: Final = frozenset(
    {
        SlotState.PULLING,
        SlotState.STARTING,
        SlotState.WARMING,
        SlotState.READY,
        SlotState.SERVING,
        SlotState.IDLE,
        SlotState.UNLOADING,
    }
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the source made of one CR's spec at its last sync."""

    generation: int = 0
    problems: tuple[Problem, ...] = ()
    accepted: bool = False  # the slot (its current or its last good spec) is desired
    current: bool = False  # the CR's current spec is the one in force


@dataclass(frozen=True, slots=True)
class Observed:
    """The slice of a SlotView the status needs (kept here so this module stays pure)."""

    state: SlotState
    idle_reason: str | None = None
    model: str = ""
    endpoint: str | None = None
    device: str = "gpu"
    memory_bytes: int = 0
    message: str = ""
    dispatchable: bool = False
    last_error: tuple[str, str] | None = None
    extra: dict[str, object] = field(default_factory=dict)
    node: str | None = None  # kubernetes runtime
    waiting: str | None = None  # waiting_for_memory | waiting_for_device
    rollout: RolloutStatus | None = None  # in flight, else the last one decided


def rollout_status(
    strategy: str, phase: str, reason: str, message: str = "", since: str = ""
) -> RolloutStatus:
    """A Slot's ``status.rollout``: the way (``surge``/``recreate``), its phase (a
    surge's ``starting``, ``switched``, ``failed``; a recreate's ``stopping``,
    ``starting``; ``done`` once over) and why that way."""
    out: RolloutStatus = {"strategy": strategy, "phase": phase, "reason": reason}
    if message:
        out["message"] = message
    if since:
        out["since"] = since
    return out


# A failed server's words that say more than its error code (the kubernetes runtime's
# container and scheduler verdicts), as ``kubectl get pods`` shows them.
_REASONS: Final = (
    ("CrashLoopBackOff", "CrashLoopBackOff"),
    ("ImagePullBackOff", "ImagePullBackOff"),
    ("ErrImagePull", "ErrImagePull"),
    ("InvalidImageName", "InvalidImageName"),
    ("unschedulable", "Unschedulable"),
    ("pod Pending", "Unschedulable"),
    ("is lost", "NodeLost"),
)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def reason_of(text: str) -> str:
    """``slot.hardware_flag`` / ``warming`` -> ``SlotHardwareFlag`` / ``Warming``."""
    parts = [p for p in "".join(c if c.isalnum() else " " for c in text).split() if p]
    out = "".join(p[:1].upper() + p[1:] for p in parts)
    return out if out[:1].isalpha() else "Unknown"


def slot_reason(observed: Observed | None, verdict: Verdict) -> str:
    """One word for why a Slot is not as it should be (the ``REASON`` column, as
    ``kubectl get pods`` shows ``CrashLoopBackOff``); empty when nothing is amiss."""
    if verdict.problems:
        return "InvalidSpec"
    if observed is None:
        return ""
    if observed.waiting:
        return reason_of(observed.waiting)  # WaitingForMemory, WaitingForDevice
    busy = observed.state in (SlotState.PULLING, SlotState.STARTING)
    if observed.state is SlotState.ERROR or busy:
        found = next((r for words, r in _REASONS if words in observed.message), None)
        if found is not None:
            return found
    if observed.state is SlotState.ERROR:
        code = observed.last_error[0] if observed.last_error else ""
        return reason_of(code) if code else "ServerError"
    return ""


def condition(
    kind: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    old: Sequence[Mapping[str, object]] | None,
    now: str | None = None,
) -> Condition:
    value = "True" if status else "False"
    previous = next((c for c in old or () if c.get("type") == kind), None)
    kept = (
        previous.get("lastTransitionTime")
        if previous is not None and previous.get("status") == value
        else None
    )
    since = kept if isinstance(kept, str) else None
    return {
        "type": kind,
        "status": value,
        "observedGeneration": generation,
        "lastTransitionTime": since or now or _now(),
        "reason": reason,
        "message": message[:32768],
    }


def old_conditions(old: Mapping[str, object]) -> Sequence[Mapping[str, object]] | None:
    """The conditions of a status as read back (None: none, or not a list of objects)."""
    found = old.get("conditions")
    if not isinstance(found, list):
        return None
    return [c for c in found if isinstance(c, Mapping)]


def _problem_text(problems: Sequence[Problem]) -> str:
    return "; ".join(
        f"[{p.code}] {p.key + ': ' if p.key and p.key not in p.message else ''}{p.message}"
        for p in problems
    )


def replicas_status(
    low: int, high: int, members: Sequence[tuple[str, int, Observed | None]]
) -> ReplicasStatus:
    """A Slot's replicas summed up: ``members`` (name, index, what is observed; None:
    not known to the controller yet) in index order, between ``low`` and ``high``."""
    items: list[ReplicaStatus] = []
    for name, index, seen in sorted(members, key=lambda m: m[1]):
        item: ReplicaStatus = {
            "name": name,
            "index": index,
            "state": "pending" if seen is None else seen.state.value,
            "ready": seen is not None and seen.dispatchable,
            "endpoint": None if seen is None else seen.endpoint,
        }
        if seen is not None and seen.node is not None:
            item["node"] = seen.node
        items.append(item)
    states = [m[2] for m in members if m[2] is not None]
    return {
        "min": low,
        "max": high,
        "running": sum(1 for o in states if o.state in _ADMITTED),
        "ready": sum(1 for o in states if o.dispatchable),
        "items": items,
    }


def slot_status(
    observed: Observed | None,
    verdict: Verdict,
    old: Mapping[str, object] | None,
    now: str | None = None,
    replicas: ReplicasStatus | None = None,
) -> SlotStatus:
    """The whole ``status`` of a Slot (``replicas``: its replicas summed up, for a slot
    that has them)."""
    conditions = old_conditions(old or {})
    gen = verdict.generation
    if observed is None:
        state = "invalid" if verdict.problems and not verdict.accepted else "pending"
        ready = (False, reason_of(state), "not started by the controller yet")
        progressing = (verdict.accepted, "Pending", "waiting for the controller")
    else:
        state = observed.state.value
        shown = state if observed.idle_reason is None else f"{state} ({observed.idle_reason})"
        ready = (
            observed.dispatchable,
            reason_of(state),
            observed.message
            or f"{shown}"
            + (f" at {observed.endpoint}" if observed.endpoint and observed.dispatchable else ""),
        )
        busy = observed.state in _PROGRESSING
        progressing = (busy, reason_of(state) if busy else "Stable", observed.message or shown)
        rollout = observed.rollout
        if rollout is not None and rollout.get("phase") not in ("done", "failed"):
            way = rollout.get("strategy", "")
            words = f"{way} rollout ({rollout.get('phase', '')}): {rollout.get('reason', '')}"
            progressing = (True, reason_of(f"rollout {way}"), words)
    if verdict.problems:
        kept = " (the last good spec stays in force)" if verdict.accepted else ""
        degraded = (True, "InvalidSpec", _problem_text(verdict.problems) + kept)
    elif observed is not None and observed.state is SlotState.ERROR:
        degraded = (True, "ServerError", observed.message or "the server failed")
    else:
        degraded = (False, "AsExpected", "")
    status: SlotStatus = {
        "observedGeneration": gen,
        "state": state,
        "reason": slot_reason(observed, verdict),
        "conditions": [
            condition("Ready", *ready, gen, conditions, now),
            condition("Progressing", *progressing, gen, conditions, now),
            condition("Degraded", *degraded, gen, conditions, now),
        ],
    }
    if observed is not None:
        status["idleReason"] = observed.idle_reason
        status["model"] = observed.model
        status["endpoint"] = observed.endpoint
        if observed.node is not None:
            status["node"] = observed.node
        status["memory"] = {
            "device": observed.device,
            "gb": round(observed.memory_bytes / _GIB, 3),
            "admitted": observed.state in _ADMITTED,
        }
        if observed.rollout is not None:
            status["rollout"] = observed.rollout
    error = _last_error(observed, verdict)
    if error is not None:
        status["lastError"] = error
    if replicas is not None:
        status["replicas"] = replicas
    return status


def _last_error(observed: Observed | None, verdict: Verdict) -> LastError | None:
    if verdict.problems:
        first = verdict.problems[0]
        return {"code": first.code, "message": _problem_text(verdict.problems)}
    if observed is not None and observed.last_error is not None:
        code, message = observed.last_error
        return {"code": code, "message": message}
    return None


def model_status(
    model_id: str | None,
    verdict: Verdict,
    slots: Mapping[str, SlotState],
    old: Mapping[str, object] | None,
    now: str | None = None,
) -> ModelStatus:
    """The whole ``status`` of a Model: accepted into the catalogue, and where it is loaded."""
    conditions = old_conditions(old or {})
    gen = verdict.generation
    loaded = sorted(n for n, s in slots.items() if s in _ADMITTED)
    if verdict.accepted:
        ready = (True, "InCatalogue", f"model {model_id} is in the catalogue")
    else:
        ready = (False, "Invalid", "not in the catalogue")
    if verdict.problems:
        degraded = (True, "InvalidSpec", _problem_text(verdict.problems))
    else:
        degraded = (False, "AsExpected", "")
    status: ModelStatus = {
        "observedGeneration": gen,
        "id": model_id or "",
        "state": "loaded" if loaded else "unloaded",
        "slots": sorted(slots),
        "conditions": [
            condition("Ready", *ready, gen, conditions, now),
            condition("Progressing", False, "Stable", "", gen, conditions, now),
            condition("Degraded", *degraded, gen, conditions, now),
        ],
    }
    if verdict.problems:
        first = verdict.problems[0]
        status["lastError"] = {"code": first.code, "message": _problem_text(verdict.problems)}
    return status


def changed_fields(
    new: Mapping[str, object], old: Mapping[str, object] | None
) -> dict[str, object]:
    """The top-level status keys whose value differs (a merge patch sends only these)."""
    old = old or {}
    return {k: v for k, v in new.items() if old.get(k) != v}


class Written:
    """What the sink patched into each CR's ``status`` lately, for as long as kopf's view of
    the object may not show it yet.

    kopf hands a status timer its live body, replaced when the watch event is *processed*:
    on a loaded API server or a busy operator that is seconds after the patch, and a timer
    woken meanwhile (by any slot's event) compared against the older status, re-wrote
    fields that had not changed, a ``Ready`` condition that stayed ``True`` included, with a
    new ``lastTransitionTime`` (a 200-Slot run: ~10 patches a Slot, ~2 needed). The fields
    written are believed over the body's until the body shows them all, or for
    ``trust_s`` (a lost patch, a status changed by someone else: the body wins again).
    """

    def __init__(self, trust_s: float) -> None:
        self.trust_s = trust_s
        self._fields: dict[CrKey, tuple[float, dict[str, object]]] = {}

    def believed(
        self, key: CrKey, status: Mapping[str, object], now: float
    ) -> Mapping[str, object]:
        """``status`` as the body shows it, with this sink's newer writes over it."""
        entry = self._fields.get(key)
        if entry is None:
            return status
        at, fields = entry
        if now - at > self.trust_s or all(status.get(k) == v for k, v in fields.items()):
            del self._fields[key]  # the body caught up (or is the truth again)
            return status
        return {**status, **fields}

    def wrote(self, key: CrKey, fields: Mapping[str, object], now: float) -> None:
        if fields:
            _, before = self._fields.get(key, (now, {}))
            self._fields[key] = (now, {**before, **fields})

    def forget(self, key: CrKey) -> None:
        self._fields.pop(key, None)
