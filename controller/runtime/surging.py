"""The surge capability: a runtime that can run a second server of a slot for a while.

A surge rollout (:mod:`controller.slots.surge`) starts the changed slot's new server on a
fresh port beside the old one, switches to it once it is ready, then stops the old one. A
runtime that can do that has a ``surge`` attribute satisfying :class:`SurgeInstances`
(the process runtime: :mod:`controller.runtime.process.surge`; docker:
:mod:`controller.runtime.docker.surge`; kubernetes: :mod:`controller.runtime.kubernetes.surge`,
a second Deployment switched to by the slot's Service); the others say why they cannot
(:func:`cannot_surge`), and their changed slots are recreated.

Every step is recorded by the runtime before it returns, and each is idempotent, so a
controller killed at any point finishes (or undoes) the rollout after its restart. A
runtime whose objects alone say where a rollout stopped (kubernetes: the Service and a
mark on the new Deployment) also :class:`SettlesAlone`: a restart converges from them,
with or without the manager's ``rollout.json``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from controller.runtime.base import LaunchSpec, Observed, Runtime

__all__ = [
    "RefusesSome",
    "SettlesAlone",
    "SurgeInstances",
    "cannot_surge",
    "settles_alone",
    "surge_of",
]


@runtime_checkable
class SurgeInstances(Protocol):
    async def start_instance(self, launch: LaunchSpec) -> Observed:
        """Start ``launch`` as the slot's second server (its own record and label)."""
        ...

    async def inspect_instance(self, slot: str) -> Observed:
        """The slot's second server (MISSING when there is none)."""
        ...

    async def stop_instance(self, slot: str, timeout: float) -> None:
        """Stop the second server and any stray of an interrupted start (never the
        slot's own server)."""
        ...

    async def promote(self, slot: str) -> None:
        """The second server becomes the slot's own; the old one is kept as *retiring*
        until :meth:`stop_retiring`. Idempotent."""
        ...

    async def stop_retiring(self, slot: str, timeout: float) -> bool:
        """Stop the server a promotion replaced (nothing when there is none); True: one
        was there."""
        ...


@runtime_checkable
class SettlesAlone(Protocol):
    async def settle(self, slot: str) -> str | None:
        """Finish or undo an interrupted rollout of ``slot`` from the runtime's own
        records: one server of the slot remains. Returns what was done (None: nothing)."""
        ...


@runtime_checkable
class RefusesSome(Protocol):
    def cannot_surge_slot(self, slot: str) -> str | None:
        """Why this one slot cannot surge now (None: it can): its objects say so (on
        kubernetes, a Service and pods from before instance labels)."""
        ...


def settles_alone(surge: SurgeInstances) -> SettlesAlone | None:
    return surge if isinstance(surge, SettlesAlone) else None


@runtime_checkable
class _CanSurge(Protocol):
    surge: SurgeInstances


def surge_of(runtime: object) -> SurgeInstances | None:
    """The runtime's surge capability, or None."""
    return runtime.surge if isinstance(runtime, _CanSurge) else None


def cannot_surge(runtime: Runtime, slot: str | None = None) -> str | None:
    """Why ``runtime`` cannot surge (None: it can); ``slot``: that slot too
    (:class:`RefusesSome`)."""
    surge = surge_of(runtime)
    if surge is not None:
        if slot is not None and isinstance(surge, RefusesSome):
            return surge.cannot_surge_slot(slot)
        return None
    return f"this runtime ({type(runtime).__name__}) runs one server per slot: no surge"
