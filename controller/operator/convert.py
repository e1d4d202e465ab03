"""TOML stacks <-> ``Model``/``Slot`` custom resources (pure, no I/O).

The keys of a CR's ``spec`` are the keys of the TOML table (one schema, two syntaxes, see
:mod:`controller.operator.crd`): a ``Slot``'s name is ``metadata.name``, a ``Model``'s id
is ``spec.id`` (or ``metadata.name`` when the id is already a valid object name). The
owning stack travels in the ``slotctl.io/stack`` annotation, so ``stack export --format
crd`` followed by ``stack import`` gives the stack back unchanged.

The operator turns CRs into loader payloads with :func:`slot_payload` and
:func:`model_payload`, the same functions ``stack import`` uses.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, cast

import tomlkit
import yaml

from controller.operator.bodies import JsonObject, ObjectMeta, Resource
from controller.operator.crd import GROUP, VERSION
from controller.spec.loader import DesiredState, load_stack_texts
from controller.spec.problems import Problem
from controller.spec.render import toml_table
from controller.spec.schema import AdapterSpec, AliasSpec, ModelSpec, SlotSpec

__all__ = [
    "API_VERSION",
    "STACK_ANNOTATION",
    "ImportResult",
    "adapter_payload",
    "adapter_resource",
    "alias_payload",
    "model_payload",
    "object_name",
    "parse_documents",
    "resources_from_state",
    "slot_payload",
    "stacks_from_resources",
]

API_VERSION: Final = f"{GROUP}/{VERSION}"
STACK_ANNOTATION: Final = f"{GROUP}/stack"
_NAME_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def object_name(model_id: str) -> str:
    """A DNS-1123 subdomain for a model id: the id itself when it is one."""
    if _NAME_RE.fullmatch(model_id):
        return model_id
    base = re.sub(r"[^a-z0-9.-]+", "-", model_id.lower()).strip("-.") or "model"
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:8]
    return f"{base[:200]}-{digest}"


def _meta(name: str, namespace: str | None, stack: str | None) -> ObjectMeta:
    meta: ObjectMeta = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    if stack:
        meta["annotations"] = {STACK_ANNOTATION: stack}
    return meta


def _integral(data: JsonObject) -> JsonObject:
    """``ttl_s = 600`` stays 600, not 600.0 (the schema reads either as a number)."""
    return {
        k: int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**53 else v
        for k, v in data.items()
    }


def model_resource(
    model: ModelSpec, namespace: str | None = None, stack: str | None = None
) -> Resource:
    spec = _integral(model.model_dump(mode="json", exclude_unset=True, exclude_none=True))
    spec["id"] = model.id
    name = object_name(model.id)
    return {
        "apiVersion": API_VERSION,
        "kind": "Model",
        "metadata": _meta(name, namespace, stack),
        "spec": spec,
    }


def slot_resource(
    spec: SlotSpec, namespace: str | None = None, stack: str | None = None
) -> Resource:
    data = _integral(spec.model_dump(mode="json", exclude_unset=True, exclude_none=True))
    data.pop("name", None)
    return {
        "apiVersion": API_VERSION,
        "kind": "Slot",
        "metadata": _meta(spec.name, namespace, stack),
        "spec": data,
    }


def alias_resource(
    alias: AliasSpec, namespace: str | None = None, stack: str | None = None
) -> Resource:
    spec: JsonObject = alias.model_dump(mode="json", exclude_unset=True)
    spec["id"] = alias.id
    return {
        "apiVersion": API_VERSION,
        "kind": "Alias",
        "metadata": _meta(object_name(alias.id), namespace, stack),
        "spec": spec,
    }


def adapter_resource(
    adapter: AdapterSpec, namespace: str | None = None, stack: str | None = None
) -> Resource:
    spec: JsonObject = adapter.model_dump(mode="json", exclude_unset=True)
    spec["id"] = adapter.id
    return {
        "apiVersion": API_VERSION,
        "kind": "Adapter",
        "metadata": _meta(object_name(adapter.id), namespace, stack),
        "spec": spec,
    }


def resources_from_state(
    state: DesiredState, namespace: str | None = None, *, owners: Mapping[str, str] | None = None
) -> list[Resource]:
    """Every model, then every slot, then every alias, as CRs; ``owners``: model id ->
    stack (optional)."""
    owners = owners or {}
    models = [model_resource(m, namespace, owners.get(m.id)) for m in state.models.values()]
    slots = [slot_resource(s.spec, namespace, s.stack or None) for s in state.slots.values()]
    aliases = [alias_resource(a.spec, namespace, a.stack or None) for a in state.aliases.values()]
    adapters = [
        adapter_resource(a.spec, namespace, a.stack or None) for a in state.adapters.values()
    ]
    return models + slots + aliases + adapters


def dump_documents(resources: Iterable[Mapping[str, object]]) -> str:
    return yaml.safe_dump_all(list(resources), sort_keys=False, width=100)


# ------------------------------------------------------------------ CR -> payload


def _spec(resource: Mapping[str, object]) -> Mapping[str, object]:
    spec = resource.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _name(resource: Mapping[str, object]) -> str:
    meta = resource.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def slot_payload(resource: Mapping[str, object]) -> tuple[JsonObject, list[Problem]]:
    """A ``Slot`` -> the ``[[slot]]`` payload the loader checks (name from metadata)."""
    spec = dict(_spec(resource))
    name = _name(resource)
    problems = []
    if "name" in spec and spec["name"] != name:
        problems.append(
            Problem(
                code="slot.unknown_key",
                message="spec.name is not a Slot field: the slot's name is metadata.name",
                slot=name,
                key="name",
                hint="remove spec.name",
            )
        )
    spec["name"] = name
    return spec, problems


def model_payload(resource: Mapping[str, object]) -> JsonObject:
    """A ``Model`` -> the ``[[model]]`` payload (id from spec.id, else metadata.name)."""
    spec = dict(_spec(resource))
    spec.setdefault("id", _name(resource))
    return spec


def alias_payload(resource: Mapping[str, object]) -> JsonObject:
    """An ``Alias`` -> the ``[[alias]]`` payload (id from spec.id, else metadata.name)."""
    return model_payload(resource)


def adapter_payload(resource: Mapping[str, object]) -> JsonObject:
    """An ``Adapter`` -> the ``[[adapter]]`` payload (id from spec.id, else metadata.name)."""
    return model_payload(resource)


# ------------------------------------------------------------------ import


def parse_documents(text: str) -> list[Resource]:
    """YAML (one or many documents, or ``kind: List``) -> the slotctl.io objects in it."""
    out: list[Resource] = []
    for doc in yaml.safe_load_all(text):
        if not isinstance(doc, dict):
            continue
        items = doc.get("items") if doc.get("kind") == "List" else [doc]
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and str(item.get("apiVersion", "")).startswith(f"{GROUP}/"):
                out.append(cast(Resource, item))  # what a document says: the loader judges it
    return out


class ImportResult:
    """``stack import``: one TOML text per stack, or the problems that stopped it."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.problems: list[Problem] = []


