"""The router's data plane on the wire (controller/dataplane/).

The routed requests of tests/integration/test_router.py already go through the data plane
(the API server listens through it); these tests take the paths it adds, over raw TCP on
127.0.0.1: a connection's REST requests passed to aiohttp and the connection taken back,
a head refused and handed over, pipelining, ``Expect``, the 413 that drops the body,
chunked uploads, ``HTTP/1.0``, percent-encoded ids, the 404 and 405 of ``/v1``, each
framing a model server may answer with (a real process, ``wire_upstream.py``, answering
as each request asks), the keep-alive pool and a stale connection in it, an upstream that
breaks, flow control towards a slow client, and a client that leaves while the upstream
works.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.dataplane.request import parse_head
from controller.model.errors import SlotNotReady
from controller.model.lifecycle import SlotState
from controller.router.endpoints import CHAT, MODELS
from controller.slots.records import Lease
from controller.spec.schema import AliasSpec
from tests.integration.test_router import AUTH, TOKEN, Harness, Router, chat, model, wait_for

S = SlotState
WIRE = [sys.executable, str(Path(__file__).with_name("wire_upstream.py")), "--port", "{port}"]


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


class Wire:
    """One raw client connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def answer(self, *, interim: bool = False) -> Answer:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 30)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200 or status in (204, 304):
            return Answer(status, headers, b"")
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if not size:
                    await self.reader.readuntil(b"\r\n")
                    break
                body += await self.reader.readexactly(size)
                await self.reader.readexactly(2)
        else:
            body = await self.reader.read()
        return Answer(status, headers, body)

    async def closed(self) -> bool:
        """True once the server closed the connection (nothing more to read)."""
        return await asyncio.wait_for(self.reader.read(), 10) == b""

    def close(self) -> None:
        self.writer.close()


@contextlib.asynccontextmanager
async def wire(router: Router) -> AsyncIterator[Wire]:
    host, _, port = router.base.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    connection = Wire(reader, writer)
    try:
        yield connection
    finally:
        connection.close()


def post(path: str, body: Any, *, extra: tuple[str, ...] = (), token: str = TOKEN) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Authorization: Bearer {token}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def sized_head(length: bytes, *, token: str | None = None) -> bytes:
    """A chat completion's head that announces ``length`` (the body is the caller's)."""
    auth = b"Authorization: Bearer " + token.encode() + b"\r\n" if token else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + auth
        + b"Content-Length: "
        + length
        + b"\r\n\r\n"
    )


def ask(mode: str, **more: Any) -> dict[str, Any]:
    return {"model": "wire", "mode": mode, **more}


async def stats(r: Router) -> dict[str, Any]:
    async with r.client.get(r.endpoint("wire") + "/stats") as resp:
        return dict(await resp.json())


