"""The data plane's own bytes: the answers it gives itself (refusals, the 401, the models
list, the 404 and 405 of a ``/v1`` path it does not hold), an upstream answer's head
rebuilt for the client, an event stream's error end, an endpoint's address.

Pure (no I/O); below :mod:`controller.dataplane.connection`. The refusals are the routed
call's (:mod:`controller.router.refusals`), written as bytes in OpenAI's error shape; an
``HTTP/1.0`` request is answered as ``HTTP/1.0`` (``Connection: keep-alive`` when it
keeps the connection, never a chunked body), as aiohttp answers one.
"""

from __future__ import annotations

import json
import math
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import urlsplit

from controller.access.keys import KeyHold, KeyRing, Principal
from controller.dataplane.recall import AnswerRecall
from controller.dataplane.request import RequestHead
from controller.dataplane.upstream import Framing, Upstream
from controller.router.access import bearer, hold, identify
from controller.router.endpoints import MODELS
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
)

__all__ = [
    "address",
    "answer",
    "early_answer",
    "malformed_body",
    "models_answer",
    "not_routed",
    "principal",
    "principal_held",
    "refusal_answer",
    "response_head",
    "sse_error_end",
    "unauthorized",
]

_RESPONSE_DROP: Final = frozenset(n.decode() for n in RESPONSE_DROP_BYTES)
# Framings as module constants (``Framing.LENGTH`` is a lookup through the enum's metaclass).
_SIZED: Final = Framing.LENGTH
_CHUNKED: Final = Framing.CHUNKED
_TO_CLOSE: Final = Framing.CLOSE


def early_answer(
    head: RequestHead, hosts: HostPolicy, *, closing: bool, keys: KeyRing
) -> tuple[bytes, int] | None:
    """The answer given before a request's body is read, with the status to record (0:
    none): a 421 for a ``Host`` this listener does not answer (before the token: no oracle
    for it), a 503 while the router stops, a 417 for an ``Expect`` other than
    ``100-continue``, a 400 for a transfer coding besides ``chunked`` (the router would
    drop it); for a body over the endpoint's limit a 413, or first the 401 of a request
    without the token (as the API's auth: no body read). Each closes the connection (after
    the body, dropped). None: read the body."""
    old = head.old
    if not hosts.allows_raw(head.host):
        return refusal_answer(misdirected(_latin(head.host)), close=True, old=old), 0
    if closing:
        return refusal_answer(shutting_down(), close=True, old=old), 503
    if head.expect_other:
        refusal = Refusal(417, "only Expect: 100-continue is understood", code="expectation_failed")
        return refusal_answer(refusal, close=True, old=old), 0
    if head.coded:
        refusal = Refusal(
            400, "a transfer coding besides chunked is not supported", code="invalid_request_error"
        )
        return refusal_answer(refusal, close=True, old=old), 0
    if head.length <= head.limit:
        return None
    return over_limit(head, keys)


def over_limit(head: RequestHead, keys: KeyRing) -> tuple[bytes, int]:
    """A body over the endpoint's limit: the 401 of a request without the token first,
    else the 413 (recorded); either closes the connection."""
    if principal(head, keys) is None:
        return unauthorized(head, close=True), 0
    return refusal_answer(too_large(head.limit), close=True, old=head.old), 413


def _latin(value: bytes | None) -> str:
    return value.decode("latin-1") if value is not None else ""


def _text(value: bytes | None) -> str | None:
    # as aiohttp decodes a header (a non-UTF-8 key is a wrong key, never a 500)
    return value.decode("utf-8", "surrogateescape") if value is not None else None


def principal(head: RequestHead, keys: KeyRing) -> Principal | None:
    """Who the request is (the API's auth: a bearer token, else ``x-api-key``)."""
    authorization, api_key = _text(head.authorization), _text(head.api_key)
    return identify(keys, authorization, api_key, time.monotonic(), time.time())


def principal_held(head: RequestHead, keys: KeyRing) -> KeyHold | Principal | None:
    """:func:`principal`, a key's as its :class:`KeyHold` (recognised again by
    ``KeyRing.again`` on a kept-alive connection)."""
    authorization, api_key = _text(head.authorization), _text(head.api_key)
    return hold(keys, authorization, api_key, time.monotonic(), time.time())


def answer(
    status: int,
    payload: dict[str, Any],
    headers: list[tuple[str, str]],
    *,
    close: bool,
    old: bool = False,
) -> bytes:
    """A JSON answer of the data plane's own, whole (``old``: to an ``HTTP/1.0`` request)."""
    body = json.dumps(payload).encode()
    lines = [
        f"HTTP/1.{0 if old else 1} {status} {_reason(status)}",
        f"Date: {_date()}",
        "Content-Type: application/json; charset=utf-8",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers),
    ]
    head = ("\r\n".join(lines)).encode("latin-1") + connection_line(close=close, old=old)
    return head + b"\r\n\r\n" + body


def connection_line(*, close: bool, old: bool) -> bytes:
    """The ``Connection`` header line an answer carries (after a CRLF), if any: ``close``
    from ``HTTP/1.1``, ``keep-alive`` to ``HTTP/1.0`` (which closes by default)."""
    if old:
        return b"" if close else b"\r\nConnection: keep-alive"
    return b"\r\nConnection: close" if close else b""


