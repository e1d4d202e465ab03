"""A client connection's requests read with llhttp (``httptools``, the binding uvicorn
uses): each ``/v1`` request taken by the data plane, every other request passed to
aiohttp, byte for byte, and a head llhttp refuses handed over.

Part of the router's data plane (:mod:`controller.dataplane.connection` feeds it).
:class:`RequestReader` is the parser's callback object. Every verdict on the bytes is
llhttp's (strict: no leniency set): a malformed head, a conflicting ``Content-Length``, a
bare LF, an obs-fold, a NUL, a version other than 0.9, 1.0, 1.1, a bad chunk — each ends
the reading as :data:`Got.FOREIGN`, and aiohttp (whose parser is llhttp too) answers the
``400`` without a word of the bytes (:mod:`controller.api.refused`); so do two ``Host``
headers, none in ``HTTP/1.1``, a line longer than aiohttp's limit and an upgrade.

A request llhttp reads whole is the data plane's when its path is ``/v1`` or below
(:func:`~controller.router.endpoints.is_v1`, percent-decoded, origin or absolute form),
whatever its version, framing or endpoint (:class:`RequestHead`: the endpoint it matches,
or the 404/405 the connection answers); any other is passed to aiohttp (:data:`Got.PASSING`
and :data:`Got.PASSED`: its bytes as they come, cut at its end). A body is read as llhttp
frames it: ``Content-Length`` bytes, or chunked (de-chunked by llhttp; the data plane
sends it upstream with a ``Content-Length``).

llhttp parses on past a request's end into the next; the reader stops it there and gives
back the bytes after it (:attr:`RequestReader.rest`) for their turn. Where the end is:
``Content-Length`` says it; a chunked body is fed to llhttp in pieces cut after each CRLF
(a message ends with one), so the piece after which llhttp says "complete" ends exactly
there.

A kept-alive client sends the same head again but for its ``Content-Length`` (an SDK's
requests): the reader keeps the bytes of the last ``/v1`` head it took (:class:`_Recall`),
and a head that is those bytes exactly, but for the digits of its length, gets that head's
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
from urllib.parse import unquote

from httptools import HttpParserError, HttpParserUpgrade, HttpRequestParser
from httptools.parser.errors import HttpParserCallbackError

from controller.router.endpoints import AUDIO_TAIL, Endpoint, Read, is_v1, match
from controller.router.headers import REQUEST_DROP_BYTES, connection_names, passes

__all__ = ["Got", "RequestHead", "RequestReader", "parse_head"]

HEAD_MAX: Final = 64 * 1024  # a longer head goes to aiohttp (which refuses it)
_LINE_MAX: Final = 8190  # aiohttp's own line limit: a head with a longer line goes to aiohttp
_CONTENT_LENGTH: Final = b"content-length"
_TRANSFER_ENCODING: Final = b"transfer-encoding"
_LENGTH_LINE: Final = b"\r\ncontent-length:"
_DIGITS: Final = re.compile(rb"[0-9]{1,18}")  # a length llhttp takes (no uint64 overflow)
_ABSOLUTE: Final = re.compile(rb"https?://[^/?#]*", re.IGNORECASE)  # absolute form's prefix


class Got(enum.Enum):
    """What a read gave (:meth:`RequestReader.feed`)."""

    MORE = "more"  # nothing whole yet
    HEAD = "head"  # a /v1 head taken; its body still coming
    REQUEST = "request"  # a whole /v1 request (head and body)
    PASSING = "passing"  # bytes of a request for aiohttp (``passed``); more of it to come
    PASSED = "passed"  # the last bytes of a request for aiohttp (``passed``); ``rest`` after
    FOREIGN = "foreign"  # refused (or an upgrade): aiohttp's for good, from ``raw``


# As module constants in the hot path (``Got.MORE`` is a lookup through the enum's
# metaclass, ~70 ns).
_MORE: Final = Got.MORE
_HEAD: Final = Got.HEAD
_REQUEST: Final = Got.REQUEST
_PASSING: Final = Got.PASSING
_PASSED: Final = Got.PASSED
_FOREIGN: Final = Got.FOREIGN


@dataclass(slots=True)
class RequestHead:
    """What the data plane reads of a ``/v1`` request head."""

    method: bytes
    target: bytes  # what goes upstream: the (decoded) path and the query as it came
    endpoint: Endpoint | None  # None: no endpoint here (``allow``: 405's methods, or 404)
    kind: str  # what a routed request asks of a slot ("": an invalid audio path)
    arg: str  # the path's argument: a model id (percent-decoded), an audio tail
    allow: tuple[str, ...]
    limit: int  # the body limit of the endpoint (413 beyond it)
    forward: bytes  # the header lines passed upstream, each after a CRLF
    authorization: bytes | None
    content_type: str
    expect: bool  # Expect: 100-continue
    expect_other: bool  # another Expect (417)
    coded: bool  # a transfer coding besides chunked (400: it would be lost)
    host: bytes | None  # the Host header's value (the DNS-rebinding check)
    api_key: bytes | None  # x-api-key (a key sent as other servers' clients do)
    priority: bytes | None  # X-Slotctl-Priority (a lower class for this request)
    path: str  # the decoded path (an answer's words)
    old: bool  # HTTP/1.0: answered as 1.0, never re-chunked
    collects: bool = False  # its body is read whole (a routed POST's); others' dropped
    forms: bool = False  # its model may be a multipart form's field (Read.FORM_OR_JSON)
    # Set by the reader for each request (they change from one request to the next):
    length: int = 0  # Content-Length (-1: chunked)
    keep: bool = True  # llhttp's verdict: the client keeps the connection after this request
    # The Host policy that let this head's fields through (its length is checked anew
    # each time): a kept-alive client's repeated head is not judged again.
    cleared: object = None
    # X-Slotctl-Priority's value as the routed call takes it (made once a head: a
    # kept-alive client's repeated head is recalled, not decoded again)
    asked: str | None = None

    def __post_init__(self) -> None:
        priority = self.priority
        self.asked = priority.decode("latin-1") if priority is not None else None


@dataclass(slots=True, frozen=True)
class _Fields:
    """What a head's other fields say, once (a kept-alive client sends the same again)."""

    forward: bytes
    authorization: bytes | None
    content_type: str
    expect: bool
    expect_other: bool
    coded: bool
    host: bytes | None
    hosts: int
    api_key: bytes | None = None
    priority: bytes | None = None