async def stats_until(
    r: Router, check: Callable[[dict[str, Any]], bool], limit_s: float = 10.0
) -> dict[str, Any]:
    """The upstream's counters once ``check`` holds of them (the last ones at the limit)."""
    deadline = time.monotonic() + limit_s
    while not check(seen := await stats(r)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return seen


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        await h.close()


async def start_wire(harness: Harness) -> Router:
    upstream = harness.slot("wire", "", provider="kokoro", memory_gb=1.0, server={"cmd": WIRE})
    return await harness.start([upstream, harness.slot("chat", "m-chat")], [model("m-chat")])


# ============================================================================ the head


def test_parse_head_takes_every_v1_request_and_only_those() -> None:
    def head(*lines: str, host: bool = True) -> bytes:
        return "\r\n".join([lines[0], *(["Host: h"] if host else []), *lines[1:]]).encode("latin-1")

    ok = parse_head(
        head(
            "POST /v1/chat/completions?x=1 HTTP/1.1",
            "Authorization: Bearer t",
            "Content-Type: application/json",
            "Content-Length: 12",
            "Cookie: c=1",
            "X-Custom:  kept ",
            "Expect: 100-continue",
            "Connection: close",
        )
    )
    assert ok is not None
    assert (ok.target, ok.length, ok.authorization) == (
        b"/v1/chat/completions?x=1",
        12,
        b"Bearer t",
    )
    # No hop-by-hop or credential header; the others as llhttp read them.
    assert ok.forward == b"\r\nContent-Type: application/json\r\nX-Custom: kept"
    assert ok.expect and not ok.keep and ok.content_type == "application/json"
    assert ok.endpoint is CHAT and ok.kind == "chat" and not ok.old
    audio = parse_head(head("POST /v1/audio/transcriptions HTTP/1.1", "Content-Length: 0"))
    assert audio is not None and audio.limit > ok.limit and audio.kind == "transcriptions"
    # Taken, whatever the version, framing or path (the connection answers each).
    taken = {
        "405": head("GET /v1/chat/completions HTTP/1.1", "Content-Length: 0"),
        "405 too": head("POST /v1/models HTTP/1.1", "Content-Length: 0"),
        "404": head("GET /v1/nothing HTTP/1.1"),
        "traversal": head("POST /v1/audio/../slots HTTP/1.1", "Content-Length: 0"),
        "encoded traversal": head("POST /v1/audio/%2e%2e HTTP/1.1", "Content-Length: 0"),
        "1.0": head("POST /v1/completions HTTP/1.0", "Content-Length: 0", host=False),
        "no length": head("POST /v1/completions HTTP/1.1"),
        "chunked": head("POST /v1/completions HTTP/1.1", "Transfer-Encoding: chunked"),
        "expect": head("POST /v1/completions HTTP/1.1", "Content-Length: 0", "Expect: 200-ok"),
        "upgrade": head("POST /v1/completions HTTP/1.1", "Content-Length: 0", "Upgrade: h2c"),
        "encoded id": head("GET /v1/models/org%2Fm%20x HTTP/1.1"),
        "absolute": head("GET http://h/v1/models HTTP/1.1"),
    }
    got = {name: parse_head(raw) for name, raw in taken.items()}
    assert all(h is not None for h in got.values()), got
    assert got["405"].endpoint is None and got["405"].allow == ("POST",)  # type: ignore[union-attr]
    assert got["404"].endpoint is None and got["404"].allow == ()  # type: ignore[union-attr]
    assert got["traversal"].kind == got["encoded traversal"].kind == ""  # type: ignore[union-attr]
    assert got["encoded traversal"].arg == ".."  # type: ignore[union-attr]
    assert got["1.0"].old and got["chunked"].length == -1  # type: ignore[union-attr]
    assert got["expect"].expect_other  # type: ignore[union-attr]
    assert got["encoded id"].arg == "org/m x"  # type: ignore[union-attr]
    assert got["absolute"].endpoint is MODELS  # type: ignore[union-attr]
    assert b"h2c" not in got["upgrade"].forward  # type: ignore[union-attr]
    for refused in (
        head("POST /api/slots HTTP/1.1", "Content-Length: 0"),  # aiohttp's (passed on)
        head("GET /v1x HTTP/1.1"),
        head("POST /v1/completions HTTP/1.1", "Content-Length: 0", host=False),
        head("POST /v1/completions HTTP/1.1", "Content-Length: 0", "Host: other"),
        head("POST /v1/completions HTTP/1.1", "Content-Length: 1", "Content-Length: 2"),
        head("POST /v1/completions HTTP/1.1", "Content-Length: -1"),
        head("POST /v1/completions HTTP/1.1", "Content-Length: 0", " folded"),
        head("POST /v1/completions HTTP/1.1", "Content-Length: 0", "Bad Name: x"),
        head("POST /v1/completions HTTP/1.1", "Content-Length: 0", "X: a\x00b"),
    ):
        assert parse_head(refused) is None, refused


# ============================================================================ connections


async def test_one_connection_serves_routed_then_rest_then_routed_requests(
    harness: Harness,
) -> None:
    """A kept-alive connection: the data plane answers, passes the REST request to
    aiohttp, which answers it on the same connection, and takes the connection back for
    the next routed request (aiohttp serves no /v1 request)."""
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("length", n=1)))
        first = await c.answer()
        assert first.status == 200 and json.loads(first.body)["n"] == 1
        c.send(
            f"GET /api/slots HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        listed = await c.answer()
        assert listed.status == 200 and "wire" in {
            s["name"] for s in json.loads(listed.body)["slots"]
        }
        c.send(post("/v1/chat/completions", ask("length", n=2)))
        third = await c.answer()
        assert third.status == 200 and json.loads(third.body)["n"] == 2
        assert "server" in listed.headers  # aiohttp's own header: passed to aiohttp
        assert "server" not in first.headers and "server" not in third.headers


async def test_a_change_between_two_requests_on_one_connection_is_seen(
    harness: Harness,
) -> None:
    """A kept-alive connection's last route is taken again (controller/router/memo.py)
    only while what decided it is the same: an alias declared between two requests on
    one connection sends the second elsewhere, and its removal back."""
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("length", n=1)))
        first = await c.answer()
        assert first.status == 200 and json.loads(first.body)["n"] == 1  # the wire slot
        c.send(post("/v1/chat/completions", ask("length", n=2)))
        assert json.loads((await c.answer()).body)["n"] == 2  # (its route kept)
        r.manager.set_aliases({"wire": AliasSpec(id="wire", models=["m-chat"])})
        c.send(post("/v1/chat/completions", chat("wire")))
        aliased = await c.answer()
        assert aliased.status == 200 and json.loads(aliased.body)["model"] == "m-chat"
        r.manager.set_aliases({})
        c.send(post("/v1/chat/completions", ask("length", n=3)))
        again = await c.answer()
        assert again.status == 200 and json.loads(again.body)["n"] == 3


