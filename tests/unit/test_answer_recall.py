"""The upstream client's recall of the last answer head (issue 27, speed): an answer head
that is the last one's bytes but for its ``Content-Length`` digits and its ``Date`` gets
that head's verdict again without llhttp; every other head gets llhttp's own.

A real upstream connection (a socket pair on 127.0.0.1). The oracle is a fresh
connection (nothing to recall: llhttp reads every byte). Each case is answered on a
connection that has just read a good answer, and must get the fresh connection's
verdict: the same head (status, reason, fields, type, Date, framing, length), body,
error, and whether the connection goes back to its pool. A recall keyed on less than
the exact bytes (a Date of any bytes, the status line alone, the length's line but not
what follows it) gives some of these cases the good head's verdict, and fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from controller.dataplane.upstream import Upstream, UpstreamError, UpstreamPool

KEY = ("x", 1)
REQUEST = b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
DATE = b"Wed, 02 Dec 2026 05:00:00 GMT"


def answer(body: bytes = b"{}", *extra: bytes, length: bytes | None = None) -> bytes:
    size = b"%d" % len(body) if length is None else length
    return (
        b"HTTP/1.1 200 OK\r\nServer: demo\r\nDate: "
        + DATE
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + size
        + b"\r\n"
        + b"".join(extra)
        + b"\r\n"
        + body
    )


GOOD = answer()
Verdict = tuple[object, ...]


class Heard:
    def __init__(self) -> None:
        self.head: tuple[object, ...] | None = None
        self.body = b""
        self.error: str | None = None
        self.ended = asyncio.Event()

    def on_head(self, up: Upstream) -> None:
        self.head = (
            up.status,
            up.reason,
            list(up.fields),
            up.content_type,
            up.date,
            up.framing,
            up.length,
        )

    def relay(self, data: bytes) -> None:
        self.body += data

    def on_end(self) -> None:
        self.ended.set()

    def on_error(self, error: UpstreamError) -> None:
        self.error = str(error)
        self.ended.set()

    def on_answer(self, up: Upstream, body: bytes) -> None:
        """A whole answer at once: what on_head, relay and on_end say."""
        self.on_head(up)
        if body:
            self.relay(body)
        self.on_end()


class Counted(Upstream):
    """An upstream connection that counts llhttp's header callbacks."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        super().__init__(pool, key)
        self.headers_read = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers_read += 1
        super().on_header(name, value)


async def verdicts(answers: list[bytes], up_type: type[Upstream] = Upstream) -> list[Verdict]:
    """Each answer's verdict, in turn on one connection (while it is pooled again); the
    last item, for a :class:`Counted` connection, the header callbacks llhttp made."""
    loop = asyncio.get_running_loop()
    pool = UpstreamPool()
    listener = socket.create_server(("127.0.0.1", 0))
    _, up = await loop.create_connection(
        lambda: up_type(pool, KEY), "127.0.0.1", listener.getsockname()[1]
    )
    theirs, _ = listener.accept()
    theirs.setblocking(False)
    seen: list[Verdict] = []
    try:
        for data in answers:
            heard = Heard()
            up.send([REQUEST], heard)
            await loop.sock_sendall(theirs, data)
            try:
                await asyncio.wait_for(heard.ended.wait(), 1)
            except TimeoutError:  # the body still coming (a length longer than sent)
                seen.append((heard.head, heard.body, "still reading", False))
                break
            await asyncio.sleep(0.01)  # bytes after the answer, if any, are in
            pooled = pool.take(KEY) is up
            seen.append((heard.head, heard.body, heard.error, pooled))
            if not pooled:
                break
            with contextlib.suppress(BlockingIOError):
                theirs.recv(65536)  # the request, read and dropped
    finally:
        pool.close()
        up.abort()
        theirs.close()
        listener.close()
    if isinstance(up, Counted):
        seen.append((up.headers_read,))
    return seen