def _fields_of(fields: list[tuple[bytes, bytes]]) -> _Fields:
    authorization: bytes | None = None
    api_key: bytes | None = None
    priority: bytes | None = None
    host: bytes | None = None
    content_type = ""
    hosts = 0
    expect = expect_other = coded = False
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
            hosts += 1
            host = value
        elif lower == b"content-type":
            content_type = value.decode("latin-1")
        elif lower == b"connection":
            named |= connection_names([value.decode("latin-1")])
        elif lower == b"expect":
            if value.lower() == b"100-continue":
                expect = True
            else:
                expect_other = True
        elif lower == _TRANSFER_ENCODING:
            coded = coded or value.strip().lower() != b"chunked"
    forward = b"".join(
        b"\r\n%s: %s" % (name, value)
        for name, value in fields
        if passes(name.lower().decode("latin-1"), _REQUEST_DROP, named)
    )
    return _Fields(
        forward,
        authorization,
        content_type,
        expect,
        expect_other,
        coded,
        host,
        hosts,
        api_key,
        priority,
    )


_REQUEST_DROP: Final = frozenset(n.decode() for n in REQUEST_DROP_BYTES)


def _path_of(target: bytes) -> tuple[str, bytes]:
    """The decoded path of a request target and the target's origin form (an absolute
    form's scheme and authority cut)."""
    if not target.startswith(b"/"):
        absolute = _ABSOLUTE.match(target)
        if absolute is None:
            return "", target  # "*" (OPTIONS), or not a path: not the router's
        target = target[absolute.end() :] or b"/"
        if not target.startswith(b"/"):
            target = b"/" + target
    raw = target.partition(b"?")[0].decode("latin-1")
    return (unquote(raw, errors="replace") if "%" in raw else raw), target


