"""The data plane's HTTP/1.1 text: a request's head read, the data plane's own answers
written, an upstream's answer head rebuilt for the client, an endpoint's address.

Pure (no I/O): the protocol of :mod:`controller.api.dataplane` uses it. What the head's
parser does not take (``None``) goes to aiohttp, which answers it as it would without
the data plane (a 400 for a malformed head, the router's path for a chunked upload).
"""

from __future__ import annotations

import hmac
import json
import math
import re
import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import urlsplit

from controller.api.app import BAD_BEARER_MESSAGE, NO_BEARER_MESSAGE, openai_error_body
from controller.api.router_proxy import REQUEST_DROP, RESPONSE_DROP
from controller.api.router_request import (
    AUDIO_MAX_BYTES,
    AUDIO_TAIL,
    JSON_MAX_BYTES,
    Refusal,
    error_body,
    model_not_found,
    shutting_down,
)
from controller.api.selection import endpoint_of, openai_model
from controller.api.upstream import (
    CHUNKED,
    CLOSE,
    LENGTH,
    Upstream,
    UpstreamError,
)
from controller.api.upstream_head import HEADER_LINES, content_length
from controller.errors import HostNotAllowed

__all__ = [
    "HeadTemplate",
    "RequestHead",
    "address",
    "answer",
    "authorized",
    "early_answer",
    "misdirected",
    "models_answer",
    "parse_head",
    "parse_head_like",
    "refusal_answer",
    "response_head",
    "sse_error_end",
    "unauthorized",
    "upstream_error",
]

_LINE_MAX: Final = 8190  # aiohttp's own line limit: a longer line goes to aiohttp
_JSON_PATHS: Final = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"))
_AUDIO: Final = b"/v1/audio/"
MODELS: Final = b"/v1/models"
# One model of /v1/models by its id, not percent-encoded (that goes to aiohttp, which
# decodes it); an id may hold slashes ("org/model").
_MODEL_PATH: Final = re.compile(rb"/v1/models/[\x21-\x24\x26-\x3e\x40-\x7e]+")
_AUDIO_TAIL: Final = re.compile(AUDIO_TAIL.pattern.encode())  # the router's, on bytes
_TARGET: Final = re.compile(rb"[\x21-\x7e]+")
_REQUEST_DROP: Final = frozenset(h.encode() for h in REQUEST_DROP)
# The upstream's Date passes (aiohttp, which adds its own, drops it); its Server does not.
_RESPONSE_DROP: Final = frozenset(h.encode() for h in RESPONSE_DROP) - {b"date"}
# The lines of the response headers not passed to the client.
_RESPONSE_DROPPED: Final = re.compile(
    rb"\r\n(?:" + b"|".join(re.escape(h) for h in sorted(_RESPONSE_DROP)) + rb"):[^\r]*",
    re.IGNORECASE,
)
# The request headers the parser reads (their lines: the head's lines are well-formed).
_REQUEST_READ: Final = re.compile(
    rb"\r\n(authorization|connection|content-length|content-type|expect|host|"
    rb"transfer-encoding|upgrade):[ \t]*([^\r]*)",
    re.IGNORECASE,
)
# The lines of the request headers not passed upstream (hop-by-hop, credentials).
_REQUEST_DROPPED: Final = re.compile(
    rb"\r\n(?:" + b"|".join(re.escape(h) for h in sorted(_REQUEST_DROP)) + rb"):[^\r]*",
    re.IGNORECASE,
)


@dataclass(slots=True)
class RequestHead:
    """What the data plane reads of a request head."""

    method: bytes  # POST (routed), or GET (/v1/models)
    target: bytes  # path and query, forwarded as they came
    limit: int  # the body limit of the endpoint (413 beyond it)
    length: int  # Content-Length
    forward: bytes  # the header lines passed upstream, each after a CRLF, as they came
    authorization: bytes | None
    content_type: str
    close: bool  # the client sent Connection: close
    expect: bool  # Expect: 100-continue
    host: bytes = b""  # the Host header's value (the DNS-rebinding check)
    endpoint: str | None = None  # what a POST asks for (selection.endpoint_of)


