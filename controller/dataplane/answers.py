"""The data plane's own bytes: the answers it gives itself (refusals, the 401, the models
list), an upstream answer's head rebuilt for the client, an event stream's error end, an
endpoint's address.

Pure (no I/O); below :mod:`controller.dataplane.connection`. The answers are the aiohttp
router's (:mod:`controller.router.refusals`), written as bytes.
"""

from __future__ import annotations

import json
import math
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import urlsplit

from controller.access.keys import KeyRing, Principal
from controller.dataplane.request import MODELS, RequestHead
from controller.dataplane.upstream import Framing, Upstream, UpstreamError
from controller.router.access import bearer, identify
from controller.router.headers import RESPONSE_DROP_BYTES, connection_names, passes
from controller.router.hosts import HostPolicy
from controller.router.refusals import (
    BAD_BEARER_MESSAGE,
    NO_BEARER_MESSAGE,
    Refusal,
    error_body,
    misdirected,
    model_not_found,
    openai_error_body,
    shutting_down,
    too_large,
    upstream_failed,
    upstream_unreachable,
)

__all__ = [
    "address",
    "answer",
    "early_answer",
    "models_answer",
    "principal",
    "refusal_answer",
    "response_head",
    "sse_error_end",
    "unauthorized",
    "upstream_error",
]

_RESPONSE_DROP: Final = frozenset(n.decode() for n in RESPONSE_DROP_BYTES)


def early_answer(
    head: RequestHead, hosts: HostPolicy, *, closing: bool, keys: KeyRing
) -> tuple[bytes, int] | None:
    """The answer given before a request's body is read, with the status to record (0:
    none): a 421 for a ``Host`` this listener does not answer (before the token: no oracle
    for it), a 503 while the router stops; for a body over the endpoint's limit a 413, or
    first the 401 of a request without the token (as aiohttp's: no body read). Each
    closes the connection (after the body, dropped). None: read the body."""
    if not hosts.allows_raw(head.host):
        return refusal_answer(misdirected(head.host.decode("latin-1")), close=True), 0
    if closing:
        return refusal_answer(shutting_down(), close=True), 503
    if head.length <= head.limit:
        return None
    if principal(head, keys) is None:
        return unauthorized(head, close=True), 0
    return refusal_answer(too_large(head.limit), close=True), 413


def _text(value: bytes | None) -> str | None:
    # as aiohttp decodes a header (a non-UTF-8 key is a wrong key, never a 500)
    return value.decode("utf-8", "surrogateescape") if value is not None else None


def principal(head: RequestHead, keys: KeyRing) -> Principal | None:
    """Who the request is (the API's auth: a bearer token, else ``x-api-key``)."""
    authorization, api_key = _text(head.authorization), _text(head.api_key)
    return identify(keys, authorization, api_key, time.monotonic(), time.time())


def answer(
    status: int, payload: dict[str, Any], headers: list[tuple[str, str]], *, close: bool
) -> bytes:
    """A JSON answer of the data plane's own, whole."""
    body = json.dumps(payload).encode()
    lines = [
        f"HTTP/1.1 {status} {_reason(status)}",
        f"Date: {_date()}",
        "Content-Type: application/json; charset=utf-8",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers),
    ]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def refusal_answer(refusal: Refusal, *, close: bool = False) -> bytes:
    headers: list[tuple[str, str]] = []
    if refusal.retry_after_s is not None and refusal.retry_after_s > 0:
        headers.append(("Retry-After", str(max(1, math.ceil(refusal.retry_after_s)))))
    body = error_body(refusal.status, refusal.message, refusal.code, refusal.param)
    return answer(refusal.status, body, headers, close=close)


_DATE: list[Any] = [0, ""]  # the second it was made for, the Date header's value


def _date() -> str:
    now = int(time.time())
    if _DATE[0] != now:
        _DATE[:] = [now, formatdate(now, usegmt=True)]
    return str(_DATE[1])


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def models_answer(entries: list[dict[str, Any]], head: RequestHead) -> bytes:
    """``GET /v1/models`` and ``/v1/models/{id}`` over the ``entries`` (the models and
    aliases served: :func:`~controller.router.aliases.model_entries`), as
    :mod:`controller.api.router` answers them."""
    path = head.target.partition(b"?")[0]
    if path == MODELS:
        listing = {"object": "list", "data": entries}
        return answer(200, listing, [], close=not head.keep)
    model_id = path[len(MODELS) + 1 :].decode("ascii")
    entry = next((e for e in entries if e["id"] == model_id), None)
    if entry is None:
        return refusal_answer(model_not_found(model_id), close=not head.keep)
    return answer(200, entry, [], close=not head.keep)