def head_of(method: bytes, target: bytes, version: str, fields: _Fields) -> RequestHead | None:
    """The head of a ``/v1`` request, or None: not one (aiohttp's)."""
    path, target = _path_of(target)
    if not is_v1(path):
        return None
    found = match(method.decode("latin-1"), path)
    endpoint, kind = found.endpoint, found.kind
    if endpoint is not None and endpoint.routed:
        path_part, sep, query = target.partition(b"?")
        if "%" in path_part.decode("latin-1"):  # upstream: the decoded path
            target = path.encode("utf-8") + (b"?" + query if sep else b"")
        if endpoint.kind == "audio" and not AUDIO_TAIL.fullmatch(found.arg):
            kind = ""  # refused before any lease or load (the routed call says why)
    return RequestHead(
        method,
        target,
        endpoint,
        kind,
        found.arg,
        found.allow,
        endpoint.limit if endpoint is not None else 1 << 62,
        fields.forward,
        fields.authorization,
        fields.content_type,
        fields.expect,
        fields.expect_other,
        fields.coded,
        fields.host,
        fields.api_key,
        fields.priority,
        path,
        version != "1.1",
        endpoint is not None and endpoint.routed,
        endpoint is not None and endpoint.read is Read.FORM_OR_JSON,
    )


def _long_line(head: bytes) -> bool:
    """A line longer than aiohttp's limit (which refuses it)."""
    return any(len(line) > _LINE_MAX for line in head.split(b"\r\n"))


