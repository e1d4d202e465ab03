"""The Kubernetes bodies the operator reads and writes, typed (after kopf's ``bodies.py``).

What the API server sends is JSON; kopf hands it over as mappings of ``Any``. Here are
its shapes as :class:`~typing.TypedDict` s, so the operator's code says which fields it
reads: the object's metadata (:class:`ObjectMeta`), a ``Model``/``Slot``/``Alias``
(:class:`Resource`), what the operator's kopf index keeps of one (:class:`Essence`, read
from a body by :func:`essence_of`), and the ``status`` each kind gets
(:class:`SlotStatus`, :class:`ModelStatus`, :class:`AliasStatus` with their
:class:`Condition` s). A resource's ``spec`` stays a JSON object (:data:`JsonObject`):
the loader's checks judge it key by key, as they judge a TOML table.

Pure: no kopf, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

__all__ = [
    "AliasStatus",
    "Condition",
    "CrKey",
    "Essence",
    "EssenceMeta",
    "JsonObject",
    "LastError",
    "MemoryStatus",
    "ModelStatus",
    "ObjectMeta",
    "Resource",
    "RolloutStatus",
    "SlotStatus",
    "Status",
    "cr_key",
    "essence_of",
]

JsonObject = dict[str, object]  # a JSON object (a resource's spec): judged key by key
CrKey = tuple[str, str, str]  # (kind, namespace, name): one custom resource


class ObjectMeta(TypedDict, total=False):
    """``metadata``: the fields the operator reads or writes."""

    name: str
    namespace: str
    uid: str
    generation: int
    resourceVersion: str
    creationTimestamp: str
    deletionTimestamp: str | None
    labels: dict[str, str]
    annotations: dict[str, str]
    finalizers: list[str]


class Resource(TypedDict, total=False):
    """A ``Model``, ``Slot`` or ``Alias`` as the API serves it (and as ``stack export
    --format crd`` writes it)."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: JsonObject
    status: JsonObject


class EssenceMeta(TypedDict):
    name: str
    namespace: str
    generation: int
    creationTimestamp: str
    deleting: bool  # a deletionTimestamp is set (a finalizer holds it)


class Essence(TypedDict):
    """What the operator's kopf index keeps of a resource: enough to judge its spec."""

    metadata: EssenceMeta
    spec: JsonObject


class Condition(TypedDict):
    """A standard condition (``Ready``, ``Progressing``, ``Degraded``)."""

    type: str
    status: str  # "True" | "False"
    observedGeneration: int
    lastTransitionTime: str
    reason: str
    message: str


class LastError(TypedDict):
    code: str
    message: str


class MemoryStatus(TypedDict):
    device: str
    gb: float
    admitted: bool


class ReplicaStatus(TypedDict, total=False):
    name: str
    index: int
    state: str
    ready: bool
    endpoint: str | None
    node: str


class ReplicasStatus(TypedDict):
    """A Slot's replicas summed up (docs/replicas.md): how many are wanted, exist (a
    server admitted: starting to unloading), are ready (take requests), and each one."""

    min: int
    max: int
    running: int
    ready: int
    items: list[ReplicaStatus]


class RolloutStatus(TypedDict, total=False):
    strategy: str  # surge | recreate
    phase: str  # starting | switched | failed | stopping | done
    reason: str  # why this way
    message: str
    since: str


class SlotStatus(TypedDict, total=False):
    observedGeneration: int
    state: str
    reason: str
    conditions: list[Condition]
    idleReason: str | None
    model: str
    endpoint: str | None
    node: str
    memory: MemoryStatus
    lastError: LastError
    rollout: RolloutStatus
    replicas: ReplicasStatus


class ModelStatus(TypedDict, total=False):
    observedGeneration: int
    id: str
    state: str  # loaded | unloaded
    slots: list[str]
    conditions: list[Condition]
    lastError: LastError


class AliasStatus(TypedDict, total=False):
    observedGeneration: int
    id: str
    conditions: list[Condition]
    lastError: LastError


Status = SlotStatus | ModelStatus | AliasStatus


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def cr_key(kind: str, body: Mapping[str, object]) -> CrKey:
    """The key of the resource ``body`` of ``kind``."""
    meta = body.get("metadata")
    if not isinstance(meta, Mapping):
        return (kind, "", "")
    return (kind, _text(meta.get("namespace")), _text(meta.get("name")))


def essence_of(body: Mapping[str, object]) -> Essence:
    """The :class:`Essence` of a body (kopf's, or a test's dict); a spec that is no
    object reads as an empty one (the loader then says what is missing)."""
    raw_meta = body.get("metadata")
    meta: Mapping[str, object] = raw_meta if isinstance(raw_meta, Mapping) else {}
    spec = body.get("spec")
    generation = meta.get("generation")
    return {
        "metadata": {
            "name": _text(meta.get("name")),
            "namespace": _text(meta.get("namespace")),
            "generation": generation if isinstance(generation, int) else 0,
            "creationTimestamp": _text(meta.get("creationTimestamp")),
            "deleting": bool(meta.get("deletionTimestamp")),
        },
        "spec": {str(k): v for k, v in spec.items()} if isinstance(spec, Mapping) else {},
    }