def parse_head(raw: bytes) -> RequestHead | None:
    """The head of a request the data plane serves, or None for aiohttp to serve."""
    first = raw.find(b"\r\n")
    if first < 0:
        first = len(raw)
    parts = raw[:first].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1":
        return None
    method, target = parts[0], parts[1]
    if first > _LINE_MAX or not _TARGET.fullmatch(target):
        return None
    path = target.partition(b"?")[0]
    if method == b"POST" and path in _JSON_PATHS:
        limit = JSON_MAX_BYTES
    elif method == b"POST" and path.startswith(_AUDIO) and _AUDIO_TAIL.fullmatch(path, 10):
        limit = AUDIO_MAX_BYTES
    elif method == b"GET" and (path == MODELS or _MODEL_PATH.fullmatch(path)):
        limit = 0  # no body (a GET with one goes to aiohttp)
    else:
        return None
    # Every header line well-formed (a token, a colon, a value without controls), checked
    # in one pass: a malformed or folded (obs-fold) one goes to aiohttp, which refuses it.
    # Then only the headers read here are looked at; the others pass upstream as they came.
    if not HEADER_LINES.fullmatch(raw, first):
        return None
    if len(raw) > _LINE_MAX and any(len(line) > _LINE_MAX for line in raw.split(b"\r\n")):
        return None  # aiohttp's line limit
    length: int | None = None
    authorization: bytes | None = None
    host: bytes | None = None
    content_type = ""
    close = expect = False
    for name, value in _REQUEST_READ.findall(raw, first):
        lower = name.lower()
        value = value.rstrip(b" \t")
        if lower == b"content-length":
            length = content_length(value, length)
            if length is None:
                return None  # aiohttp refuses it
        elif lower == b"authorization":
            authorization = value
        elif lower == b"host":
            if host is not None:
                return None  # two Host headers: aiohttp's 400
            host = value
        elif lower == b"content-type":
            content_type = value.decode("latin-1")
        elif lower == b"connection":
            close = b"close" in value.lower()
        elif lower == b"expect" and value.lower() == b"100-continue":
            expect = True
        else:  # Transfer-Encoding, Upgrade, another Expect
            return None
    if method == b"GET" and not length and not expect:
        length = 0
    if length is None or host is None:  # HTTP/1.1 without Host: aiohttp's 400
        return None
    forward = _REQUEST_DROPPED.sub(b"", raw[first:])
    endpoint = endpoint_of(path.decode("ascii")) if method == b"POST" else None
    return RequestHead(
        method,
        target,
        limit,
        length,
        forward,
        authorization,
        content_type,
        close,
        expect,
        host,
        endpoint,
    )


@dataclass(slots=True, frozen=True)
class HeadTemplate:
    """A connection's last request head, cut around its one ``Content-Length`` value: a
    client on a kept-alive connection sends the same head again but for that value (an
    SDK's headers do not change between calls), and such a head is read again at the
    cost of a comparison, not of a parse."""

    prefix: bytes
    suffix: bytes
    head: RequestHead


_LENGTH_VALUE: Final = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)", re.IGNORECASE)


def parse_head_like(
    raw: bytes, last: HeadTemplate | None
) -> tuple[RequestHead | None, HeadTemplate | None]:
    """:func:`parse_head` of ``raw`` and the template for the next head; when ``raw`` is
    ``last``'s head with another ``Content-Length`` (digits, as :func:`parse_head` takes
    them), that head with this length, unparsed."""
    if last is not None and raw.startswith(last.prefix) and raw.endswith(last.suffix):
        length = content_length(raw[len(last.prefix) : len(raw) - len(last.suffix)])
        if length is not None and len(raw) <= _LINE_MAX:
            h = last.head
            head = RequestHead(
                h.method,
                h.target,
                h.limit,
                length,
                h.forward,
                h.authorization,
                h.content_type,
                h.close,
                h.expect,
                h.host,
                h.endpoint,
            )
            return head, last
    parsed = parse_head(raw)
    if parsed is None or len(raw) > _LINE_MAX:
        return parsed, None
    values = list(_LENGTH_VALUE.finditer(raw))
    if len(values) != 1:
        return parsed, None  # none (a GET), or repeated: parsed each time
    start, end = values[0].span(1)
    return parsed, HeadTemplate(raw[:start], raw[end:], parsed)


