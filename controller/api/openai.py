"""The OpenAI-compatible routes (SPEC §7) as the API documents them: every ``/v1`` endpoint
of the router's table (:data:`controller.router.endpoints.ENDPOINTS`) in the API's route
table, so each has its auth rule (the ``inference`` scope) and its OpenAPI entry — but the
data plane serves them (:mod:`controller.dataplane`), never aiohttp.

A route module beside the others (:mod:`controller.api.assembly` collects its table).
Errors leave in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
unknown model 404 ``model_not_found``, bad body 400, queue full 429, crash looping,
insufficient memory and not-ready 503 (all with ``Retry-After``), an upstream that cannot
be reached or breaks before answering 502. A stream that breaks after its first byte ends
with one ``data: {"error": ...}`` event. :func:`setup` marks the API closed when its app
is cleaned up (a routed request still running then gets a 503).
"""

from __future__ import annotations

from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from controller.api.app import API_CTX, ApiContext, RouteTable
from controller.router.endpoints import ENDPOINTS, MODEL, MODELS

__all__ = ["OpenAIModel", "OpenAIModelList", "OpenAIRequest", "routes", "setup"]

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)


class OpenAIRequest(BaseModel):
    """An OpenAI request body. The router reads ``model`` only; the rest passes through."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="catalogue model id: picks the slot")
    stream: bool = Field(default=False, description="server-sent events, passed through")


class OpenAIModel(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    type: str = Field(description="the slot type serving it: llm, embedding, tts, stt, image")
    endpoints: list[str] = Field(description="the OpenAI endpoints that serve it")
    alias: bool = Field(default=False, description="an [[alias]]: one of `members` serves it")
    members: list[str] | None = Field(default=None, description="an alias' models")
    prefer: str | None = Field(default=None, description="an alias' choice: warm|first|spread")


class OpenAIModelList(BaseModel):
    object: str = "list"
    data: list[OpenAIModel]


_ROUTED_ANSWERS: Final[dict[int, tuple[str, Any]]] = {
    200: ("the upstream's answer (JSON, or text/event-stream when streaming)", None),
    400: ("no JSON body, no model, or a model whose slot type does not serve the endpoint", None),
    404: ("model_not_found", None),
    413: ("body too large", None),
    429: ("queue full, or the key's limits (Retry-After)", None),
    502: ("upstream unreachable or failed", None),
    503: ("crash looping, insufficient memory or not ready (Retry-After)", None),
    504: ("the slot's server sent nothing for its upstream_idle_s", None),
}


def _answers(endpoint: Any) -> dict[int, tuple[str, Any]]:
    if endpoint is MODELS:
        return {200: ("models", OpenAIModelList)}
    if endpoint is MODEL:
        return {200: ("model", OpenAIModel), 404: ("unknown model", None)}
    return _ROUTED_ANSWERS


for _endpoint in ENDPOINTS:
    routes.served_elsewhere(
        _endpoint.method,
        _endpoint.path,
        operation=_endpoint.operation,
        summary=_endpoint.summary,
        tag="openai",
        body=OpenAIRequest if _endpoint.routed and _endpoint.kind != "audio" else None,
        responses=_answers(_endpoint),
    )


def setup(app: web.Application, ctx: ApiContext) -> None:
    """The API is closed once its app is cleaned up: a routed request still running
    opens nothing new (503)."""

    async def closed(app: web.Application) -> None:
        app[API_CTX].closed = True

    app.on_cleanup.append(closed)