async def test_the_models_list_keeps_a_connection_on_the_data_plane(harness: Harness) -> None:
    """``GET /v1/models`` (as an SDK's pool sends before its completions) is answered
    here, so the connection's next POST is too."""
    r = await start_wire(harness)
    get = "GET {} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + TOKEN + "\r\n\r\n"
    async with wire(r) as c:
        c.send(get.format("/v1/models").encode())
        listed = await c.answer()
        assert listed.status == 200 and "server" not in listed.headers  # not aiohttp's
        async with r.get("/v1/models") as other:
            assert json.loads(listed.body) == await other.json()
        c.send(get.format("/v1/models/wire").encode())
        one = await c.answer()
        async with r.get("/v1/models/wire") as other:
            assert one.status == 200 and json.loads(one.body) == await other.json()
        c.send(get.format("/v1/models/org/no-such-model").encode())
        missing = await c.answer()
        assert missing.status == 404
        assert json.loads(missing.body)["error"]["code"] == "model_not_found"
        c.send(post("/v1/chat/completions", ask("length", n=3)))
        routed = await c.answer()
        assert routed.status == 200 and "server" not in routed.headers
    async with wire(r) as c:  # no token: 401 in OpenAI's shape, as for the POSTs
        c.send(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        refused = await c.answer()
        assert refused.status == 401
        assert json.loads(refused.body)["error"]["code"] == "invalid_api_key"


async def test_an_event_stream_head_goes_out_before_its_first_event(harness: Harness) -> None:
    """A server still working on its first token: the client has the answer's head
    already (a sized answer's head waits for its body, to be a 502 if it breaks)."""
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("late-sse")))
        head = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
        assert (await stats(r)).get("late_head_sent") is True
        async with r.client.get(r.endpoint("wire") + "/go") as go:
            assert go.status == 200
        size = int(await asyncio.wait_for(c.reader.readuntil(b"\r\n"), 30), 16)
        assert await c.reader.readexactly(size) == b'data: {"late": true}\n\n'