def refusal_answer(
    refusal: Refusal,
    *,
    close: bool = False,
    old: bool = False,
    headers: tuple[tuple[str, str], ...] = (),
) -> bytes:
    lines = list(headers)
    if refusal.retry_after_s is not None and refusal.retry_after_s > 0:
        lines.append(("Retry-After", str(max(1, math.ceil(refusal.retry_after_s)))))
    body = error_body(refusal.status, refusal.message, refusal.code, refusal.param)
    return answer(refusal.status, body, lines, close=close, old=old)


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
    """``GET /v1/models`` and ``/v1/models/{id}`` (the id percent-decoded) over the
    ``entries`` (the models and aliases served:
    :func:`~controller.router.aliases.model_entries`)."""
    close, old = not head.keep, head.old
    if head.endpoint is MODELS:
        listing = {"object": "list", "data": entries}
        return answer(200, listing, [], close=close, old=old)
    model_id = head.arg
    entry = next((e for e in entries if e["id"] == model_id), None)
    if entry is None:
        return refusal_answer(model_not_found(model_id), close=close, old=old)
    return answer(200, entry, [], close=close, old=old)


def malformed_body(head: RequestHead | None) -> bytes:
    """The 400 of a ``/v1`` request whose body llhttp refuses (a bad chunk): nothing of
    it is said or logged; the connection closes."""
    refusal = Refusal(400, "malformed request body", code="invalid_request_error")
    return refusal_answer(refusal, close=True, old=head is not None and head.old)


def not_routed(head: RequestHead) -> bytes:
    """The 404 of a ``/v1`` path the router does not hold, or the 405 of a method its
    path does not take (with ``Allow``), in OpenAI's shape (as the API answers them)."""
    method, path = head.method.decode("latin-1"), head.path
    if head.allow:
        refusal = Refusal(405, f"Method Not Allowed ({method} {path})", code="method_not_allowed")
        headers: tuple[tuple[str, str], ...] = (("Allow", ",".join(head.allow)),)
    else:
        refusal = Refusal(404, f"Invalid URL ({method} {path})", code="not_found")
        headers = ()
    return refusal_answer(refusal, close=not head.keep, old=head.old, headers=headers)


def sse_error_end(refusal: Refusal, *, chunked: bool = True) -> bytes:
    """An event stream's end after a failure: its last event says why (OpenAI's error
    shape), then the last chunk (``chunked``; else the connection's end says it)."""
    event = (
        b"data: "
        + json.dumps(error_body(refusal.status, refusal.message, refusal.code)).encode()
        + b"\n\n"
    )
    if not chunked:
        return event
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
    headers = [("WWW-Authenticate", 'Bearer realm="slotctl"')]
    return answer(401, payload, headers, close=close, old=head.old)


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


def _passed_of(upstream: Upstream, recalled: AnswerRecall | None) -> tuple[bytes, bool]:
    """The lines an answer passes and whether it is an event stream (a recalled head's
    last answer's: known)."""
    passed = recalled.passed if recalled is not None else None
    if passed is None:
        passed = _lines(upstream.status, upstream.reason, upstream.fields)
        if recalled is not None:
            recalled.passed = passed
    return passed


def response_head(upstream: Upstream, *, close: bool, old: bool) -> tuple[bytes, bool, bool]:
    """The client's head of an upstream's answer: ``(head, chunked, event stream)``.
    Hop-by-hop headers (and those ``Connection`` names) go, the others pass in the order
    they came, the upstream's Date after them; a sized body keeps its length (it passes
    verbatim), a chunked or to-the-end one is re-chunked (a chunk a read) — to an
    ``HTTP/1.0`` client it passes as it comes, to the end of the connection (``close``
    must then be True). A recalled sized answer's head is the last one's but for its Date
    and length: its lines before and after them are kept with the recall."""
    recalled = upstream.recalled
    if recalled is not None and upstream.length:  # sized, with a body (Content-Length)
        made = recalled.made
        if made is None or made[0] is not close or made[1] is not old:
            lines, sse = _passed_of(upstream, recalled)
            before = b"HTTP/1.%d %d %s%s" % (
                0 if old else 1,
                upstream.status,
                upstream.reason,
                lines,
            )
            after = connection_line(close=close, old=old) + b"\r\n\r\n"
            made = recalled.made = (close, old, before, after, sse)
        date = upstream.date
        if date:
            head = b"%s\r\nDate: %s\r\nContent-Length: %d%s" % (
                made[2],
                date,
                upstream.length,
                made[3],
            )
        else:
            head = b"%s\r\nContent-Length: %d%s" % (made[2], upstream.length, made[3])
        return head, False, made[4]
    framing = upstream.framing
    chunked = framing is _CHUNKED or framing is _TO_CLOSE
    if framing is _SIZED:
        tail = b"\r\nContent-Length: %d" % upstream.length
    elif chunked:
        tail = b"" if old else b"\r\nTransfer-Encoding: chunked"
    elif upstream.status not in (204, 304):
        tail = b"\r\nContent-Length: 0"
    else:
        tail = b""
    lines, sse = _passed_of(upstream, recalled)
    head = b"HTTP/1.%d %d %s%s%s%s%s\r\n\r\n" % (
        0 if old else 1,
        upstream.status,
        upstream.reason,
        lines,
        b"\r\nDate: " + upstream.date if upstream.date else b"",
        tail,
        connection_line(close=close, old=old),
    )
    return head, chunked and not old, sse