def _stack_of(resource: Mapping[str, object], default: str) -> str:
    meta = resource.get("metadata")
    notes = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = notes.get(STACK_ANNOTATION) if isinstance(notes, Mapping) else None
    return value if isinstance(value, str) and value else default


def stacks_from_resources(
    resources: Sequence[Mapping[str, object]], default_stack: str
) -> ImportResult:
    """CRs -> stack TOML texts (by their stack annotation), checked by the loader's rules."""
    result = ImportResult()
    models: dict[str, list[ModelSpec]] = {}
    slots: dict[str, list[JsonObject]] = {}
    aliases: dict[str, list[AliasSpec]] = {}
    adapters: dict[str, list[AdapterSpec]] = {}
    for res in resources:
        stack = _stack_of(res, default_stack)
        if res.get("kind") == "Model":
            try:
                model = ModelSpec.model_validate(model_payload(res))
            except ValueError as exc:
                result.problems.append(
                    Problem(code="model.invalid_value", message=f"Model {_name(res)}: {exc}")
                )
                continue
            models.setdefault(stack, []).append(model)
        elif res.get("kind") == "Slot":
            payload, problems = slot_payload(res)
            result.problems.extend(problems)
            slots.setdefault(stack, []).append(payload)
        elif res.get("kind") == "Alias":
            try:
                alias = AliasSpec.model_validate(alias_payload(res))
            except ValueError as exc:
                result.problems.append(
                    Problem(code="alias.invalid_value", message=f"Alias {_name(res)}: {exc}")
                )
                continue
            aliases.setdefault(stack, []).append(alias)
        elif res.get("kind") == "Adapter":
            try:
                adapter = AdapterSpec.model_validate(adapter_payload(res))
            except ValueError as exc:
                result.problems.append(
                    Problem(code="adapter.invalid_value", message=f"Adapter {_name(res)}: {exc}")
                )
                continue
            adapters.setdefault(stack, []).append(adapter)
    if result.problems:
        return result
    for stack in sorted({*models, *slots, *aliases, *adapters}):
        result.texts[stack] = _stack_text(
            stack,
            models.get(stack, []),
            slots.get(stack, []),
            aliases.get(stack, []),
            adapters.get(stack, []),
        )
    report = load_stack_texts([(f"{s}.toml", t) for s, t in result.texts.items()])
    result.problems.extend(report.errors)
    return result


def _stack_text(
    stack: str,
    models: list[ModelSpec],
    slots: list[JsonObject],
    aliases: Sequence[AliasSpec] = (),
    adapters: Sequence[AdapterSpec] = (),
) -> str:
    """A stack file with exactly the keys the CRs set (defaults stay the loader's)."""
    doc = tomlkit.document()
    meta = tomlkit.table()
    meta["name"] = stack
    doc["stack"] = meta
    for key, tables in (
        (
            "model",
            [m.model_dump(mode="json", exclude_unset=True, exclude_none=True) for m in models],
        ),
        ("slot", slots),
        ("alias", [a.model_dump(mode="json", exclude_unset=True) for a in aliases]),
        ("adapter", [a.model_dump(mode="json", exclude_unset=True) for a in adapters]),
    ):
        if tables:
            aot = tomlkit.aot()
            for table in tables:
                aot.append(toml_table(_integral(table)))
            doc[key] = aot
    return tomlkit.dumps(doc)