def early_answer(head: RequestHead, *, closing: bool, token: str) -> tuple[bytes, int] | None:
    """The answer given before a request's body is read, with the status to record (0:
    none): a 503 while the router stops; for a body over the endpoint's limit a 413, or
    first the 401 of a request without the token (as aiohttp's: no body read). Each
    closes the connection. None: read the body."""
    if closing:
        return refusal_answer(shutting_down(), close=True), 503
    if head.length <= head.limit:
        return None
    if not authorized(head.authorization, token):
        return unauthorized(head.authorization, close=True), 0
    limit = Refusal(413, f"request body exceeds {head.limit} bytes", code="request_too_large")
    return refusal_answer(limit, close=True), 413


def misdirected(head: RequestHead) -> bytes:
    """The ``421`` of a request whose ``Host`` this listener does not answer (DNS
    rebinding, :mod:`controller.api.hosts`); the connection is closed after it."""
    name = head.host.decode("latin-1")[:100]
    refusal = Refusal(
        421,
        f"this API does not answer to Host {name!r}: use its address or localhost, or add "
        "the name with --allowed-host",
        code=HostNotAllowed.code,
    )
    return refusal_answer(refusal, close=True)


def _bearer(given: bytes | None) -> bytes | None:
    """The bearer token of an ``Authorization`` value (None: none), as the API's auth."""
    if given is None:
        return None
    scheme, _, value = given.partition(b" ")
    value = value.strip()
    return value if scheme.lower() == b"bearer" and value else None


def authorized(given: bytes | None, token: str) -> bool:
    value = _bearer(given)
    return value is not None and hmac.compare_digest(value, token.encode())


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


def models_answer(served: dict[str, str], head: RequestHead) -> bytes:
    """``GET /v1/models`` and ``/v1/models/{id}`` over the ``served`` ids (and their slot
    types), as :mod:`controller.api.router` answers them."""
    path = head.target.partition(b"?")[0]
    if path == MODELS:
        listing = {"object": "list", "data": [openai_model(m, t) for m, t in served.items()]}
        return answer(200, listing, [], close=head.close)
    model_id = path[len(MODELS) + 1 :].decode("ascii")
    kind = served.get(model_id)
    if kind is None:
        return refusal_answer(model_not_found(model_id), close=head.close)
    return answer(200, openai_model(model_id, kind), [], close=head.close)


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


def upstream_error(slot: str, exc: UpstreamError) -> Refusal:
    if exc.unreachable:
        return Refusal(502, f"slot {slot!r} is unreachable: {exc}", code="upstream.unreachable")
    return Refusal(502, f"slot {slot!r} failed to answer: {exc}", code="upstream.failed")


def unauthorized(authorization: bytes | None, *, close: bool) -> bytes:
    """The 401 of the API's auth, in OpenAI's shape."""
    message = NO_BEARER_MESSAGE if _bearer(authorization) is None else BAD_BEARER_MESSAGE
    payload = openai_error_body(401, message, "invalid_api_key")
    return answer(401, payload, [("WWW-Authenticate", 'Bearer realm="slotctl"')], close=close)


def response_head(upstream: Upstream, *, close: bool) -> tuple[bytes, bool, bool]:
    """The client's head of an upstream's answer: ``(head, chunked, event stream)``.
    Hop-by-hop headers go, the others pass as they came; a sized body keeps its length (it
    passes verbatim), a chunked or to-the-end one is re-chunked (a chunk a read)."""
    framing = upstream.framing
    chunked = framing in (CHUNKED, CLOSE)
    if framing == LENGTH:
        tail = b"\r\nContent-Length: %d" % upstream.length
    elif chunked:
        tail = b"\r\nTransfer-Encoding: chunked"
    elif upstream.status not in (204, 304):
        tail = b"\r\nContent-Length: 0"
    else:
        tail = b""
    head = b"HTTP/1.1 %d %s%s%s%s\r\n\r\n" % (
        upstream.status,
        upstream.reason,
        _RESPONSE_DROPPED.sub(b"", upstream.fields),
        tail,
        b"\r\nConnection: close" if close else b"",
    )
    sse = upstream.content_type.lower().startswith(b"text/event-stream")
    return head, chunked, sse