CASES: dict[str, bytes] = {
    "another length": answer(b'{"a": 1}'),
    "zero length": answer(b""),
    "another date": GOOD.replace(DATE, b"Thu, 31 Dec 2026 23:59:59 GMT"),
    "a date of another shape": GOOD.replace(DATE, b"Thu, 1 Dec 2026 23:59:59 GMT"),
    "a nul in the date": GOOD.replace(DATE, DATE.replace(b"Wed", b"W\x00d")),
    "a control byte in the date": GOOD.replace(DATE, DATE.replace(b" GMT", b"\x01GMT")),
    "a second date": answer(b"{}", b"Date: " + DATE + b"\r\n"),
    "another status": GOOD.replace(b"200 OK", b"404 Not Found"),
    "another reason": GOOD.replace(b"200 OK", b"200 Fine"),
    "another version": GOOD.replace(b"HTTP/1.1", b"HTTP/1.0"),
    "another server": GOOD.replace(b"Server: demo", b"Server: demp"),
    "connection close": answer(b"{}", b"Connection: close\r\n"),
    "a header after the length": answer(b"{}", b"X-After: 1\r\n"),
    "a nul after the length": answer(b"{}", b"X-After: a\x00b\r\n"),
    "chunked too": answer(b"2\r\n{}\r\n0\r\n\r\n", b"Transfer-Encoding: chunked\r\n"),
    "a second length": answer(b"{}", b"Content-Length: 3\r\n"),
    "a length that overflows": answer(length=b"99999999999999999999"),
    "a length of 18 digits": answer(length=b"9" * 18),
    "a sign before the length": answer(length=b"+2"),
    "a letter after the length": answer(length=b"2x"),
    "an interim answer first": b"HTTP/1.1 100 Continue\r\n\r\n" + GOOD,
    "bytes after the answer": GOOD + b"HTTP/1.1 200 OK\r\n",
    "a 204": b"HTTP/1.1 204 No Content\r\nServer: demo\r\nDate: " + DATE + b"\r\n\r\n",
}


@pytest.mark.parametrize("name", list(CASES))
async def test_an_answer_after_a_recalled_one_gets_llhttps_verdict(name: str) -> None:
    case = CASES[name]
    fresh = await verdicts([case])
    first, after = await verdicts([GOOD, case])
    assert first[3], first  # the good answer's connection was pooled, its head recalled
    assert after == fresh[0]


INTERIM = b"HTTP/1.1 100 Continue\r\nContent-Length: 0\r\n\r\n"
TWO_DATES = answer(b"{}", b"Date: " + DATE + b"\r\n")

# An answer read first, then one like it: the second must get llhttp's verdict too.
PAIRS: dict[str, tuple[bytes, bytes]] = {
    # The head before the final one is an interim answer's: not the one to recall.
    "interim then final, twice": (INTERIM + answer(b""), INTERIM + answer(b"{ }")),
    # llhttp's Date is the last one; the first one's value is no verdict.
    "two dates, the first changed": (TWO_DATES, TWO_DATES.replace(DATE, DATE[:-5] + b"9 GMT", 1)),
}


@pytest.mark.parametrize("name", list(PAIRS))
async def test_the_second_of_two_answers_gets_llhttps_verdict(name: str) -> None:
    first, second = PAIRS[name]
    fresh = await verdicts([second])
    assert (await verdicts([first, second]))[1] == fresh[0]


async def test_a_recalled_answer_keeps_its_date_and_length() -> None:
    later = b"Thu, 03 Dec 2026 00:00:01 GMT"
    seen = await verdicts([GOOD, answer(b"x" * 300).replace(DATE, later), GOOD])
    heads = [(v[0], v[1]) for v in seen if isinstance(v[0], tuple)]
    assert [(head[4], head[6], body) for head, body in heads] == [
        (DATE, 2, b"{}"),
        (later, 300, b"x" * 300),
        (DATE, 2, b"{}"),
    ]
    assert all(v[3] for v in seen)


async def test_a_repeated_answer_head_is_not_parsed_again() -> None:
    """The point of the recall: llhttp's callbacks run for the first head only."""
    later = GOOD.replace(DATE, b"Thu, 03 Dec 2026 00:00:01 GMT")
    *seen, (headers_read,) = await verdicts([GOOD, answer(b"[1, 2]"), later], Counted)
    assert [v[1] for v in seen] == [b"{}", b"[1, 2]", b"{}"] and all(v[3] for v in seen)
    assert headers_read == 4  # Server, Date, Content-Type, Content-Length: once
