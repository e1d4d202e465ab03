"""A client connection's requests read with llhttp (``httptools``, the binding uvicorn
uses), and whether the data plane takes each one.

Part of the router's data plane (:mod:`controller.dataplane.connection` feeds it).
:class:`RequestReader` is the parser's callback object: it keeps what the data plane needs
of one request (the head's fields, the body) and the bytes of a head still coming (what is
handed to aiohttp if the data plane does not take it). Every verdict on the bytes is
llhttp's (strict: no leniency set): a malformed head, a conflicting ``Content-Length``, a
bare LF, an obs-fold, a NUL, a version other than 0.9, 1.0, 1.1 — each ends the reading as
:data:`Got.FOREIGN`, and aiohttp (which parses with llhttp too) answers the ``400``. What
the data plane takes (:func:`head_of`) is routing's choice, not a parse: ``HTTP/1.1``, one
``Host``, a ``Content-Length`` body (a chunked upload goes to aiohttp), the routed
endpoints; anything else is foreign too.

llhttp parses on past a request's end into the next; the reader stops it there (a
callback's exception, the parser then replaced) when bytes of a pipelined request follow
in the same read, and gives them back (:attr:`RequestReader.rest`) for their turn.

A kept-alive client sends the same head again but for its ``Content-Length`` (an SDK's
requests): the reader keeps the bytes of the last head it took (:class:`_Recall`), and a
head that is those bytes exactly, but for the digits of its length, gets that head's
verdict again without llhttp's callbacks (one per field and event). The same bytes get
the same verdict: the digits are 1 to 18 of ``0-9`` (no overflow), the lines stay under
aiohttp's limit, and the head starts the read (no empty lines before it); any other byte
that differs goes through llhttp. The body that follows is ``Content-Length`` bytes, as
llhttp reads it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final

from httptools import HttpParserError, HttpParserUpgrade, HttpRequestParser
from httptools.parser.errors import HttpParserCallbackError

from controller.router.body import AUDIO_MAX_BYTES, AUDIO_TAIL, JSON_MAX_BYTES
from controller.router.headers import REQUEST_DROP_BYTES, connection_names, passes
from controller.router.selection import endpoint_of

__all__ = ["Got", "RequestHead", "RequestReader", "head_of", "parse_head"]

HEAD_MAX: Final = 64 * 1024  # a longer head goes to aiohttp (which refuses it)
_LINE_MAX: Final = 8190  # aiohttp's own line limit: a head with a longer line goes to aiohttp
_GET_LIMIT: Final = 1 << 62  # a GET's body is read and dropped, as aiohttp's router does
_JSON_PATHS: Final = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"))
_AUDIO: Final = b"/v1/audio/"
MODELS: Final = b"/v1/models"
# One model of /v1/models by its id, not percent-encoded (that goes to aiohttp, which
# decodes it); an id may hold slashes ("org/model").
_MODEL_PATH: Final = re.compile(rb"/v1/models/[\x21-\x24\x26-\x3e\x40-\x7e]+")
_AUDIO_TAIL: Final = re.compile(AUDIO_TAIL.pattern.encode())  # the router's, on bytes
_TARGET: Final = re.compile(rb"/[\x21-\x7e]*")  # origin-form only, printable ASCII
_CONTENT_LENGTH: Final = b"content-length"
_LENGTH_LINE: Final = b"\r\ncontent-length:"
_DIGITS: Final = re.compile(rb"[0-9]{1,18}")  # a length llhttp takes (no uint64 overflow)


class Got(enum.Enum):
    """What a read gave (:meth:`RequestReader.feed`)."""

    MORE = "more"  # nothing whole yet
    HEAD = "head"  # a head the data plane takes; its body still coming
    REQUEST = "request"  # a whole request (head and body)
    FOREIGN = "foreign"  # not the data plane's (or malformed): aiohttp's from here on


@dataclass(slots=True)
class RequestHead:
    """What the data plane reads of a request head."""

    method: bytes  # POST (routed), or GET (/v1/models)
    target: bytes  # path and query, forwarded as they came
    limit: int  # the body limit of the endpoint (413 beyond it)
    length: int  # Content-Length
    forward: bytes  # the header lines passed upstream, each after a CRLF
    authorization: bytes | None
    content_type: str
    keep: bool  # llhttp's verdict: the client keeps the connection after this request
    expect: bool  # Expect: 100-continue
    host: bytes = b""  # the Host header's value (the DNS-rebinding check)
    endpoint: str | None = None  # what a POST asks for (selection.endpoint_of)
    api_key: bytes | None = None  # x-api-key (a key sent as other servers' clients do)
    priority: bytes | None = None  # X-Slotctl-Priority (a lower class for this request)


@dataclass(slots=True, frozen=True)
class _Fields:
    """What a head's other fields say, once (a kept-alive client sends the same again)."""

    forward: bytes
    authorization: bytes | None
    content_type: str
    expect: bool
    host: bytes | None
    foreign: bool
    api_key: bytes | None = None
    priority: bytes | None = None


