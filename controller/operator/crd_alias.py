"""The ``aliases.slotctl.io`` CRD (short name ``mal``): an ``[[alias]]`` as a resource.

Pure; from :class:`~controller.spec.schema.AliasSpec` as :mod:`controller.operator.crd`
derives the ``Model`` and ``Slot`` CRDs (one schema, two syntaxes): the keys of an
``Alias``' ``spec`` are the keys of an ``[[alias]]`` table; its ``id`` defaults to
``metadata.name``. Whether its members are catalogue models is the operator's to judge
(``alias.unknown_member``, reported as ``Degraded``), as for a Slot's model reference.
"""

from __future__ import annotations

from typing import Any

from controller.operator import crd
from controller.spec.schema import AliasSpec

__all__ = ["alias_crd"]

_DOCS = {
    "id": "Alias id, the model name clients send (defaults to metadata.name); no Model or "
    "Slot may have it.",
    "models": "The catalogue models it names, in order of preference (1..16, each once).",
    "prefer": "warm: the first member already loaded, else the first whose load evicts "
    "nothing of a higher priority; first: always the first member; spread: the least busy "
    "loaded slot of any member (default warm).",
}


def _spec_schema() -> dict[str, Any]:
    schema = crd._spec_schema(AliasSpec, drop=())
    schema["required"] = [r for r in schema.get("required", []) if r != "id"]
    for key, text in _DOCS.items():
        schema["properties"][key]["description"] = text
    schema["properties"]["models"]["maxItems"] = 16
    schema["properties"]["models"]["items"]["maxLength"] = 200
    schema["properties"]["models"]["x-kubernetes-validations"] = [
        {
            "rule": "size(self) >= 1 && self.all(m, self.exists_one(n, n == m))",
            "message": "models names at least one model, each once (alias.invalid_value)",
        }
    ]
    return schema


def _status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "conditions": crd._conditions_schema(),
            "id": {"type": "string"},
            "lastError": crd._error_schema(),
        },
    }


def alias_crd() -> dict[str, Any]:
    return crd._crd(
        kind="Alias",
        plural="aliases",
        short=["mal"],
        spec=_spec_schema(),
        status=_status_schema(),
        columns=[
            {"name": "Id", "type": "string", "jsonPath": ".status.id"},
            {"name": "Prefer", "type": "string", "jsonPath": ".spec.prefer"},
            {"name": "Models", "type": "string", "jsonPath": ".spec.models"},
            crd._ready_column(),
            crd._age_column(),
        ],
        root_rules=[],
    )