async def test_a_stream_still_running_at_stop_ends_with_an_error_event(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the stop's grace, a stream in flight gets its last event, the router's
    "shutting down" error, and a proper end (not a cut); its lease ends."""
    import controller.api.server as server_module

    monkeypatch.setattr(server_module, "_SHUTDOWN_S", 0.5)
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("late-sse")))  # its first event never comes
        answer = asyncio.create_task(c.answer())
        await wait_for(lambda: r.manager.view("wire").state is S.SERVING, timeout=30)
        await r.server.stop()
        got = await answer
    assert got.status == 200 and got.headers["content-type"].startswith("text/event-stream")
    events = [e for e in got.body.split(b"\n\n") if e]
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "slot.not_ready" and "shutting down" in error["message"]
    assert r.manager.view("wire").state is S.READY


async def test_pipelined_requests_are_answered_in_order(harness: Harness) -> None:
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(
            b"".join(
                post("/v1/completions", ask(m, n=i))
                for i, m in enumerate(["slow", "length", "chunked", "length"])
            )
        )
        answers = [await c.answer() for _ in range(4)]
    assert [a.status for a in answers] == [200, 200, 201, 200]
    assert [json.loads(a.body)["n"] for a in answers] == [0, 1, 2, 3]


async def test_thousands_of_pipelined_requests_answered_at_once_are_all_answered(
    harness: Harness,
) -> None:
    """The models list, 401s and refused POSTs need no upstream: each asks for the next
    request from inside the last one's answer, which must be a turn, not a deeper call
    (a recursion error reset the connection after ~330 of them)."""
    r = await start_wire(harness)
    models = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    kinds = [
        (models.encode(), 200),
        (post("/v1/chat/completions", ask("length"), token="wrong"), 401),
        (post("/v1/chat/completions", {"model": "no-such"}), 404),
    ]
    for one, status in kinds:
        async with wire(r) as c:
            c.send(one * 1500)
            for _ in range(1500):
                assert (await c.answer()).status == status
    plane = r.server.plane
    assert plane is not None and plane.in_flight == 0


async def test_the_lease_watch_outlives_a_connection_handed_over_as_it_looks(
    harness: Harness,
) -> None:
    """A revoked request with a REST request pipelined behind it: its end hands the
    connection to aiohttp from inside the watch's pass over the connections; the watch
    goes on (a second revoked request is still cut within the watch's period)."""
    r = await start_wire(harness)
    plane = r.server.plane
    assert plane is not None

    async def revoke_the_one_in_flight() -> None:
        await wait_for(lambda: any(f.call and f.call.lease for f in plane.fronts))
        front = next(f for f in plane.fronts if f.call and f.call.lease)
        assert front.call is not None and front.call.lease is not None
        front.call.lease.revoke(SlotNotReady("gone", slot="wire"))

    rest = f"GET /api/slots HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("slow", delay=5)) + rest.encode())
        await revoke_the_one_in_flight()
        assert (await c.answer()).status == 503
        assert (await c.answer()).status == 200  # the REST request, served by aiohttp
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("slow", delay=5)))
        await revoke_the_one_in_flight()
        started = time.monotonic()
        assert (await c.answer()).status == 503
        assert time.monotonic() - started < 2  # the watch still runs (not the 5 s answer)


