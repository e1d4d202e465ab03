"""Checks a CRD the way the API server would, without one: structural-schema rules,
OpenAPI v3 validation (``jsonschema``, with strict field validation: unknown fields are
errors as under ``kubectl apply``'s default ``--validate=strict``) and the CEL
``x-kubernetes-validations`` (``cel-python``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema


def version_schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


def structural_violations(schema: dict[str, Any]) -> list[str]:
    """The rules of apiextensions/v1 structural schemas that a generator can break."""
    out = []
    for path, node in walk(schema):
        if "$ref" in node or "$defs" in node or "definitions" in node:
            out.append(f"{path}: $ref/$defs")
        untyped_ok = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        if "type" not in node and not untyped_ok:
            out.append(f"{path}: no type")
        for key in ("anyOf", "oneOf", "allOf", "not"):
            if key in node:
                out.append(f"{path}: {key} (types inside logical junctors are not structural)")
        if node.get("additionalProperties") is False:
            out.append(f"{path}: additionalProperties: false is forbidden")
        if "properties" in node and "additionalProperties" in node:
            out.append(f"{path}: properties and additionalProperties are exclusive")
        if "default" in node:
            out.append(f"{path}: default (the loader owns defaults)")
        if node.get("x-kubernetes-preserve-unknown-fields") and path.startswith(".spec"):
            out.append(f"{path}: preserve-unknown-fields (unknown keys must be refused)")
        if node.get("type") == "array" and "items" not in node:
            out.append(f"{path}: array without items")
        if node.get("uniqueItems"):
            out.append(f"{path}: uniqueItems is forbidden")
        if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
            out.append(f"{path}: exclusiveMinimum must be the OpenAPI v3.0 boolean")
    return out


def to_jsonschema(node: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """OpenAPI v3.0 (as in a CRD) -> JSON Schema draft 4 for ``jsonschema``."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes") or key in ("description", "nullable", "format"):
            continue
        if key == "properties":
            out[key] = {k: to_jsonschema(v, strict) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_jsonschema(value, strict)
        else:
            out[key] = value
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if strict and node.get("type") == "object" and node.get("properties"):
        out.setdefault("additionalProperties", False)
    return out


def schema_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    schema = version_schema(crd)
    validator = jsonschema.Draft4Validator(to_jsonschema(schema))
    found = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]
    return found


def _rules_at(
    node: dict[str, Any], value: Any, path: str
) -> Iterator[tuple[str, dict[str, Any], Any]]:
    for rule in node.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for name, child in node.get("properties", {}).items():
            if name in value and value[name] is not None:
                yield from _rules_at(child, value[name], f"{path}.{name}")
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                yield from _rules_at(extra, item, f"{path}.{name}")
    if isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            yield from _rules_at(node["items"], item, f"{path}[{i}]")


def cel_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Evaluate every x-kubernetes-validations rule whose node is present in ``obj``."""
    env = celpy.Environment()
    out = []
    for path, rule, value in _rules_at(version_schema(crd), obj, ""):
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if not bool(result):
            out.append(f"{path or '.'}: {rule['message']}")
    return out


def admission_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """What a create of ``obj`` would be refused for: schema first, then CEL."""
    return schema_errors(crd, obj) or cel_errors(crd, obj)
