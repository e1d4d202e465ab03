"""The dry run of a load as JSON: the wire shape of ``POST /api/slots/{name}/load?dry_run``.

Beside :mod:`.rest` (below the route modules: :mod:`.routes` answers the dry run with it).
The manager returns a typed :class:`~controller.slots.dryrun.LoadPlan`; :func:`plan_json`
renders it, and the ``TypedDict`` s here declare that JSON once: the CLI, which reads it
from a controller's API and prints it as text (``slotctl slot load --dry-run``:
:mod:`controller.cli.remote`), types its reading with them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, TypedDict

from controller.slots.dryrun import LoadPlan, PlanTarget, PlanVictim, UnitPlan
from controller.slots.records import FootprintView

__all__ = [
    "DeviceJson",
    "PlanJson",
    "PullJson",
    "ReloadJson",
    "TogetherJson",
    "UnitJson",
    "VictimJson",
    "plan_json",
]


class ReloadJson(TypedDict, total=False):
    load_s: float
    wake_s: float
    measured: dict[str, Any]  # the moving averages as state.json holds them


class VictimJson(TypedDict):
    slot: str
    action: str  # sleep | unload
    level: int
    priority: int
    idle_s: float
    bytes: int
    devices: list[str]
    host: str | None
    host_bytes: int
    load_s: float
    wake_s: float
    score: float
    reason: str


class DeviceJson(TypedDict):
    device: str
    needed_bytes: int
    free_bytes: int
    budget_bytes: int
    admitted_bytes: int
    probe: str
    evict: list[str]


class TogetherJson(TypedDict):
    devices: list[str]
    where: str
    fits: bool
    evict: list[str]


class UnitJson(TypedDict, total=False):
    name: str
    members: list[PlanJson]
    action: str
    order: list[str]
    evict: list[str]
    failed: str


class PullJson(TypedDict, total=False):
    """The model files a load would pull first (``slotctl slot load --dry-run``)."""

    action: str  # pull | verify | missing
    source: str
    path: str | None
    bytes: int | None
    bytes_total: int | None
    message: str  # "would pull 4.1 GB from hf://…"
    error: dict[str, Any]  # a resolution that failed now: the pull would fail so
    in_flight: bool


class PlanJson(TypedDict, total=False):
    """One slot's dry run. ``action`` ``none``: ``slot``, ``action`` and ``reason`` only;
    otherwise ``wake``, ``reload``, where it would go (``device`` ... ``placement``, absent
    when it is refused before a placement), then ``error`` (a refusal) or ``evict`` and
    ``freed``; a unit member's ``together``; a unit's ``unit``; the model files it would
    pull first, ``pull``."""

    slot: str
    action: str  # none | load | evict-then-load | refuse
    reason: str
    wake: bool
    fallback: str
    reload: ReloadJson
    device: str
    devices: list[str]
    needed_bytes: int
    free_bytes: int
    budget_bytes: int
    admitted_bytes: int
    probe: str
    exclusive_peers: list[str]
    placement: list[DeviceJson]
    error: dict[str, Any]  # the typed error's body: code, message, its details
    evict: list[VictimJson]
    freed: dict[str, int]
    together: TogetherJson
    unit: UnitJson
    pull: PullJson
    adapters: dict[str, Any]  # its LoRA adapters: api, places, reserved_bytes, serves, reapply
    footprint: dict[str, Any]  # what it would hold, part by part (footprint_json)


def footprint_json(view: FootprintView) -> dict[str, Any]:
    """A slot's footprint as the API answers it (``/api/models/{id}/footprint``, the dry
    run's ``footprint``): every field of the view, tuples as lists."""
    out = asdict(view)
    out["notes"] = list(view.notes)
    return out


def plan_json(plan: LoadPlan) -> PlanJson:
    """``plan`` as the API answers it (the CLI's text is made from this)."""
    out: PlanJson = {"slot": plan.slot}
    if plan.reload is None:  # nothing to do
        out["action"] = plan.action
        out["reason"] = plan.reason or ""
    else:
        out["wake"] = plan.wake
        if plan.fallback:
            out["fallback"] = plan.fallback
        reload: ReloadJson = {"load_s": plan.reload.load_s, "wake_s": plan.reload.wake_s}
        if plan.reload.measured is not None:
            reload["measured"] = plan.reload.measured.model_dump(mode="json")
        out["reload"] = reload
        if plan.target is not None:
            _target(out, plan.target)
        out["action"] = plan.action
        if plan.refusal is not None:
            out["error"] = plan.refusal.error.to_dict()["error"]
        else:
            out["evict"] = [_victim(v) for v in plan.victims]
            out["freed"] = dict(plan.freed)
        if plan.reason is not None:
            out["reason"] = plan.reason
    if plan.together is not None:
        t = plan.together
        out["together"] = {
            "devices": list(t.devices),
            "where": t.where,
            "fits": t.fits,
            "evict": list(t.evict),
        }
    if plan.unit is not None:
        out["unit"] = _unit(plan.unit)
    if plan.pull is not None:
        p = plan.pull
        pull: PullJson = {
            "action": p.action,
            "source": p.source,
            "path": p.path,
            "bytes": p.bytes,
            "bytes_total": p.bytes_total,
            "message": p.message,
            "in_flight": p.in_flight,
        }
        if p.error is not None:
            pull["error"] = p.error
        out["pull"] = pull
    if plan.adapters is not None:
        a = plan.adapters
        out["adapters"] = {
            "api": a.api,
            "places": a.places,
            "reserved_bytes": a.reserved_bytes,
            "serves": list(a.serves),
            "reapply": list(a.reapply),
        }
    if plan.footprint is not None:
        out["footprint"] = footprint_json(plan.footprint)
    return out


def _target(out: PlanJson, t: PlanTarget) -> None:
    out["device"] = t.device
    out["devices"] = list(t.devices)
    out["needed_bytes"] = t.needed_bytes
    out["free_bytes"] = t.free_bytes
    out["budget_bytes"] = t.budget_bytes
    out["admitted_bytes"] = t.admitted_bytes
    out["probe"] = t.probe
    out["exclusive_peers"] = list(t.exclusive_peers)
    out["placement"] = [
        {
            "device": d.device,
            "needed_bytes": d.needed_bytes,
            "free_bytes": d.free_bytes,
            "budget_bytes": d.budget_bytes,
            "admitted_bytes": d.admitted_bytes,
            "probe": d.probe,
            "evict": list(d.evict),
        }
        for d in t.placement
    ]


def _victim(v: PlanVictim) -> VictimJson:
    return {
        "slot": v.slot,
        "action": v.action,
        "level": v.level,
        "priority": v.priority,
        "idle_s": v.idle_s,
        "bytes": v.bytes,
        "devices": list(v.devices),
        "host": v.host,
        "host_bytes": v.host_bytes,
        "load_s": v.load_s,
        "wake_s": v.wake_s,
        "score": v.score,
        "reason": v.reason,
    }


def _unit(u: UnitPlan) -> UnitJson:
    out: UnitJson = {
        "name": u.name,
        "members": [plan_json(m) for m in u.members],
        "action": u.action,
    }
    if u.order is not None:
        out["order"] = list(u.order)
    if u.evict is not None:
        out["evict"] = list(u.evict)
    if u.failed is not None:
        out["failed"] = u.failed
    return out