async def test_an_unexpected_error_while_a_request_waits_is_a_500(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a cold slot's wait (anything but a refusal) answers 500 and ends the
    request, as the data plane's other steps and aiohttp's path do; it never hangs."""
    r = await start_wire(harness)
    plane = r.server.plane
    assert plane is not None

    async def broken(name: str) -> Lease:
        raise RuntimeError("a bug in the load path")

    monkeypatch.setattr(r.manager, "try_acquire", lambda name: None)  # a wait, then:
    monkeypatch.setattr(r.manager, "acquire", broken)
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("length"), extra=("Connection: close",)))
        answer = await c.answer()
        assert answer.status == 500 and json.loads(answer.body)["error"]["code"] == "internal"
        assert answer.headers["connection"] == "close" and await c.closed()
    assert plane.in_flight == 0


async def test_expect_continue_and_connection_close(harness: Harness) -> None:
    r = await start_wire(harness)
    body = json.dumps(ask("length", pad="p" * 5000)).encode()
    async with wire(r) as c:
        head = post(
            "/v1/chat/completions", body, extra=("Expect: 100-continue", "Connection: close")
        )
        c.send(head[: -len(body)])
        assert (await c.answer()).status == 100
        c.send(body)
        answer = await c.answer()
        assert answer.status == 200 and json.loads(answer.body)["pad"] == "p" * 5000
        assert answer.headers["connection"] == "close" and await c.closed()


async def test_a_body_over_the_limit_is_413_dropped_and_the_connection_closed(
    harness: Harness,
) -> None:
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(sized_head(b"9000000", token=TOKEN) + b"{")
        answer = await c.answer()
        assert (
            answer.status == 413 and json.loads(answer.body)["error"]["code"] == "request_too_large"
        )
        c.send(b"x" * (9000000 - 1))  # the rest of the body is read and dropped, then closed
        assert await c.closed()
    assert r.manager.view("wire").state is S.OFFLINE  # no lease, no load
    async with wire(r) as c:  # without a token: the 401 first (the body is not read)
        c.send(sized_head(b"9000000") + b"{")
        answer = await c.answer()
        assert answer.status == 401 and answer.headers["connection"] == "close"
        c.send(b"x" * (9000000 - 1))
        assert await c.closed()


async def test_a_content_length_too_long_to_convert_is_refused_not_a_crash(
    harness: Harness,
) -> None:
    """Content-Length of 5000 digits: int() refuses it (Python's 4300-digit limit), which
    raised in data_received and reset the connection with no answer (and a traceback)."""
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(sized_head(b"9" * 5000, token=TOKEN) + b"{}")
        answer = await c.answer()
        assert answer.status in (400, 413), answer
        assert await c.closed()


def _blocking_post(base: str, body: bytes) -> int | str:
    """As http.client (and requests) post: the whole body first, then the answer."""
    host, _, port = base.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=AUTH)
        return conn.getresponse().status
    except OSError as exc:
        return repr(exc)
    finally:
        conn.close()


async def test_a_413_reaches_a_client_that_sends_its_whole_body_first(harness: Harness) -> None:
    """The 413 refuses from the head; closing at once with the body unread reset the
    connection, and http.client, still sending, got ECONNRESET instead of the 413."""
    r = await start_wire(harness)
    body = json.dumps(ask("length", pad="p" * (12 << 20))).encode()
    for _ in range(2):
        assert await asyncio.to_thread(_blocking_post, r.base, body) == 413
    assert r.manager.view("wire").state is S.OFFLINE  # no lease, no load


async def test_chunked_uploads_old_clients_and_encoded_ids_are_the_data_planes(
    harness: Harness,
) -> None:
    """What aiohttp's router path served before (issue 41): a chunked upload (de-chunked
    by llhttp, sent upstream with a Content-Length), a request pipelined after it in the
    same write, HTTP/1.0 (answered as 1.0), a percent-encoded model id."""
    r = await start_wire(harness)
    data = json.dumps(ask("length", n=7)).encode()
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x;ext=1\r\n" % 5
        + data[:5]
        + b"\r\n%x\r\n" % (len(data) - 5)
        + data[5:]
        + b"\r\n0\r\nX-Trailer: yes\r\n\r\n"
    )
    async with wire(r) as c:
        c.send(chunked + post("/v1/chat/completions", ask("length", n=8)))
        first, second = await c.answer(), await c.answer()
        assert first.status == 200 and "server" not in first.headers
        echoed = json.loads(first.body)
        assert echoed["n"] == 7 and echoed["_headers"]["content-length"] == str(len(data))
        assert "transfer-encoding" not in echoed["_headers"]
        assert second.status == 200 and json.loads(second.body)["n"] == 8
        for split in (10, len(chunked) - 3):  # a chunked body over several reads
            c.send(chunked[:split])
            await asyncio.sleep(0.05)
            c.send(chunked[split:])
            assert json.loads((await c.answer()).body)["n"] == 7

    def one_oh(mode: str, *extra: str) -> bytes:
        return post("/v1/completions", ask(mode, n=9), extra=extra).replace(b"1.1", b"1.0", 1)

    async with wire(r) as c:  # HTTP/1.0: answered as 1.0, closed after it
        c.send(one_oh("length"))
        head = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.0 200") and b"Connection:" not in head
        assert json.loads(await c.reader.read())["n"] == 9  # then the connection's end
    async with wire(r) as c:  # kept alive when it asks; an unsized answer ends it anyway
        c.send(one_oh("length", "Connection: keep-alive"))
        answer = await c.answer()
        assert answer.status == 200 and answer.headers["connection"] == "keep-alive"
        c.send(one_oh("chunked", "Connection: keep-alive"))
        head = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.0 201") and b"Transfer-Encoding" not in head
        assert json.loads(await c.reader.read())["mode"] == "chunked"  # raw, to the end
    get = "GET {} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + TOKEN + "\r\n\r\n"
    async with wire(r) as c:  # a model id percent-encoded in the path
        c.send(get.format("/v1/models/w%69re").encode())
        one = await c.answer()
        assert one.status == 200 and json.loads(one.body)["id"] == "wire"


async def test_v1_paths_and_methods_it_does_not_hold_are_404_and_405(harness: Harness) -> None:
    """As the API answered them (its auth first, then OpenAI's error shape)."""
    r = await start_wire(harness)
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    async with wire(r) as c:
        c.send(b"GET /v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert (await c.answer()).status == 401
        c.send(f"GET /v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
        missing = await c.answer()
        error = json.loads(missing.body)["error"]
        assert missing.status == 404 and error["code"] == "not_found"
        assert error["message"] == "Invalid URL (GET /v1/nothing)"
        c.send(post("/v1/models", {"model": "wire"}))
        wrong = await c.answer()
        assert wrong.status == 405 and wrong.headers["allow"] == "GET"
        assert json.loads(wrong.body)["error"]["code"] == "method_not_allowed"
        c.send(post("/v1/completions", ask("length", n=1), extra=("Expect: 200-ok",)))
        assert (await c.answer()).status == 417
        assert await c.closed()
    assert r.manager.view("wire").state is S.OFFLINE  # nothing was leased or loaded


async def test_rest_requests_pipelined_between_routed_ones_are_answered_in_order(
    harness: Harness,
) -> None:
    """REST requests (one with a body) and routed ones in one write: aiohttp answers its
    own on the connection, the data plane its own, in the order they came."""
    r = await start_wire(harness)
    rest = f"GET /api/slots HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    hold = json.dumps({"ttl_s": 5}).encode()
    held = (
        b"POST /api/slots/nothing/hold HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(hold)
        + hold
    )
    async with wire(r) as c:
        c.send(
            rest.encode()
            + post("/v1/completions", ask("length", n=1))
            + held
            + post("/v1/completions", ask("slow", n=2, delay=0.2))
            + rest.encode()
        )
        answers = [await c.answer() for _ in range(5)]
    assert [a.status for a in answers] == [200, 200, 404, 200, 200]
    assert ["server" in a.headers for a in answers] == [True, False, True, False, True]
    assert [json.loads(answers[i].body)["n"] for i in (1, 3)] == [1, 2]


async def test_a_chunked_body_over_the_limit_is_413_or_401_first(harness: Harness) -> None:
    r = await start_wire(harness)
    piece = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
    for token, status in ((TOKEN, 413), ("wrong", 401)):
        async with wire(r) as c:
            c.send(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
                + b"Bearer "
                + token.encode()
                + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            for _ in range(9):  # 9 MiB: past the 8 MiB of a JSON endpoint
                c.send(piece)
            answer = await c.answer()
            assert answer.status == status and answer.headers["connection"] == "close"
            c.send(b"0\r\n\r\n")  # the rest is read and dropped, then closed
            assert await c.closed()
    assert r.manager.view("wire").state is S.OFFLINE  # no lease, no load


async def test_a_bad_chunk_after_the_head_is_a_400_never_a_hang(harness: Harness) -> None:
    """A chunked body llhttp refuses in a later read: the data plane's 400 for a /v1
    upload (its head was taken); a REST one's connection closed (aiohttp, fed the bytes,
    waits for the rest of the body for ever, as it does alone)."""
    r = await start_wire(harness)
    for path in ("/v1/chat/completions", "/api/slots/wire/hold"):
        async with wire(r) as c:
            c.send(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}"
                "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                "2\r\n{}\r\n".encode()
            )
            await asyncio.sleep(0.1)
            c.send(b"zz\r\nnot a chunk\r\n0\r\n\r\n")
            if path.startswith("/v1/"):
                answer = await c.answer()
                assert answer.status == 400, answer
                assert TOKEN.encode() not in answer.body
            assert await c.closed()
    assert r.manager.view("wire").state is S.OFFLINE  # no lease, no load, no hold


async def test_heads_llhttp_refuses_are_handed_to_aiohttp(harness: Harness) -> None:
    r = await start_wire(harness)
    async with wire(r) as c:  # a malformed head: aiohttp's 400
        c.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
            b"Broken header\r\n\r\n{}"
        )
        assert (await c.answer()).status == 400
    async with wire(r) as c:  # bare LFs: aiohttp's 400 at once (the head never ends in CRLF)
        c.send(b"POST /v1/chat/completions HTTP/1.1\nHost: 127.0.0.1\nContent-Length: 2\n\n{}")
        assert (await c.answer()).status == 400
    async with wire(r) as c:  # no token: the data plane's 401 in OpenAI's shape
        c.send(post("/v1/embeddings", ask("length"), token="nope\xff"))
        answer = await c.answer()
        assert answer.status == 401 and answer.headers["www-authenticate"].startswith("Bearer")
        assert json.loads(answer.body)["error"]["code"] == "invalid_api_key"


# ============================================================================ the upstream


async def test_every_upstream_framing_reaches_the_client_whole(harness: Harness) -> None:
    r = await start_wire(harness)
    async with wire(r) as c:
        for mode, status in (
            ("length", 200),
            ("chunked", 201),
            ("204", 204),
            ("interim", 200),
            ("close", 200),  # HTTP/1.0 to the end of the connection: re-chunked
            ("length", 200),
        ):
            c.send(post("/v1/chat/completions?q=a%20b", ask(mode, mode_of=mode)))
            answer = await c.answer()
            assert answer.status == status, (mode, answer)
            if status == 204:
                assert answer.headers["x-empty"] == "yes"
                continue
            echoed = json.loads(answer.body)
            assert echoed["mode_of"] == mode
            assert echoed["_target"] == "/v1/chat/completions?q=a%20b"
            assert "authorization" not in echoed["_headers"]  # the controller's token stays
            assert echoed["_headers"]["host"].startswith("127.0.0.1:")
            if mode in ("chunked", "close"):
                assert answer.headers["transfer-encoding"] == "chunked"
    # One kept-alive upstream connection served it all but for the HTTP/1.0 answer.
    seen = await stats(r)
    assert seen["post_connections"] == 2 and seen["closed_post_connections"] == 1


async def test_hop_by_hop_headers_stay_on_their_hop(tmp_path: Path) -> None:
    """Issue 27: the headers a Connection header names were relayed (both directions),
    and a framing header spelt with "_" went upstream as it came (a server that folds "_"
    into "-" would read a Transfer-Encoding nobody checked)."""
    h = Harness(tmp_path)
    try:
        r = await start_wire(h)
        async with wire(r) as c:
            extra = (
                "Connection: keep-alive, X-Hop",
                "X-Hop: 1",
                "X-Kept: 1",
                "Transfer_Encoding: chunked",
                "Content_Length: 5",
            )
            c.send(post("/v1/chat/completions", ask("hop"), extra=extra))
            answer = await c.answer()
            assert answer.status == 200, answer
            got = json.loads(answer.body)["_headers"]
            assert got["x-kept"] == "1"
            assert not {"x-hop", "transfer_encoding", "content_length"} & set(got), got
            assert answer.headers["x-kept-answer"] == "1"
            assert "x-hop-answer" not in answer.headers, answer.headers
    finally:
        await h.close()


async def test_a_pooled_connection_closed_while_idle_is_replaced(harness: Harness) -> None:
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/completions", ask("drop-idle")))
        assert (await c.answer()).status == 200
        await asyncio.sleep(0.3)  # the upstream closes its idle side meanwhile
        c.send(post("/v1/completions", ask("length", n=5)))
        answer = await c.answer()
        assert answer.status == 200 and json.loads(answer.body)["n"] == 5
        # A pooled connection the server drops as the request arrives (its keep-alive
        # timeout racing our reuse): sent once more on a fresh connection.
        c.send(post("/v1/completions", ask("drop-next")))
        assert (await c.answer()).status == 200
        c.send(post("/v1/completions", ask("length", n=6)))
        answer = await c.answer()
        assert answer.status == 200 and json.loads(answer.body)["n"] == 6
    assert (await stats(r))["post_connections"] == 3


async def test_a_broken_upstream_is_502_or_a_cut_answer(harness: Harness) -> None:
    r = await start_wire(harness)
    # Issue 27: two Transfer-Encoding headers (the last won, gzip was dropped), a 101
    # (skipped as if interim: the next bytes were relayed as the answer), a control
    # character in a chunk extension (extensions went unchecked), an HTTP/1.7 status line
    # ("HTTP/1." was all that was checked) were relayed.
    broken = ("badhead", "badheader", "badchunk", "hugelength", "gzip-te")
    async with wire(r) as c:
        for mode in (*broken, "two-te", "switch-101", "badext", "http-1.7"):
            c.send(post("/v1/completions", ask(mode)))
            answer = await c.answer()
            assert answer.status == 502, (mode, answer)
            error = json.loads(answer.body)["error"]
            assert error["code"] == "upstream.failed"
            if mode == "hugelength":  # refused as such, not a crash of data_received
                assert "Content-Length" in error["message"], error  # llhttp says why
        c.send(post("/v1/completions", ask("cut-sse")))  # in-band: the stream's last event
        answer = await c.answer()
        events = [e for e in answer.body.split(b"\n\n") if e]
        assert events[0] == b'data: {"n": 1}'
        assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "upstream.failed"
    async with wire(r) as c:  # a sized body cut short: the client sees the cut, never "done"
        c.send(post("/v1/completions", ask("cut-length")))
        head = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 10)
        assert b"Content-Length: 100000" in head
        rest = await asyncio.wait_for(c.reader.read(), 10)
        assert rest == b"x" * 10  # then the connection closed
    async with wire(r) as c:  # a body to the end of the connection, cut by a reset: no end
        c.send(post("/v1/completions", ask("reset-close")))
        head = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 10)
        assert b"Transfer-Encoding: chunked" in head
        rest = await asyncio.wait_for(c.reader.read(), 10)
        assert not rest.endswith(b"0\r\n\r\n"), rest  # closed without the last chunk
    await wait_for(lambda: r.manager.view("wire").state is S.READY)  # the leases ended


@pytest.mark.timeout(30)
async def test_a_malformed_chunk_size_is_502_and_never_hangs_the_loop(harness: Harness) -> None:
    """A negative chunk size ("-6", which int(..., 16) takes) once sent the de-chunker
    back over the bytes it had read, for ever: the controller's loop hung."""
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/completions", ask("negchunk")))
        answer = await c.answer()
        assert answer.status == 502, answer
        assert json.loads(answer.body)["error"]["code"] == "upstream.failed"
    await wait_for(lambda: r.manager.view("wire").state is S.READY)  # the lease ended


async def test_a_slow_client_pauses_the_upstream(harness: Harness) -> None:
    """Flow control end to end: a client that reads nothing holds the upstream back
    (socket buffers, not the controller's memory); when it leaves, the upstream
    connection is closed and the lease released."""
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("flood", mib=256)))
        assert (await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 30)).startswith(
            b"HTTP/1.1 200"
        )
        await asyncio.sleep(1.0)
        written = (await stats(r))["written"]
        assert written < 64 << 20, written  # without flow control: all 256 MiB at once
        await c.reader.readexactly(4 << 20)  # reading lets it go on
    await wait_for(lambda: r.manager.view("wire").state is S.READY)
    seen = await stats_until(r, lambda s: s["closed_post_connections"] == s["post_connections"])
    assert seen["closed_post_connections"] == seen["post_connections"] == 1


async def test_a_client_that_leaves_closes_the_upstream_request(harness: Harness) -> None:
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("hang")))
        await wait_for(lambda: r.manager.view("wire").state is S.SERVING, timeout=30)
        await stats_until(r, lambda s: s["post_connections"] == 1)  # the upstream works on it
    await wait_for(lambda: r.manager.view("wire").state is S.READY)
    seen = await stats_until(r, lambda s: s["closed_post_connections"] == 1)
    assert seen["closed_post_connections"] == 1  # the server stops working on it


async def test_stopping_lets_a_request_in_flight_finish(harness: Harness) -> None:
    r = await start_wire(harness)
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("length")))  # loads the slot first
        assert (await c.answer()).status == 200
        c.send(post("/v1/chat/completions", ask("slow", delay=0.5, n=9)))
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(r.server.stop())
        answer = await c.answer()
        assert answer.status == 200 and json.loads(answer.body)["n"] == 9
        await stopping
        assert await c.closed()
    assert r.manager.view("wire").state is S.READY  # its lease ended
    with pytest.raises(aiohttp.ClientConnectionError):
        async with r.client.post(r.url("/v1/completions"), json=chat("m-chat")):
            pass
