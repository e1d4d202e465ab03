"""The router's refusals: :class:`Refusal` (a request the router answers itself) and each
refusal the routed call gives, in OpenAI's error shape ``{"error": {"message", "type",
"param", "code"}}`` (:func:`openai_error_body`).

Pure data and the one event a refusal reports (:func:`report_refusal`); the routed call
(:mod:`controller.router.call`) gives them, the data plane renders them as bytes
(:mod:`controller.dataplane.answers`).
"""

from __future__ import annotations

from typing import Any, Final

from controller.model.errors import (
    HostNotAllowed,
    InsufficientMemory,
    ModelNotFound,
    SlotctlError,
    SlotNotFound,
    SlotUpstreamTimeout,
)
from controller.model.events import EventKind, Op
from controller.router.context import RouterContext
from controller.router.endpoints import SERVES, path_of, paths_serving
from controller.slots.records import Lease

__all__ = [
    "BAD_BEARER_MESSAGE",
    "NO_BEARER_MESSAGE",
    "OPENAI_ERROR_TYPES",
    "Refusal",
    "error_body",
    "misdirected",
    "model_not_found",
    "openai_error_body",
    "report_refusal",
    "revoked",
    "shutting_down",
    "slot_refusal",
    "too_large",
    "upstream_failed",
    "upstream_timeout",
    "upstream_unreachable",
    "wrong_endpoint",
]

_RETRY_S: Final = 1.0  # Retry-After for 503s that carry no figure of their own
_MEMORY_RETRY_S: Final = 5.0  # insufficient memory: leases have to end first

NO_BEARER_MESSAGE: Final = "missing bearer token (Authorization: Bearer <token>)"
BAD_BEARER_MESSAGE: Final = "wrong bearer token"

OPENAI_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "unavailable_error",
}


def openai_error_body(
    status: int, message: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's error shape."""
    kind = OPENAI_ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Refusal(Exception):
    """A request the router answers itself (each path renders it)."""

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

    def body(self) -> dict[str, Any]:
        return openai_error_body(self.status, self.message, self.code, self.param)


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


def too_large(limit: int) -> Refusal:
    return Refusal(413, f"request body exceeds {limit} bytes", code="request_too_large")


def misdirected(host: str) -> Refusal:
    """The ``421`` of a request whose ``Host`` this listener does not answer (DNS
    rebinding, :mod:`controller.router.hosts`)."""
    return Refusal(
        421,
        f"this API does not answer to Host {host[:100]!r}: use its address or localhost, or "
        "add the name with --allowed-host",
        code=HostNotAllowed.code,
    )


def wrong_endpoint(model: str, endpoint: str, slot_type: str) -> Refusal:
    """The 400 of a request whose model's slot type does not serve its endpoint (an
    embedding request to a chat model...), as OpenAI answers it: before any load."""
    path = path_of(endpoint)
    serves = paths_serving(slot_type)
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


def report_refusal(ctx: RouterContext, error: SlotctlError, model: str) -> None:
    """A refusal the manager did not report already gets its one event and log line."""
    if error.reported:
        return
    error.reported = True
    ctx.events.emit(
        EventKind.REFUSAL,
        Op.ROUTE,
        slot=error.details.get("slot"),
        model=model,
        message=error.message,
        error=error.code,
    )


def upstream_timeout(
    ctx: RouterContext, slot: str, model: str, seconds: float, *, connecting: bool = False
) -> Refusal:
    """The answer of a request whose server went silent for ``seconds`` (or took no
    connection within them): ``504 slot.upstream_timeout`` (in-band once the answer
    began), reported once (an event; the metrics count it)."""
    what = (
        f"took no connection within {seconds:g}s"
        if connecting
        else f"sent nothing for {seconds:g}s (upstream_idle_s)"
    )
    error = SlotUpstreamTimeout(
        f"slot {slot!r}: its server {what}; the request was ended",
        slot=slot,
        idle_s=seconds,
    )
    report_refusal(ctx, error, model)
    return slot_refusal(error)


def revoked(slot: str, lease: Lease | None) -> Refusal:
    """The answer of a request whose lease was revoked (its slot crashed or went away)."""
    error = lease.error if lease is not None else None
    if error is not None:
        return slot_refusal(error)
    return Refusal(502, f"slot {slot!r} went away", code="upstream.failed")


def upstream_unreachable(slot: str, detail: str) -> Refusal:
    return Refusal(502, f"slot {slot!r} is unreachable: {detail}", code="upstream.unreachable")


def upstream_failed(slot: str, detail: str) -> Refusal:
    return Refusal(502, f"slot {slot!r} failed to answer: {detail}", code="upstream.failed")
