"""The OpenAI-compatible router (SPEC §7): its route table — ``/v1/models``, completions,
embeddings, audio.

The routes only declare themselves (summary, body schema, answers) and hand the request
to :func:`~controller.api.router_proxy.route_request` (leasing, forwarding, streaming);
reading and refusals are :mod:`controller.api.router_answers` over what both router paths
share, :mod:`controller.router`.

Errors leave in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
unknown model 404 ``model_not_found``, bad body 400, queue full 429, crash looping,
insufficient memory and not-ready 503 (all with ``Retry-After``), an upstream that cannot
be reached or breaks before answering 502. A stream that breaks after its first byte ends
with one ``data: {"error": ...}`` event.
"""

from __future__ import annotations

from typing import Final

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from controller.api.app import API_CTX, RouteTable, json_response, principal_of
from controller.api.router_answers import openai_error, refusal_response
from controller.api.router_proxy import route_request
from controller.api.router_proxy import setup as setup
from controller.router.aliases import model_entries
from controller.router.body import AUDIO_MAX_BYTES, AUDIO_TAIL, JSON_MAX_BYTES
from controller.router.refusals import model_not_found
from controller.router.selection import served_ids
from controller.slots.manager import SlotManager

__all__ = ["openai_error", "served_ids", "setup"]

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

# ----------------------------------------------------------------------------- schemas


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


_PROXY_RESPONSES: Final = {
    200: ("the upstream's answer (JSON, or text/event-stream when streaming)", None),
    400: ("no JSON body, no model, or a model whose slot type does not serve the endpoint", None),
    404: ("model_not_found", None),
    413: ("body too large", None),
    429: ("queue full (Retry-After)", None),
    502: ("upstream unreachable or failed", None),
    503: ("crash looping, insufficient memory or not ready (Retry-After)", None),
}


# ----------------------------------------------------------------------------- routes


@route(
    "GET",
    "/v1/models",
    summary="OpenAI model list: catalogue models with an activated slot",
    tag="openai",
    responses={200: ("models", OpenAIModelList)},
)
async def v1_models(request: web.Request) -> web.Response:
    manager: SlotManager = request.app[API_CTX].manager
    data = model_entries(manager, principal_of(request))
    return json_response({"object": "list", "data": data})


@route(
    "GET",
    "/v1/models/{model_id:.+}",
    summary="OpenAI model retrieve: one model of /v1/models (404 in OpenAI's shape)",
    tag="openai",
    responses={200: ("model", OpenAIModel), 404: ("unknown model", None)},
)
async def v1_model(request: web.Request) -> web.Response:
    manager: SlotManager = request.app[API_CTX].manager
    model_id = request.match_info["model_id"]
    entries = model_entries(manager, principal_of(request))
    entry = next((e for e in entries if e["id"] == model_id), None)
    if entry is None:
        return refusal_response(model_not_found(model_id))
    return json_response(entry)


@route(
    "POST",
    "/v1/chat/completions",
    summary="OpenAI chat completions, routed by model (streaming passes through)",
    tag="openai",
    body=OpenAIRequest,
    responses=_PROXY_RESPONSES,
)
async def v1_chat_completions(request: web.Request) -> web.StreamResponse:
    return await route_request(request, limit=JSON_MAX_BYTES)


@route(
    "POST",
    "/v1/completions",
    summary="OpenAI text completions, routed by model (streaming passes through)",
    tag="openai",
    body=OpenAIRequest,
    responses=_PROXY_RESPONSES,
)
async def v1_completions(request: web.Request) -> web.StreamResponse:
    return await route_request(request, limit=JSON_MAX_BYTES)


@route(
    "POST",
    "/v1/embeddings",
    summary="OpenAI embeddings, routed by model",
    tag="openai",
    body=OpenAIRequest,
    responses=_PROXY_RESPONSES,
)
async def v1_embeddings(request: web.Request) -> web.StreamResponse:
    return await route_request(request, limit=JSON_MAX_BYTES)


@route(
    "POST",
    "/v1/audio/{path:.+}",
    summary="OpenAI audio (speech, transcriptions, translations): body passed through as-is",
    tag="openai",
    responses=_PROXY_RESPONSES,
)
async def v1_audio(request: web.Request) -> web.StreamResponse:
    if not AUDIO_TAIL.fullmatch(request.match_info["path"]):  # before any lease or load
        return openai_error(
            400,
            f"invalid audio endpoint {request.match_info['path']!r}",
            code="invalid_request_error",
        )
    return await route_request(request, limit=AUDIO_MAX_BYTES)