def _fields_of(fields: list[tuple[bytes, bytes]]) -> _Fields:
    authorization: bytes | None = None
    api_key: bytes | None = None
    priority: bytes | None = None
    host: bytes | None = None
    content_type = ""
    expect = foreign = False
    named: frozenset[str] = frozenset()
    fields = [(name, value.rstrip(b" \t")) for name, value in fields]  # llhttp keeps OWS after
    for name, value in fields:
        lower = name.lower()
        if lower == b"authorization":
            authorization = value
        elif lower == b"x-api-key":
            api_key = value
        elif lower == b"x-slotctl-priority":
            priority = value
        elif lower == b"host":
            foreign = foreign or host is not None  # two: aiohttp's (and h11's) 400
            host = value
        elif lower == b"content-type":
            content_type = value.decode("latin-1")
        elif lower == b"connection":
            named |= connection_names([value.decode("latin-1")])
        elif lower == b"expect":
            expect = value.lower() == b"100-continue"
            foreign = foreign or not expect  # another Expect: aiohttp's 417
        elif lower in (b"transfer-encoding", b"upgrade"):
            foreign = True  # a chunked upload, an upgrade: aiohttp's
    forward = b"".join(
        b"\r\n%s: %s" % (name, value)
        for name, value in fields
        if passes(name.lower().decode("latin-1"), _REQUEST_DROP, named)
    )
    return _Fields(forward, authorization, content_type, expect, host, foreign, api_key, priority)


_REQUEST_DROP: Final = frozenset(n.decode() for n in REQUEST_DROP_BYTES)


def _limit_of(method: bytes, path: bytes) -> int:
    """The body limit of a routed endpoint; -1: not one the data plane serves."""
    if method == b"POST" and path in _JSON_PATHS:
        return JSON_MAX_BYTES
    if method == b"POST" and path.startswith(_AUDIO) and _AUDIO_TAIL.fullmatch(path, 10):
        return AUDIO_MAX_BYTES
    if method == b"GET" and (path == MODELS or _MODEL_PATH.fullmatch(path)):
        return _GET_LIMIT
    return -1


def head_of(method: bytes, target: bytes, version: str, fields: _Fields) -> RequestHead | None:
    """The head of a request the data plane takes, or None (aiohttp's); its ``length``
    and ``keep`` are the reader's to set (they change from one request to the next)."""
    if version != "1.1" or not _TARGET.fullmatch(target) or fields.foreign:
        return None
    path = target.partition(b"?")[0]
    limit = _limit_of(method, path)
    if limit < 0 or fields.host is None:  # HTTP/1.1 without Host: aiohttp's 400
        return None
    endpoint = endpoint_of(path.decode("ascii")) if method == b"POST" else None
    return RequestHead(
        method,
        target,
        limit,
        0,
        fields.forward,
        fields.authorization,
        fields.content_type,
        True,
        fields.expect,
        fields.host,
        endpoint,
        fields.api_key,
        fields.priority,
    )


def _long_line(head: bytes) -> bool:
    """A line longer than aiohttp's limit (which refuses it)."""
    return any(len(line) > _LINE_MAX for line in head.split(b"\r\n"))


class _Stop(Exception):
    """Raised from a callback to stop llhttp (at a head not taken, or a request's end)."""


