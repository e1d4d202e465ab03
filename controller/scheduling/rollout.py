"""Which way a changed slot rolls out: surge (beside the old server) or recreate. Pure.

Called by the slot manager (:mod:`controller.slots.surge`) right before a rollout, and by
every planner that shows it (the reconciler's plan, ``stack apply --dry-run``,
``stack diff``, the dashboard), so what is shown is what is done. A surge starts the new
server on a fresh port while the old one keeps serving (a Deployment's ``maxSurge: 1,
maxUnavailable: 0`` on one box); it needs:

    rollout = "surge" (the default)          else  recreate: rollout = "recreate"
    a server running now                      else  a plain start (nothing to keep serving)
    a runtime that can run two at once        else  recreate: the runtime's reason
    no declared port (two cannot share one)   else  recreate: port N is declared
    room for the new one beside the old one   else  recreate: no room to surge, needs X, Y free

The room is the load decision (:func:`controller.scheduling.decision.decide_load`) taken with the
old server's memory still counted and no eviction: a surge never evicts another slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from controller.model.sizes import format_gib
from controller.scheduling.decision import LoadDecision
from controller.spec.schema import SlotSpec

__all__ = [
    "RECREATE",
    "SURGE",
    "UNDECIDED",
    "RolloutDecision",
    "RolloutView",
    "decide_rollout",
    "shown_rollout",
]

SURGE: Final = "surge"
RECREATE: Final = "recreate"
# A plan made without memory figures (``stack diff`` with no controller running): the
# controller that acts decides (surge if it fits, else recreate).
UNDECIDED: Final = "surge-or-recreate"
_OLD_UP: Final = frozenset({"ready", "serving", "idle", "unloading"})
Way = Literal["surge", "recreate", "surge-or-recreate"]


@dataclass(frozen=True, slots=True)
class RolloutDecision:
    way: Way
    reason: str

    @property
    def surge(self) -> bool:
        return self.way == SURGE

    @property
    def text(self) -> str:
        """``surge: ...`` or ``recreate: no room to surge, needs 12.00 GiB, 4.00 GiB free``."""
        return f"{self.way}: {self.reason}"

    def to_dict(self) -> dict[str, str]:
        return {"rollout": self.way, "rollout_reason": self.reason}


@dataclass(frozen=True, slots=True)
class RolloutView:
    """A slot's rollout as the API, ``slot show`` and the dashboard see it (``rollout`` of
    a slot's view; None: none in flight). Kept by the manager's rollouts part
    (:mod:`controller.slots.surge`), read by the view.

    ``phase``: a surge's ``starting`` (its new server warms beside the old one),
    ``switched`` (the new one serves; the old one drains), ``failed`` (the new one was
    stopped: the old one keeps serving); a recreate's ``stopping`` (the old server stops)
    then ``starting``. ``server``: the new server's state (a surge: ``starting``,
    ``warming``, ``ready``, ``failed``; a recreate: the slot's own state).
    """

    way: str  # surge | recreate
    phase: str
    reason: str  # why this way (the decision's reason)
    message: str  # the latest step (a surge's new server; a recreate's reason)
    server: str | None = None
    port: int | None = None  # a surge's new server's port
    since: str = ""  # when the rollout began (UTC, ISO 8601)


def shown_rollout(live: RolloutView | None, state: str, failures: int) -> RolloutView | None:
    """What a slot's view says of ``live`` now: a recreate's phase and server follow the
    slot's own state (its only server: ``stopping`` while the old one is up or unloads);
    a failed surge is shown while its failure counts on the slot's breaker (a later
    success or a reset clears it)."""
    if live is None:
        return None
    if live.way == RECREATE:  # the old server stops while the slot's is up, then its own
        phase = "stopping" if state in _OLD_UP else "starting"
        return RolloutView(live.way, phase, live.reason, live.message, state, None, live.since)
    if live.phase == "failed" and failures == 0:
        return None
    return live


def decide_rollout(
    new: SlotSpec,
    *,
    running: bool,
    cannot_surge: str | None,
    load: LoadDecision | None,
    needed: int,
) -> RolloutDecision:
    """The way ``new`` replaces the running server (see the module docstring).

    ``cannot_surge``: the runtime's reason it cannot run a second server of a slot (None:
    it can). ``load``: the decision for the new server with the old one's memory still
    counted, no eviction (None: not asked, e.g. no memory figures where the plan is made).
    ``needed``: the new server's bytes.
    """
    if new.rollout == RECREATE:
        return RolloutDecision(RECREATE, 'rollout = "recreate"')
    if not running:
        return RolloutDecision(RECREATE, "no server runs: nothing to keep serving")
    if cannot_surge is not None:
        return RolloutDecision(RECREATE, cannot_surge)
    if new.port is not None:
        return RolloutDecision(
            RECREATE, f"port {new.port} is declared: two servers cannot share it"
        )
    if load is None:
        return RolloutDecision(
            UNDECIDED, "memory not known here (no controller): surge if it fits beside the old"
        )
    if not load.ok:
        return RolloutDecision(RECREATE, _no_room(load, needed))
    return RolloutDecision(SURGE, f"{_room_text(load, needed)} beside the running server")


def _room(load: LoadDecision) -> int | None:
    figures = load.admission
    if figures is None:
        return None
    return max(0, min(figures.budget_room, figures.free_room))


def _no_room(load: LoadDecision, needed: int) -> str:
    room = _room(load)
    if room is None:
        why = load.error.message if load.error is not None else "refused"
        return f"no room to surge: {why}"
    return f"no room to surge, needs {format_gib(needed)}, {format_gib(room)} free"


def _room_text(load: LoadDecision, needed: int) -> str:
    room = _room(load)
    where = ", ".join(load.devices) or "its device"
    if room is None:
        return f"{format_gib(needed)} fits on {where}"
    return f"{format_gib(needed)} fits on {where} ({format_gib(room)} free)"
