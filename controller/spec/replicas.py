"""A slot's replicas: the slots the desired state expands it into. Pure (no I/O).

A slot that declares ``replicas = N`` (or ``min_replicas`` / ``max_replicas``) is served
by up to ``max_count`` servers, each a slot of its own with its own lifecycle, port and
state (docs/design/0021-replicas.md). Replica 0 keeps the slot's name, so a
slot that gains replicas keeps its server, its state dir and its port; replica ``i``
is ``<name>-r<i>``: a DNS-1123 label like every slot name (it becomes a directory, a
container's name, a Kubernetes object's), which ``#`` or ``.`` would not be.

The desired-state cache (:mod:`controller.spec.desired`) publishes the replicas beside the
slot, so the reconciler, the manager and every reader see ordinary slots; what makes them
replicas is ``replica_of`` (the slot) and ``replica_index``. Replicas below
``min_count`` follow the slot's ``autoload`` and ``pinned`` (a pinned slot pins its
minimum); those above are loaded and unloaded by demand (never autoloaded, never pinned).
Every replica after the first takes an automatic port (a fixed port is one server's).
"""

from __future__ import annotations

from typing import Final

from controller.spec.schema import SlotSpec

__all__ = [
    "REPLICA_SUFFIX",
    "replica_name",
    "replica_names",
    "replica_of_name",
    "replica_specs",
]

REPLICA_SUFFIX: Final = "-r"


def replica_name(slot: str, index: int) -> str:
    """Replica ``index`` of ``slot``: the slot itself for 0, else ``<slot>-r<index>``."""
    return slot if index == 0 else f"{slot}{REPLICA_SUFFIX}{index}"


def replica_of_name(name: str) -> tuple[str, int] | None:
    """``(slot, index)`` when ``name`` is the name replica ``index`` >= 1 of ``slot``
    would have (``chat-r2`` -> ``("chat", 2)``), else None."""
    base, sep, digits = name.rpartition(REPLICA_SUFFIX)
    if not sep or not base or not digits.isdigit():
        return None
    index = int(digits)
    if index < 1 or replica_name(base, index) != name:
        return None
    return base, index


def replica_names(spec: SlotSpec) -> list[str]:
    """The names of ``spec``'s replicas after the first (what its expansion declares)."""
    if spec.replica_of is not None:
        return []
    return [replica_name(spec.name, index) for index in range(1, spec.max_count)]


def replica_specs(spec: SlotSpec) -> list[SlotSpec]:
    """The specs of ``spec``'s replicas after the first (none without replicas, and none
    of a replica: it is expanded from its slot, never again)."""
    if spec.replica_of is not None or spec.max_count <= 1:
        return []
    wanted = spec.min_count
    out: list[SlotSpec] = []
    for index in range(1, spec.max_count):
        base = index < wanted
        out.append(
            spec.model_copy(
                update={
                    "name": replica_name(spec.name, index),
                    "replica_of": spec.name,
                    "replica_index": index,
                    "port": None,
                    "autoload": spec.autoload if base else False,
                    "pinned": spec.pinned if base else False,
                }
            )
        )
    return out
