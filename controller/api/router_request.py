"""Reading a routed request and refusing it: the body, its ``model``, the slot's lease.

Part of the OpenAI router (:mod:`controller.api.router` is its route table,
:mod:`controller.api.router_proxy` forwards). Parses only what routing needs: the body
is read whole (bounded: 413 beyond the limit) and passed upstream unchanged; the router
reads its ``model`` (JSON object, or a multipart form field for ``/v1/audio/*``) and
nothing else. Refusals leave in OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}`` (:class:`Refusal`, :func:`openai_error`).
"""

from __future__ import annotations

import json
import json.scanner
import math
import re
from dataclasses import dataclass
from email.message import Message
from typing import Any, Final

import aiohttp
from aiohttp import hdrs, web

from controller.api.app import json_response, openai_error_body
from controller.api.selection import ENDPOINTS, SERVES
from controller.errors import (
    InsufficientMemory,
    ModelNotFound,
    SlotctlError,
    SlotNotFound,
    SlotNotReady,
)
from controller.slots import Lease
from controller.slots.ports import RouterPort

__all__ = [
    "AUDIO_MAX_BYTES",
    "AUDIO_TAIL",
    "JSON_MAX_BYTES",
    "Pending",
    "Refusal",
    "acquire",
    "acquire_now",
    "acquire_rest",
    "error_body",
    "model_not_found",
    "model_of",
    "openai_error",
    "read_body",
    "requested_model",
    "shutting_down",
    "slot_refusal",
    "upstream_path",
    "upstream_refusal",
    "wrong_endpoint",
]

JSON_MAX_BYTES: Final = 8 * 1024 * 1024
AUDIO_MAX_BYTES: Final = 64 * 1024 * 1024  # uploads of a long recording
_NOT_READY_TRIES: Final = 3  # a slot swapped out between its load and our lease: queue again
_RETRY_S: Final = 1.0  # Retry-After for 503s that carry no figure of their own
_MEMORY_RETRY_S: Final = 5.0  # insufficient memory: leases have to end first


# ----------------------------------------------------------------------------- errors


class Refusal(Exception):
    """A request the router answers itself (rendered by :func:`openai_error`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        return openai_error(
            self.status,
            self.message,
            code=self.code,
            param=self.param,
            retry_after_s=self.retry_after_s,
        )


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


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return openai_error_body(status, message, code, param)


def shutting_down() -> Refusal:
    """The 503 of a request that comes (or is still running) as the router stops."""
    return Refusal(503, "the router is shutting down", code="slot.not_ready", retry_after_s=1)


def model_not_found(model: str) -> Refusal:
    return Refusal(
        404,
        f"The model '{model}' does not exist or no activated slot serves it",
        code="model_not_found",
        param="model",
    )


def wrong_endpoint(model: str, endpoint: str, slot_type: str) -> Refusal:
    """The 400 of a request whose model's slot type does not serve its endpoint (an
    embedding request to a chat model...), as OpenAI answers it: before any load."""
    path = next((p for p, kind in ENDPOINTS.items() if kind == endpoint), "this endpoint")
    if endpoint == "audio":
        path = "/v1/audio/*"
    serves = [p for p, kind in ENDPOINTS.items() if kind in SERVES.get(slot_type, ())]
    wanted = [t for t, kinds in SERVES.items() if endpoint in kinds and t != "image"]
    return Refusal(
        400,
        f"The model {model!r} is served by a slot of type {slot_type!r}, which does not "
        f"serve {path} (it serves {', '.join(serves) or 'no routed endpoint'}); "
        f"{path} needs a model whose slot has type {' or '.join(map(repr, wanted))}",
        code="model_not_supported",
        param="model",
    )


def slot_refusal(error: SlotctlError) -> Refusal:
    """A typed slot error as the router's answer (SPEC §1 table, router column)."""
    if isinstance(error, ModelNotFound):
        return model_not_found(str(error.details.get("model", "")))
    status = error.http_status
    retry = error.details.get("retry_after_s")
    retry_s = float(retry) if isinstance(retry, int | float) and retry > 0 else None
    if isinstance(error, InsufficientMemory):
        status, retry_s = 503, retry_s or _MEMORY_RETRY_S
    elif isinstance(error, SlotNotFound) or status == 409:
        status = 503  # removed meanwhile / a pinned exclusive peer: not servable now
    elif status == 500:
        status = 502  # the model server failed to start: a bad gateway, not our bug
    if status in (429, 503):
        retry_s = retry_s or _RETRY_S
    return Refusal(status, error.message, code=error.code, retry_after_s=retry_s)


def upstream_refusal(slot: str, exc: BaseException) -> Refusal:
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Refusal(502, f"slot {slot!r} is unreachable: {detail}", code="upstream.unreachable")
    return Refusal(502, f"slot {slot!r} failed to answer: {detail}", code="upstream.failed")


