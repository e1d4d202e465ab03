"""What the InferencePools the kubernetes runtime keeps are, as pure functions: one per
model (Gateway API Inference Extension's ``InferencePool``,
``inference.networking.k8s.io/v1``), selecting the pods of that model's Ready slots, so a
gateway that implements the extension routes to slotctl's servers.

The v1 spec's fields, as the extension's CRD (v1.6.2, vendored in
``tests/k8s/data/gie/``) defines them: ``selector.matchLabels`` (required, 1-64 labels,
pods of the pool's own namespace only), ``targetPorts`` (required, 1-8 unique
``{number}``; each pod is an endpoint at each of them) and ``endpointPickerRef``
(optional since v1.6: ``name``, ``kind`` default ``Service``, ``port.number`` required for
a Service, ``failureMode``). The selector is ``slotctl.managed=true`` and
``slotctl.pool=<pool>``: the runtime puts the ``slotctl.pool`` label on a slot's pod while
the slot is Ready and takes it off when it is not (the Deployment's template never has
it, so labelling a pod rolls nothing out). Pool names are ``slotctl-<model>``, the id made
a DNS label (lower case, other characters ``-``; a short hash of the id added whenever
that changed it or it was too long, so two ids never share a pool).

Sits beside :mod:`controller.runtime.kubernetes.spec`; nothing here talks to an API server.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from controller.runtime.base import MANAGED_LABEL
from controller.runtime.kubernetes.spec import OBJECT_PREFIX, OWNER_LABEL

__all__ = [
    "MAX_TARGET_PORTS",
    "POOL_GROUP",
    "POOL_KIND",
    "POOL_LABEL",
    "POOL_PLURAL",
    "POOL_VERSION",
    "Picker",
    "PoolWant",
    "SlotFacts",
    "pod_pools",
    "pool_body",
    "pool_name",
    "wanted_pools",
]

POOL_GROUP: Final = "inference.networking.k8s.io"
POOL_VERSION: Final = "v1"
POOL_KIND: Final = "InferencePool"
POOL_PLURAL: Final = "inferencepools"
POOL_LABEL: Final = "slotctl.pool"  # on a Ready slot's pod: the pool that selects it
MODEL_ANNOTATION: Final = "slotctl.model"  # the pool's model id, as the catalogue spells it
MAX_TARGET_PORTS: Final = 8  # the CRD's maxItems
_NAME_MAX: Final = 63  # a label value (the selector) and a DNS label
_NOT_DNS: Final = re.compile(r"[^a-z0-9-]+")


def pool_name(model: str) -> str:
    """``slotctl-<model>`` as a DNS label that is also a label value (see the module)."""
    plain = _NOT_DNS.sub("-", model.lower()).strip("-")
    name = f"{OBJECT_PREFIX}{plain}"
    if plain == model and len(name) <= _NAME_MAX:
        return name
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    head = name[: _NAME_MAX - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}"


@dataclass(frozen=True, slots=True)
class SlotFacts:
    """What a pool needs of one slot: its model, its port, whether it is Ready."""

    slot: str
    model: str
    port: int | None
    ready: bool


@dataclass(frozen=True, slots=True)
class PoolWant:
    """One pool as it should be: its model, its target ports (the model's slots', at most
    :data:`MAX_TARGET_PORTS`, lowest first) and the slots whose pods it selects (the Ready
    ones)."""

    model: str
    ports: tuple[int, ...]
    ready: frozenset[str]


@dataclass(frozen=True, slots=True)
class Picker:
    """The pools' ``endpointPickerRef``: a Service (``name``, its port) of an endpoint
    picker the gateway consults, or none (optional since v1.6)."""

    name: str
    port: int
    failure_mode: str = "FailClose"

    @classmethod
    def parse(cls, text: str | None) -> Picker | None:
        """``NAME:PORT[:FailOpen|FailClose]`` (empty: none). ValueError otherwise."""
        value = (text or "").strip()
        if not value:
            return None
        parts = value.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
            raise ValueError(f"endpoint picker {text!r}: NAME:PORT[:FailOpen|FailClose]")
        mode = parts[2] if len(parts) == 3 else "FailClose"
        port = int(parts[1])
        if mode not in ("FailOpen", "FailClose") or not 1 <= port <= 65535:
            raise ValueError(f"endpoint picker {text!r}: NAME:PORT[:FailOpen|FailClose]")
        return cls(parts[0], port, mode)


def wanted_pools(slots: Iterable[SlotFacts]) -> dict[str, PoolWant]:
    """Pool name -> what it should be: one per model that has a slot with a port; a model
    none of whose slots has a port yet has no pool (``targetPorts`` needs one)."""
    ports: dict[str, set[int]] = {}
    ready: dict[str, set[str]] = {}
    for facts in slots:
        if not facts.model or facts.port is None:
            continue
        ports.setdefault(facts.model, set()).add(facts.port)
        members = ready.setdefault(facts.model, set())
        if facts.ready:
            members.add(facts.slot)
    return {
        pool_name(model): PoolWant(
            model=model,
            ports=tuple(sorted(found)[:MAX_TARGET_PORTS]),
            ready=frozenset(ready[model]),
        )
        for model, found in ports.items()
    }


def pool_body(
    name: str, want: PoolWant, namespace: str, owner: str, picker: Picker | None = None
) -> dict[str, Any]:
    """The InferencePool ``name`` for ``want`` (a server-side apply's body)."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {MANAGED_LABEL: "true", POOL_LABEL: name}},
        "targetPorts": [{"number": port} for port in want.ports],
    }
    if picker is not None:
        spec["endpointPickerRef"] = {
            "kind": "Service",
            "name": picker.name,
            "port": {"number": picker.port},
            "failureMode": picker.failure_mode,
        }
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": POOL_KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_LABEL: "true", OWNER_LABEL: owner},
            "annotations": {MODEL_ANNOTATION: want.model},
        },
        "spec": spec,
    }


def pod_pools(wants: Mapping[str, PoolWant]) -> dict[str, str]:
    """Slot -> the pool its pod is to be labelled with (its Ready slots')."""
    return {slot: name for name, want in wants.items() for slot in want.ready}