def sse_error_end(refusal: Refusal) -> bytes:
    """An event stream's end after a failure: its last event says why (OpenAI's error
    shape), then the last chunk."""
    event = (
        b"data: "
        + json.dumps(error_body(refusal.status, refusal.message, refusal.code)).encode()
        + b"\n\n"
    )
    return b"%x\r\n" % len(event) + event + b"\r\n0\r\n\r\n"


_ADDRESSES: dict[str, tuple[tuple[str, int], bytes, bytes]] = {}


def address(endpoint: str) -> tuple[tuple[str, int], bytes, bytes]:
    """``(host, port)``, the Host header and the path prefix of an ``http://`` endpoint."""
    found = _ADDRESSES.get(endpoint)
    if found is None:
        parts = urlsplit(endpoint)
        if parts.scheme != "http" or not parts.hostname:
            raise Refusal(502, f"unsupported endpoint {endpoint!r}", code="upstream.unreachable")
        port = parts.port or 80
        found = ((parts.hostname, port), parts.netloc.encode(), parts.path.rstrip("/").encode())
        if len(_ADDRESSES) > 4096:
            _ADDRESSES.clear()
        _ADDRESSES[endpoint] = found
    return found


def unauthorized(head: RequestHead, *, close: bool) -> bytes:
    """The 401 of the API's auth, in OpenAI's shape."""
    given = bearer(_text(head.authorization)) or head.api_key
    message = BAD_BEARER_MESSAGE if given else NO_BEARER_MESSAGE
    payload = openai_error_body(401, message, "invalid_api_key")
    return answer(401, payload, [("WWW-Authenticate", 'Bearer realm="slotctl"')], close=close)


def upstream_error(slot: str, exc: UpstreamError) -> Refusal:
    if exc.unreachable:
        return upstream_unreachable(slot, str(exc))
    return upstream_failed(slot, str(exc))


# The passed header lines of the answer heads seen lately, by status, reason and fields: a
# model server answers with the same head again but for its length and Date.
_LINES: dict[tuple[int, bytes, tuple[tuple[bytes, bytes], ...]], tuple[bytes, bool]] = {}
_LINES_MAX: Final = 256


def _lines(status: int, reason: bytes, fields: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """The header lines passed to the client (each after a CRLF) and whether the answer is
    an event stream."""
    key = (status, reason, tuple(fields))
    found = _LINES.get(key)
    if found is None:
        named = connection_names(
            v.decode("latin-1") for n, v in fields if n.lower() == b"connection"
        )
        lines = b"".join(
            b"\r\n%s: %s" % (name, value)
            for name, value in fields
            if passes(name.lower().decode("latin-1"), _RESPONSE_DROP, named)
        )
        sse = any(
            n.lower() == b"content-type" and v.strip().lower().startswith(b"text/event-stream")
            for n, v in fields
        )
        if len(_LINES) >= _LINES_MAX:
            _LINES.clear()
        found = _LINES[key] = (lines, sse)
    return found


def response_head(upstream: Upstream, *, close: bool) -> tuple[bytes, bool, bool]:
    """The client's head of an upstream's answer: ``(head, chunked, event stream)``.
    Hop-by-hop headers (and those ``Connection`` names) go, the others pass in the order
    they came, the upstream's Date after them; a sized body keeps its length (it passes
    verbatim), a chunked or to-the-end one is re-chunked (a chunk a read)."""
    framing = upstream.framing
    chunked = framing is Framing.CHUNKED or framing is Framing.CLOSE
    if framing is Framing.LENGTH:
        tail = b"\r\nContent-Length: %d" % upstream.length
    elif chunked:
        tail = b"\r\nTransfer-Encoding: chunked"
    elif upstream.status not in (204, 304):
        tail = b"\r\nContent-Length: 0"
    else:
        tail = b""
    lines, sse = _lines(upstream.status, upstream.reason, upstream.fields)
    head = b"HTTP/1.1 %d %s%s%s%s%s\r\n\r\n" % (
        upstream.status,
        upstream.reason,
        lines,
        b"\r\nDate: " + upstream.date if upstream.date else b"",
        tail,
        b"\r\nConnection: close" if close else b"",
    )
    return head, chunked, sse
