"""The request reader's recall of the last head (issue 27, speed): a head that is the last
one's bytes but for its ``Content-Length`` digits gets that head's verdict again without
llhttp; every other head gets llhttp's own.

The oracle is a fresh :class:`RequestReader` (no head to recall: llhttp reads every byte).
Each case is read on a reader that has just read a good request whose head the case
resembles, and must get the fresh reader's verdict: the same :class:`Got` at each read,
the same head, body and rest, the same bytes handed over. A recall keyed on less than
the exact bytes (the request line, the prefix before the length, the field names) gives
some of these cases the good head's verdict, and fails here.
"""

from __future__ import annotations

from dataclasses import astuple, fields

import pytest

from controller.dataplane.request import Got, RequestHead, RequestReader

BODY = b'{"model": "m", "messages": []}'


def post(body: bytes = BODY, *extra: bytes, length: bytes | None = None) -> bytes:
    size = b"%d" % len(body) if length is None else length
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Authorization: Bearer t\r\nContent-Type: application/json\r\n"
        + b"".join(extra)
        + b"Content-Length: "
        + size
        + b"\r\nUser-Agent: sdk\r\n\r\n"
        + body
    )


GOOD = post()
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer t\r\n\r\n"

Read = tuple[Got, tuple[object, ...] | None, bytes, bytes]


def read(reader: RequestReader, chunks: list[bytes]) -> list[Read]:
    """What ``reader`` gives for ``chunks``, read as a connection reads them (a request
    taken, then the bytes after it); stops at a hand-over."""
    seen: list[Read] = []
    for chunk in chunks:
        data = chunk
        while True:
            got = reader.feed(data)
            head = astuple(reader.head) if reader.head is not None else None
            if got is Got.FOREIGN:
                seen.append((got, None, b"", reader.raw))
                return seen
            if got is not Got.REQUEST:
                seen.append((got, head, b"", b""))
                break
            seen.append((got, head, reader.body, reader.rest))
            data = reader.rest
            reader.done()
            if not data:
                break
    return seen


_LENGTH = [f.name for f in fields(RequestHead)].index("length")


def primed(first: bytes) -> RequestReader:
    reader = RequestReader()
    (got, *_), *_ = read(reader, [first])
    assert got is Got.REQUEST
    assert reader._recall is not None  # the head is there to recall
    return reader


CASES: dict[str, list[bytes]] = {
    "same head, another length": [post(BODY + b" ")],
    "same head, length with leading zeros": [post(length=b"00%d" % len(BODY))],
    "same head, zero length": [post(b"")],
    "another authorization": [GOOD.replace(b"Bearer t", b"Bearer u")],
    "another header value": [GOOD.replace(b"User-Agent: sdk", b"User-Agent: sdl")],
    "a header name in another case": [GOOD.replace(b"User-Agent", b"user-agent")],
    "another path": [GOOD.replace(b"/v1/chat/completions", b"/v1/embeddings")],
    "another method": [GOOD.replace(b"POST", b"PUT", 1)],
    "another version": [GOOD.replace(b"HTTP/1.1", b"HTTP/1.0")],
    "connection close added": [post(BODY, b"Connection: close\r\n")],
    "a second host": [post(BODY, b"Host: evil.example\r\n")],
    "a header more": [post(BODY, b"X-More: 1\r\n")],
    "transfer-encoding added": [post(BODY, b"Transfer-Encoding: chunked\r\n")],
    "a second length": [post(BODY, b"Content-Length: 3\r\n")],
    "a nul in a value": [GOOD.replace(b"sdk", b"s\x00k")],
    "a bare lf": [GOOD.replace(b"User-Agent: sdk\r\n", b"User-Agent: sdk\n")],
    "an obs-fold": [GOOD.replace(b"User-Agent: sdk\r\n", b"User-Agent: sdk\r\n folded\r\n")],
    "a sign before the length": [post(length=b"+%d" % len(BODY))],
    "a letter after the length": [post(length=b"%dx" % len(BODY))],
    "a space more before the length": [post(length=b" %d" % len(BODY))],
    "a length that overflows": [post(length=b"99999999999999999999")],
    "a length of 18 digits": [post(length=b"9" * 18)],
    "an empty line before it": [b"\r\n" + GOOD],
    "the models list instead": [MODELS],
    "two in one read": [GOOD + post(BODY + b"  ")],
    "the good one, then a malformed one": [GOOD + GOOD.replace(b"sdk", b"s\x00k")],
    "head in two reads": [GOOD[:40], GOOD[40:]],
    "head then body in pieces": [GOOD[: -len(BODY)], BODY[:5], BODY[5:9], BODY[9:]],
    "body cut mid-read, the next request after it": [GOOD[:-3], GOOD[-3:] + MODELS],
}


@pytest.mark.parametrize("first", [GOOD, MODELS], ids=["after-a-post", "after-a-get"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_head_after_a_recalled_one_gets_llhttps_verdict(first: bytes, name: str) -> None:
    chunks = CASES[name]
    assert read(primed(first), chunks) == read(RequestReader(), chunks)


def test_the_recall_reads_a_repeated_head_with_another_length() -> None:
    reader = primed(GOOD)
    for body in (BODY + b"x" * 10, b"", BODY):
        [(got, head, taken, rest)] = read(reader, [post(body)])
        assert (got, taken, rest) == (Got.REQUEST, body, b"")
        assert head is not None and head[_LENGTH] == len(body)  # RequestHead.length


def test_a_body_over_many_reads_is_counted_for_a_refusal() -> None:
    reader = primed(GOOD)
    data = post(b"x" * 100)
    assert reader.feed(data[:-60]) is Got.HEAD
    assert reader.fresh and reader.body_seen() == 40
    assert reader.feed(data[-60:-10]) is Got.HEAD
    assert not reader.fresh and reader.body_seen() == 90
    assert reader.feed(data[-10:]) is Got.REQUEST
    assert reader.body == b"x" * 100
