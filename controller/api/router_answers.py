"""The aiohttp router path's reading and answers: the body read whole (bounded), its
``model``, the path forwarded, refusals rendered as aiohttp responses in OpenAI's shape.

Part of the OpenAI router's aiohttp path (:mod:`controller.api.router` its route table,
:mod:`controller.api.router_proxy` its forwarding); what both paths share is
:mod:`controller.router`.
"""

from __future__ import annotations

import math

import aiohttp
from aiohttp import hdrs, web

from controller.api.app import json_response
from controller.router.body import AUDIO_TAIL, model_of
from controller.router.refusals import (
    Refusal,
    error_body,
    too_large,
    upstream_failed,
    upstream_unreachable,
)

__all__ = [
    "openai_error",
    "read_body",
    "refusal_response",
    "requested_model",
    "upstream_path",
    "upstream_refusal",
]


def openai_error(
    status: int,
    message: str,
    *,
    code: str,
    param: str | None = None,
    retry_after_s: float | None = None,
) -> web.Response:
    """``{"error": {"message", "type", "param", "code"}}`` with ``Retry-After`` if given."""
    headers: dict[str, str] = {}
    if retry_after_s is not None and retry_after_s > 0:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return json_response(error_body(status, message, code, param), status=status, headers=headers)


def refusal_response(refusal: Refusal) -> web.Response:
    return openai_error(
        refusal.status,
        refusal.message,
        code=refusal.code,
        param=refusal.param,
        retry_after_s=refusal.retry_after_s,
    )


def upstream_refusal(slot: str, exc: BaseException) -> Refusal:
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        return upstream_unreachable(slot, detail)
    return upstream_failed(slot, detail)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (413)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def requested_model(request: web.Request, body: bytes) -> str:
    """``model`` from a JSON object body or a multipart form field (400 otherwise)."""
    return model_of(request.headers.get(hdrs.CONTENT_TYPE, ""), body)


def upstream_path(request: web.Request) -> str:
    """The path (and query) to forward: only the OpenAI endpoint itself, never more
    (``/v1/audio/{path}`` takes plain segments only: :data:`AUDIO_TAIL`)."""
    tail = request.match_info.get("path")
    if tail is not None and not AUDIO_TAIL.fullmatch(tail):
        raise Refusal(400, f"invalid audio endpoint {tail!r}", code="invalid_request_error")
    path = request.path  # decoded and matched by the router; never the raw path
    query = request.query_string
    return f"{path}?{query}" if query else path