# ----------------------------------------------------------------------------- request


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (413)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise Refusal(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def requested_model(request: web.Request, body: bytes) -> str:
    """``model`` from a JSON object body or a multipart form field (400 otherwise)."""
    return model_of(request.headers.get(hdrs.CONTENT_TYPE, ""), body)


def model_of(content_type: str, body: bytes) -> str:
    """``model`` of a body whose ``Content-Type`` header is ``content_type``."""
    if (
        content_type != "application/json"
        and content_type.partition(";")[0].strip().lower() == "multipart/form-data"
    ):
        model = _multipart_field(content_type, body, "model")
    else:
        data = _json_object(body)
        if data is None:
            if not body.strip():
                raise Refusal(400, "a JSON request body is required", code="invalid_body")
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                raise Refusal(
                    400, f"request body is not valid JSON: {exc}", code="invalid_json"
                ) from None
        if not isinstance(data, dict):
            raise Refusal(400, "request body must be a JSON object", code="invalid_body")
        model = data.get("model")
    if not isinstance(model, str) or not model:
        raise Refusal(
            400,
            "'model' is required and must be a non-empty string",
            code="invalid_model",
            param="model",
        )
    return model


# json.loads' own scanner (C); typeshed types make_scanner's argument as itself
_SCAN: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_SPACE: Final = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body parsed as ``json.loads`` would, when it is a UTF-8 JSON object (the common
    case: the scanner is called directly, without ``loads``' wrappers); None otherwise,
    and for anything ``loads`` would refuse, which then says why itself."""
    if body[:1] != b"{" or body[1:2] == b"\x00":  # json.loads would take UTF-16 or -32
        return None
    try:
        text = body.decode("utf-8")
        data, end = _SCAN(text, 0)
    except (StopIteration, ValueError, RecursionError):
        return None
    space = _SPACE.match(text, end)
    if space is None or space.end() != len(text) or not isinstance(data, dict):
        return None
    return data


def _multipart_field(content_type: str, body: bytes, name: str) -> str | None:
    """The value of one text field of a multipart/form-data body (None when absent)."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise Refusal(400, "multipart body without a boundary", code="invalid_body")
    delimiter = b"--" + boundary.encode("latin-1")
    position = body.find(delimiter)
    while position >= 0:
        start = position + len(delimiter)
        if body.startswith(b"--", start):
            return None  # the closing delimiter
        end = body.find(delimiter, start)
        part = body[start : end if end >= 0 else len(body)]
        head, sep, value = part.lstrip(b"\r\n").partition(b"\r\n\r\n")
        if sep and _form_name(head) == name:
            return value.removesuffix(b"\r\n").decode("utf-8", errors="replace").strip()
        position = end
    return None


def _form_name(head: bytes) -> str | None:
    for line in head.decode("latin-1").split("\r\n"):
        key, _, value = line.partition(":")
        if key.strip().lower() == "content-disposition":
            disposition = Message()
            disposition["content-disposition"] = value.strip()
            found = disposition.get_param("name", header="content-disposition")
            return found if isinstance(found, str) else None
    return None


# ----------------------------------------------------------------------------- lease


@dataclass(slots=True)
class Pending:
    """Where :func:`acquire_now` stopped: candidate ``start`` needs a wait (cold, or not
    ready ``tried`` times already); ``errors`` holds the refusals of those before it."""

    candidates: list[str]
    start: int
    tried: int
    errors: list[SlotctlError]


async def acquire(manager: RouterPort, candidates: list[str]) -> Lease:
    """A lease on the best candidate that grants one; else the best one's refusal."""
    now = acquire_now(manager, candidates)
    return now if isinstance(now, Lease) else await acquire_rest(manager, now)


def acquire_now(manager: RouterPort, candidates: list[str]) -> Lease | Pending:
    """:func:`acquire` up to the first candidate that needs a wait (none in the router's
    common case: no task, no await); raises the best one's refusal when all refuse."""
    errors: list[SlotctlError] = []
    for i, name in enumerate(candidates):
        try:
            lease = manager.try_acquire(name)
        except SlotNotReady:
            return Pending(candidates, i, 1, errors)  # unloading: queue again (awaited)
        except SlotctlError as exc:
            errors.append(exc)
            continue
        return lease if lease is not None else Pending(candidates, i, 0, errors)
    raise errors[0]


async def acquire_rest(manager: RouterPort, pending: Pending) -> Lease:
    """:func:`acquire` from where :func:`acquire_now` stopped."""
    errors, tried = pending.errors, pending.tried
    for name in pending.candidates[pending.start :]:
        try:
            return await _acquire_one(manager, name, tried)
        except SlotctlError as exc:
            errors.append(exc)
        tried = 0
    raise errors[0]


async def _acquire_one(manager: RouterPort, name: str, tried: int = 0) -> Lease:
    attempt = tried + 1
    while True:
        try:
            return await manager.acquire(name)
        except SlotNotReady:
            # Unloading (an exclusive peer's swap, an eviction) or a superseded load just
            # before our turn: queue again (bounded) rather than answer 503 at once.
            if attempt >= _NOT_READY_TRIES:
                raise
            attempt += 1


AUDIO_TAIL = re.compile(r"[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*")


def upstream_path(request: web.Request) -> str:
    """The path (and query) to forward: only the OpenAI endpoint itself, never more.

    ``/v1/audio/{path}`` takes plain segments only, so ``..`` or ``%2e%2e`` cannot reach a
    server's other routes (llama-server's ``/slots``, vLLM's admin endpoints).
    """
    tail = request.match_info.get("path")
    if tail is not None and not AUDIO_TAIL.fullmatch(tail):
        raise Refusal(400, f"invalid audio endpoint {tail!r}", code="invalid_request_error")
    path = request.path  # decoded and matched by the router; never the raw path
    query = request.query_string
    return f"{path}?{query}" if query else path