class _Stop(Exception):
    """Raised from a callback to stop llhttp (at a head not taken, a request's end, a
    chunked body to be fed in pieces)."""


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
    :attr:`body` its body and :attr:`rest` the bytes after it; after :data:`Got.PASSING` or
    :data:`Got.PASSED`, :attr:`passed` the request's bytes for aiohttp (and, after
    PASSED, :attr:`rest`); after :data:`Got.FOREIGN`, :attr:`raw` every byte of the
    request fed so far."""

    __slots__ = (
        "_before",
        "_chunked",
        "_complete",
        "_data",
        "_fields",
        "_head_len",
        "_last",
        "_left",
        "_length",
        "_parser",
        "_passing",
        "_pieces",
        "_recall",
        "_sliced",
        "_stop",
        "_url",
        "body",
        "fresh",
        "head",
        "over",
        "passed",
        "raw",
        "rest",
        "size",
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
        self.passed = b""
        self.fresh = False
        self.over = False  # a chunked body went past the endpoint's limit (413)
        self._sliced = False  # a chunked body: fed in pieces cut after each CRLF
        self._begin()

    def _begin(self) -> None:
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._length: int | None = None
        self._chunked = False
        self._pieces: list[bytes] = []
        self.size = 0  # body bytes read (llhttp's: de-chunked)
        self._head_len = 0
        self._left = 0  # a recalled head's body: bytes still to come (llhttp not fed)
        self._before = 0  # bytes of this request fed before this read
        self._stop: Got | None = None
        self._complete = False
        self._passing = False  # aiohttp's request: its bytes are passed on
        self._data = b""

    # ------------------------------------------------------------------ llhttp's callbacks

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name)
        if size == 14 and name.lower() == _CONTENT_LENGTH:
            self._length = int(value)  # digits, llhttp checked (and refused a second one)
            return
        if size == 17 and name.lower() == _TRANSFER_ENCODING:
            self._chunked = True  # llhttp took it: chunked is the last coding
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser, raw = self._parser, self.raw
        start = len(raw) - len(raw.lstrip(b"\r\n"))  # llhttp skips empty lines before it
        self._head_len = head_len = raw.find(b"\r\n\r\n", start) + 4
        if head_len > _LINE_MAX and _long_line(raw[start:head_len]):
            self._stop = _FOREIGN  # aiohttp refuses it
            raise _Stop
        if self._chunked and not self._sliced:
            self._stop = _MORE  # fed again, in pieces: see _parse
            raise _Stop
        key = (parser.get_method(), self._url, parser.get_http_version())
        memo, fields = self._last, self._fields
        if memo is not None and memo[0] == key and memo[1] == fields:
            head = memo[2]  # the same head as the last one but its length (an SDK's)
        else:
            parsed = _fields_of(fields)
            if parsed.hosts > 1 or (parsed.hosts == 0 and key[2] == "1.1"):
                self._stop = _FOREIGN  # aiohttp's parser refuses both (and h11)
                raise _Stop
            head = head_of(*key, parsed)
            self._last = (key, fields, head)
        if head is None:  # not the router's: aiohttp's, its bytes passed
            self._passing = True
            self.head = None
            return
        # One head object a connection, reused: a request is read only once the one
        # before it ended (RequestReader.done), so nothing holds the last one's values.
        length = self._length
        head.length = -1 if self._chunked else (length or 0)
        head.keep = keep = parser.should_keep_alive()
        self.head, self.fresh = head, True
        if start == 0 and not self._chunked:
            self._recall = _recall_of(raw[:head_len], head, keep, length)

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        head = self.head
        if head is None:
            return  # aiohttp's request: its bytes are passed, not kept
        if self.size > head.limit:
            self.over = True  # dropped: refused with a 413
        elif head.collects:
            self._pieces.append(body)  # a GET's body is dropped

    def on_message_complete(self) -> None:
        self._complete = True
        if self._sliced:
            return  # the piece fed ends here (see _feed_sliced)
        end = self._head_len + (self._length or 0) - self._before
        if end < len(self._data):  # a pipelined request follows: its turn comes later
            self.rest = self._data[end:]
            self._stop = _REQUEST
            raise _Stop
        self._stop = _REQUEST

    # ------------------------------------------------------------------ reading

    def feed(self, data: bytes) -> Got:
        """Read ``data`` (see the class docstring). A read that starts with the recalled
        head's bytes before its length is read here as that head and its body, when it is
        (the head's bytes, then the length's digits and the rest of the head exactly):
        llhttp's state is not touched; any other goes to llhttp."""
        self.fresh, self.rest, self.passed = False, b"", b""
        if self._left:
            return self._more_body(data)
        recall = self._recall
        if (
            recall is None
            or not data.startswith(recall.prefix)
            or self.head is not None
            or self.raw
            or self._passing
        ):
            return self._parse(data)
        # The recalled head (in line: a request's code runs from cold caches, where each
        # function more it touches costs; docs/performance.md, the router).
        suffix = recall.suffix
        if suffix is None:
            length, end = None, len(recall.prefix)
            size = 0
        else:
            digits = _DIGITS.match(data, len(recall.prefix))
            if digits is None:
                return self._parse(data)
            at = digits.end()
            if not data.startswith(suffix, at):
                return self._parse(data)
            length = size = int(digits.group())
            end = at + len(suffix)
        head = recall.head
        head.length = size
        head.keep = recall.keep
        self.head = head
        self.fresh = True
        need = end + size
        if len(data) >= need:  # the whole request: llhttp's state was not touched
            self.body = data[end:need] if head.collects else b""
            self.rest = data[need:]
            return _REQUEST
        self._length, self._head_len = length, end
        self.size = len(data) - end
        if head.collects:
            self._pieces.append(data[end:])
        self._before, self._left = len(data), need - len(data)
        return _HEAD

    def _parse(self, data: bytes) -> Got:
        """``data`` read by llhttp."""
        heading = self.head is None and not self._passing
        if heading:  # the head still coming: kept for a hand-over
            self.raw = self.raw + data if self.raw else data
            if len(self.raw) > HEAD_MAX and b"\r\n\r\n" not in self.raw:
                return _FOREIGN
        self._data = data
        got = self._run(data)
        if got is None and self._stop is _MORE:  # a chunked body: again, in pieces
            self._parser = HttpRequestParser(self)
            raw, before = self.raw, self._before
            self._url, self._fields, self._length, self._chunked = b"", [], None, False
            self._stop, self._sliced, self._before, self._data = None, True, 0, raw
            got = self._run(raw)
            self._before = before
            data = raw  # the request's bytes so far, its head's included
        self._data = b""
        if got is not None:
            return got
        got = self._stop
        if got is _FOREIGN:
            return got
        passing = self._passing
        if got is _REQUEST:
            rest = self.rest
            if passing:
                self.passed = self._passed_of(data, rest)
            else:
                pieces = self._pieces
                self.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            self.raw = b""
            self._sliced = False
            self._begin()
            self.rest = rest
            return _PASSED if passing else _REQUEST
        self._before += len(data)
        if passing:
            self.passed = self._passed_of(data, b"")
            return _PASSING
        return _MORE if self.head is None else _HEAD

    def _passed_of(self, data: bytes, rest: bytes) -> bytes:
        """The bytes of aiohttp's request in this read: its head's bytes before it, once."""
        end = len(data) - len(rest)
        if self.raw:  # the head completed in this read: every byte of it
            raw, self.raw = self.raw, b""
            return raw[: len(raw) - len(data) + end]
        return data[:end] if rest else data

    def _run(self, data: bytes) -> Got | None:
        """Feed llhttp; a verdict of its own (None: go on with :attr:`_stop`)."""
        try:
            if self._sliced:
                self._feed_sliced(data)
            else:
                self._parser.feed_data(data)
        except HttpParserUpgrade:
            return _FOREIGN
        except HttpParserCallbackError as exc:
            if self._stop is None:  # a bug in a callback, not the client's bytes
                raise exc.__context__ or exc from None
            self._parser = HttpRequestParser(self)  # stopped: a fresh one for the next
        except HttpParserError:
            if self._stop is None:
                return _FOREIGN  # malformed: aiohttp refuses it (400)
            self._parser = HttpRequestParser(self)  # stopped: a fresh one for the next
        return None

    def _feed_sliced(self, data: bytes) -> None:
        """Feed ``data`` in pieces cut after each CRLF, up to the message's end (a chunked
        message ends with a CRLF, so it ends where a piece does)."""
        feed, at, size = self._parser.feed_data, 0, len(data)
        while at < size:
            cut = data.find(b"\r\n", at)
            end = size if cut < 0 else cut + 2
            feed(data[at:end] if at or end < size else data)
            at = end
            if self._complete:
                self._stop = _REQUEST
                self.rest = data[at:]
                return

    def _more_body(self, data: bytes) -> Got:
        """More of a recalled head's body (see :meth:`feed`)."""
        left, collects = self._left, self.head is not None and self.head.collects
        if len(data) < left:
            if collects:
                self._pieces.append(data)
            self._before += len(data)
            self.size += len(data)
            self._left = left - len(data)
            return _HEAD
        if collects:
            self._pieces.append(data[:left])
        pieces = self._pieces
        self.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self._begin()
        self.rest = data[left:]
        return _REQUEST

    def body_seen(self) -> int:
        """How many bytes of the current request's body were read (after :data:`Got.HEAD`)."""
        if self._length is None:
            return self.size  # chunked: what llhttp de-chunked
        return min(self._length, max(0, self._before - self._head_len))

    def done(self) -> None:
        """The request was taken from :attr:`head` and :attr:`body`: the next one's turn
        (the data plane's connection does what this does itself)."""
        self.head, self.body, self.over = None, b"", False


def parse_head(raw: bytes) -> RequestHead | None:
    """The head of ``raw`` (a head without its blank line) when the data plane takes it."""
    reader = RequestReader()
    got = reader.feed(raw + b"\r\n\r\n")
    return reader.head if got in (_HEAD, _REQUEST) else None
