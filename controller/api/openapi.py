"""The OpenAPI 3.1 document, generated from the route table and its pydantic types.

Every route of :class:`controller.api.app.RouteTable` appears with its parameters, request
and response schemas, the key scope it needs (``x-slotctl-scope``) and the answers every
route can give without declaring them (400, 401/403, 404, 421).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter

from controller import __version__
from controller.api.app import ErrorBody, RouteSpec, route_scope

__all__ = ["openapi_document", "openapi_path"]


def _schema(tp: Any, components: dict[str, Any]) -> dict[str, Any]:
    adapter = TypeAdapter(tp)
    schema = adapter.json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        components[name] = definition
    title = schema.get("title")
    if isinstance(title, str) and schema.get("type") == "object":
        components[title] = schema
        return {"$ref": f"#/components/schemas/{title}"}
    return schema


def openapi_document(routes: Sequence[RouteSpec]) -> dict[str, Any]:
    """The OpenAPI 3.1 document generated from ``routes`` and their pydantic types."""
    components: dict[str, Any] = {}
    error_ref = _schema(ErrorBody, components)
    paths: dict[str, Any] = {}
    for spec in routes:
        op: dict[str, Any] = {
            "summary": spec.summary,
            "operationId": spec.operation_id,
            "tags": [spec.tag],
            "responses": {},
        }
        if spec.public:
            op["security"] = []
        params = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in _path_params(spec.path)
        ]
        params += [
            {
                "name": q.name,
                "in": "query",
                "required": False,
                "description": q.description,
                "schema": {"type": q.type},
            }
            for q in spec.query
        ]
        if params:
            op["parameters"] = params
        if spec.body is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _schema(spec.body, components)}},
            }
        for status, (description, tp) in sorted(spec.responses.items()):
            response: dict[str, Any] = {"description": description}
            if status >= 400:
                response["content"] = {"application/json": {"schema": error_ref}}
            elif tp is not None:
                response["content"] = {spec.content_type: {"schema": _schema(tp, components)}}
            op["responses"][str(status)] = response
        # Answers every route can give without declaring them: a malformed request (400)
        # where there is a body or a query, an unknown name (404) where the path has one.
        if spec.body is not None or spec.query:
            op["responses"].setdefault(
                "400",
                {
                    "description": "malformed request (body or query parameters)",
                    "content": {"application/json": {"schema": error_ref}},
                },
            )
        if _path_params(spec.path):
            op["responses"].setdefault(
                "404",
                {
                    "description": "not found",
                    "content": {"application/json": {"schema": error_ref}},
                },
            )
        scope = route_scope(spec)
        if scope is not None:
            op["x-slotctl-scope"] = scope.label  # the key scope the route needs
            op["security"] = [{"bearer": []}, {"apiKey": []}]
            op["responses"].setdefault(
                "401",
                {
                    "description": "missing or wrong key (Authorization: Bearer, x-api-key)",
                    "content": {"application/json": {"schema": error_ref}},
                },
            )
            op["responses"].setdefault(
                "403",
                {
                    "description": f"the key's scope is below {scope.label} (or, on /v1, "
                    "a model its patterns do not name)",
                    "content": {"application/json": {"schema": error_ref}},
                },
            )
        # The Host check (api/hosts.py) answers every route before it is looked at.
        op["responses"].setdefault(
            "421",
            {
                "description": "a Host this API does not answer (request.host_not_allowed)",
                "content": {"application/json": {"schema": error_ref}},
            },
        )
        paths.setdefault(openapi_path(spec.path), {})[spec.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "slotctl",
            "version": __version__,
            "description": "Slot lifecycle controller API and OpenAI-compatible router.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}, {"apiKey": []}],
    }


def openapi_path(path: str) -> str:
    """The OpenAPI path template of an aiohttp path: ``{model_id:.+}`` -> ``{model_id}``."""
    return "/".join(
        "{" + part[1:-1].split(":")[0] + "}"
        if part.startswith("{") and part.endswith("}")
        else part
        for part in path.split("/")
    )


def _path_params(path: str) -> list[str]:
    out = []
    for part in path.split("/"):
        if part.startswith("{") and part.endswith("}"):
            out.append(part[1:-1].split(":")[0])
    return out