@dataclass(slots=True, frozen=True)
class _Recall:
    """The bytes of a head llhttp read and the data plane took, split around the digits
    of its ``Content-Length`` (``suffix`` None: it had none, ``prefix`` is all of it,
    the blank line included), with what llhttp said of it."""

    prefix: bytes
    suffix: bytes | None
    head: RequestHead
    keep: bool


def _recall_of(raw: bytes, head: RequestHead, keep: bool, length: int | None) -> _Recall | None:
    """What to recall of the head ``raw`` (its bytes from the read's start to its blank
    line); None: not recalled (a line could grow past aiohttp's limit)."""
    if len(raw) + 18 > _LINE_MAX:
        return None
    if length is None:
        return _Recall(raw, None, head, keep)
    at = raw.lower().find(_LENGTH_LINE)  # one: llhttp refuses a second Content-Length
    if at < 0:
        return None
    start = at + len(_LENGTH_LINE)
    while raw[start : start + 1] in (b" ", b"\t"):
        start += 1
    found = _DIGITS.match(raw, start)
    if found is None or int(found.group()) != length:
        return None
    return _Recall(raw[:start], raw[found.end() :], head, keep)


class RequestReader:
    """One connection's requests, one at a time, through llhttp (see the module docstring).

    After :meth:`feed` gives :data:`Got.HEAD` or :data:`Got.REQUEST`, :attr:`head` is the
    request's head (:attr:`fresh`: it came in this read); after :data:`Got.REQUEST`,
    :attr:`body` its body and :attr:`rest` the bytes after it; after :data:`Got.FOREIGN`,
    :attr:`raw` every byte of the request fed so far."""

    __slots__ = (
        "_before",
        "_data",
        "_fields",
        "_head_len",
        "_last",
        "_left",
        "_length",
        "_parser",
        "_pieces",
        "_recall",
        "_stop",
        "_url",
        "body",
        "fresh",
        "head",
        "raw",
        "rest",
    )

    def __init__(self) -> None:
        self._parser = HttpRequestParser(self)
        # The last head, by (method, target, version) and header fields: its RequestHead.
        self._last: (
            tuple[tuple[bytes, bytes, str], list[tuple[bytes, bytes]], RequestHead | None] | None
        ) = None
        self._recall: _Recall | None = None  # the last head taken, by its bytes
        self.head: RequestHead | None = None
        self.body = b""
        self.rest = b""
        self.raw = b""
        self.fresh = False
        self._begin()

    def _begin(self) -> None:
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._length: int | None = None
        self._pieces: list[bytes] = []
        self._head_len = 0
        self._left = 0  # a recalled head's body: bytes still to come (llhttp not fed)
        self._before = 0  # bytes of this request fed before this read
        self._stop: Got | None = None
        self._data = b""

    # ------------------------------------------------------------------ llhttp's callbacks

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 14 and name.lower() == _CONTENT_LENGTH:
            self._length = int(value)  # digits, llhttp checked (and refused a second one)
        else:
            self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser, raw = self._parser, self.raw
        start = len(raw) - len(raw.lstrip(b"\r\n"))  # llhttp skips empty lines before it
        self._head_len = head_len = raw.find(b"\r\n\r\n", start) + 4
        key = (parser.get_method(), self._url, parser.get_http_version())
        memo, fields = self._last, self._fields
        if memo is not None and memo[0] == key and memo[1] == fields:
            head = memo[2]  # the same head as the last one but its length (an SDK's)
        else:
            head = head_of(*key, _fields_of(fields))
            self._last = (key, fields, head)
        length = self._length
        if (
            head is None
            or (length is None and key[0] != b"GET")  # a POST without a length: aiohttp's
            or (head_len > _LINE_MAX and _long_line(raw[start:head_len]))
        ):
            self._stop = Got.FOREIGN
            raise _Stop
        # One head object a connection, reused: a request is read only once the one
        # before it ended (RequestReader.done), so nothing holds the last one's values.
        head.length = length or 0
        head.keep = keep = parser.should_keep_alive()
        self.head, self.fresh = head, True
        if start == 0:
            self._recall = _recall_of(raw[:head_len], head, keep, length)

    def on_body(self, body: bytes) -> None:
        head = self.head
        if head is not None and head.method == b"POST":
            self._pieces.append(body)  # a GET's body is dropped

    def on_message_complete(self) -> None:
        end = self._head_len + (self._length or 0) - self._before
        if end < len(self._data):  # a pipelined request follows: its turn comes later
            self.rest = self._data[end:]
            self._stop = Got.REQUEST
            raise _Stop
        self._stop = Got.REQUEST

    # ------------------------------------------------------------------ reading

    def feed(self, data: bytes) -> Got:
        """Read ``data`` (see the class docstring)."""
        self.fresh, self.rest = False, b""
        if self._left:
            return self._more_body(data)
        if self.head is None and not self.raw and self._recall is not None:
            got = self._recalled(data, self._recall)
            if got is not None:
                return got
        return self._parse(data)

    def _parse(self, data: bytes) -> Got:
        """``data`` read by llhttp."""
        if self.head is None:  # the head still coming: kept for a hand-over
            self.raw = self.raw + data if self.raw else data
            if len(self.raw) > HEAD_MAX and b"\r\n\r\n" not in self.raw:
                return Got.FOREIGN
        self._data = data
        try:
            self._parser.feed_data(data)
        except HttpParserUpgrade:
            return Got.FOREIGN
        except HttpParserCallbackError as exc:
            if self._stop is None:  # a bug in a callback, not the client's bytes
                raise exc.__context__ or exc from None
            self._parser = HttpRequestParser(self)  # stopped: a fresh one for the next
        except HttpParserError:
            if self._stop is None:
                return Got.FOREIGN  # malformed: aiohttp refuses it (400)
            self._parser = HttpRequestParser(self)  # stopped: a fresh one for the next
        self._data = b""
        got = self._stop
        if got is Got.FOREIGN:
            return got
        if got is Got.REQUEST:
            pieces = self._pieces
            self.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            rest = self.rest
            self.raw = b""
            self._begin()
            self.rest = rest
            return got
        self._before += len(data)
        return Got.MORE if self.head is None else Got.HEAD

    def _recalled(self, data: bytes, recall: _Recall) -> Got | None:
        """``data`` read as the recalled head and its body; None: another head (llhttp's)."""
        prefix, suffix = recall.prefix, recall.suffix
        if not data.startswith(prefix):
            return None
        if suffix is None:
            length, end = None, len(prefix)
        else:
            digits = _DIGITS.match(data, len(prefix))
            if digits is None or not data.startswith(suffix, digits.end()):
                return None
            length, end = int(digits.group()), digits.end() + len(suffix)
        head = recall.head
        head.length = size = length or 0
        head.keep = recall.keep
        self.head, self.fresh, self._length, self._head_len = head, True, length, end
        need = end + size
        if len(data) >= need:
            self.body = data[end:need] if head.method == b"POST" else b""
            self._begin()
            self.rest = data[need:]
            return Got.REQUEST
        if head.method == b"POST":
            self._pieces.append(data[end:])
        self._before, self._left = len(data), need - len(data)
        return Got.HEAD

    def _more_body(self, data: bytes) -> Got:
        """More of a recalled head's body (see :meth:`_recalled`)."""
        left, post = self._left, self.head is not None and self.head.method == b"POST"
        if len(data) < left:
            if post:
                self._pieces.append(data)
            self._before += len(data)
            self._left = left - len(data)
            return Got.HEAD
        if post:
            self._pieces.append(data[:left])
        pieces = self._pieces
        self.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self._begin()
        self.rest = data[left:]
        return Got.REQUEST

    def body_seen(self) -> int:
        """How many bytes of the current request's body were read (after :data:`Got.HEAD`)."""
        return min(self._length or 0, max(0, self._before - self._head_len))

    def done(self) -> None:
        """The request was taken from :attr:`head` and :attr:`body`: the next one's turn."""
        self.head, self.body = None, b""


def parse_head(raw: bytes) -> RequestHead | None:
    """The head of ``raw`` (a head without its blank line) when the data plane takes it."""
    reader = RequestReader()
    got = reader.feed(raw + b"\r\n\r\n")
    return reader.head if got in (Got.HEAD, Got.REQUEST) else None
