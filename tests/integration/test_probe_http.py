"""The probe's models-list GET over plain asyncio streams (``controller.probes.http.get``),
against real servers on 127.0.0.1 that answer the ways HTTP/1.1 allows: Content-Length,
chunked, a body to EOF, no answer, not HTTP. The outcome is what aiohttp's client gave."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest

from controller.probes.readiness import HttpProber, ProbeOutcome, ProbeSpec
from tests.integration.helpers import free_port

MODELS = json.dumps({"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}).encode()

Answer = Callable[[bytes], bytes | None]


@asynccontextmanager
async def server(answer: Answer) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A raw TCP server: reads one request head, writes ``answer(head)`` and closes (None:
    never answers). Yields the endpoint and the request heads it got."""
    heads: list[bytes] = []
    silent: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        reply = answer(head)
        if reply is None:
            silent.append(writer)  # closed when the test is done
            return
        writer.write(reply)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", heads
    finally:
        for writer in silent:
            writer.close()
        srv.close()
        await srv.wait_closed()


def reply(status: str, body: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 {status}\r\n{head}\r\n".encode() + body


async def probe(endpoint: str, timeout_s: float = 5.0) -> tuple[ProbeOutcome, str, tuple[str, ...]]:
    prober = HttpProber(timeout_s=timeout_s)
    try:
        result = await prober.probe(endpoint, ProbeSpec(), slot="s")
    finally:
        await prober.close()
    return result.outcome, result.message, result.models


async def test_content_length_body_lists_the_models_and_the_request_is_plain_http11() -> None:
    answer = reply("200 OK", MODELS, f"Content-Length: {len(MODELS)}")
    async with server(lambda _: answer) as (endpoint, heads):
        outcome, _, models = await probe(endpoint)
    assert outcome is ProbeOutcome.READY and models == ("m1", "m2")
    request = heads[0].decode()
    assert request.startswith("GET /v1/models HTTP/1.1\r\n")
    assert f"Host: {endpoint.removeprefix('http://')}\r\n" in request
    assert "Connection: close\r\n" in request


async def test_chunked_body_with_extensions_and_trailers() -> None:
    half = len(MODELS) // 2
    chunks = (
        f"{half:x};ext=1\r\n".encode()
        + MODELS[:half]
        + b"\r\n"
        + f"{len(MODELS) - half:X}\r\n".encode()
        + MODELS[half:]
        + b"\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    answer = reply("200 OK", chunks, "Transfer-Encoding: chunked")
    async with server(lambda _: answer) as (endpoint, _):
        outcome, _, models = await probe(endpoint)
    assert outcome is ProbeOutcome.READY and models == ("m1", "m2")


async def test_body_without_a_length_ends_at_eof() -> None:
    async with server(lambda _: reply("200 OK", MODELS)) as (endpoint, _):
        outcome, _, models = await probe(endpoint)
    assert outcome is ProbeOutcome.READY and models == ("m1", "m2")


async def test_loading_and_empty_and_unparsable_answers() -> None:
    loading = reply("503 Service Unavailable", b'{"error":"loading"}', "Content-Length: 19")
    async with server(lambda _: loading) as (endpoint, _):
        outcome, message, _ = await probe(endpoint)
    assert outcome is ProbeOutcome.STILL_WARMING and message == "models list: HTTP 503"
    empty = reply("200 OK", b'{"data": []}', "Content-Length: 12")
    async with server(lambda _: empty) as (endpoint, _):
        assert (await probe(endpoint))[0] is ProbeOutcome.NO_MODEL
    not_json = reply("200 OK", b"<html>", "Content-Length: 6")
    async with server(lambda _: not_json) as (endpoint, _):
        assert (await probe(endpoint))[0] is ProbeOutcome.NO_MODEL  # up, lists nothing


async def test_no_answer_not_http_cut_short_or_refused_read_as_still_warming() -> None:
    async with server(lambda _: None) as (endpoint, _):
        outcome, message, _ = await probe(endpoint, timeout_s=0.3)
    assert outcome is ProbeOutcome.STILL_WARMING and "TimeoutError" in message
    async with server(lambda _: b"SSH-2.0-OpenSSH\r\n\r\n") as (endpoint, _):
        outcome, message, _ = await probe(endpoint)
    assert outcome is ProbeOutcome.STILL_WARMING and "bad HTTP answer" in message
    short = reply("200 OK", MODELS[:5], f"Content-Length: {len(MODELS)}")
    async with server(lambda _: short) as (endpoint, _):
        outcome, message, _ = await probe(endpoint)
    assert outcome is ProbeOutcome.STILL_WARMING and "IncompleteReadError" in message
    huge = reply("200 OK", b"", "Content-Length: 999999999999")
    async with server(lambda _: huge) as (endpoint, _):
        outcome, message, _ = await probe(endpoint)
    assert outcome is ProbeOutcome.STILL_WARMING and "Content-Length" in message
    outcome, message, _ = await probe(f"http://127.0.0.1:{free_port()}")
    assert outcome is ProbeOutcome.STILL_WARMING and "ConnectionRefusedError" in message


async def test_liveness_gets_its_own_endpoint_else_the_models_list() -> None:
    answer = reply("200 OK", b"{}", "Content-Length: 2")
    async with server(lambda _: answer) as (endpoint, heads):
        prober = HttpProber()
        try:
            own = await prober.liveness(endpoint, ProbeSpec(liveness_path="/health"), slot="s")
            models = await prober.liveness(endpoint, ProbeSpec(), slot="s")
        finally:
            await prober.close()
    assert own.outcome is models.outcome is ProbeOutcome.READY
    assert heads[0].startswith(b"GET /health HTTP/1.1\r\n")
    assert heads[1].startswith(b"GET /v1/models HTTP/1.1\r\n")


async def test_liveness_counts_only_silence() -> None:
    """Issue 26: a liveness probe is a miss (``HUNG``) only when not one byte comes within
    its timeout. A 503 (a busy llama-server: "no slot available") or an answer that
    starts in time and ends late are alive; one that is not HTTP at all, or a refused
    connection, is not hung either (a gone server is the exit check's)."""

    async def outcome(answer: Answer, timeout_s: float = 0.3) -> tuple[ProbeOutcome, str]:
        async with server(answer) as (endpoint, _):
            prober = HttpProber(timeout_s=5.0)
            try:
                result = await prober.liveness(endpoint, ProbeSpec(), slot="s", timeout_s=timeout_s)
            finally:
                await prober.close()
        return result.outcome, result.message

    hung, message = await outcome(lambda _: None)
    assert hung is ProbeOutcome.HUNG and "no byte within 0.3s" in message
    busy = reply("503 Service Unavailable", b"{}", "Content-Length: 2")
    assert (await outcome(lambda _: busy))[0] is ProbeOutcome.READY
    started = reply("200 OK", b"{", "Content-Length: 999")  # the head came, the body never
    assert (await outcome(lambda _: started))[0] is ProbeOutcome.READY
    for bad in (b"SSH-2.0-OpenSSH\r\n", b"HTTP/1.7 200 OK\r\n", b"HTTP/1.1 2000 OK\r\n"):
        # Issue 27: the status line is llhttp's to read (a hand split took 1.7 and 2000)
        assert await outcome(lambda _, bad=bad: bad) == (
            ProbeOutcome.STILL_WARMING,
            "liveness: /v1/models: an answer that is not HTTP",
        ), bad
    prober = HttpProber()
    try:
        refused = await prober.liveness(f"http://127.0.0.1:{free_port()}", ProbeSpec(), slot="s")
    finally:
        await prober.close()
    assert refused.outcome is ProbeOutcome.STILL_WARMING
    assert "ConnectionRefusedError" in refused.message


@contextmanager
def thread_server(answers: bool, busy: Callable[[], None]) -> Iterator[str]:
    """A TCP server on its own thread: for each request it first calls ``busy`` (the
    test makes the event loop busy with it), then answers an HTTP 200 at once, or
    (``answers=False``) nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(conn)
            conn.recv(65536)
            busy()
            if answers:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


@pytest.mark.parametrize("answers", [True, False])
async def test_the_loops_own_lateness_is_not_the_servers_silence(answers: bool) -> None:
    """Issue 28: an operator with a thousand slots runs its callbacks late. The server
    here answers the moment it has the request, but the loop is blocked for 1 s (three
    liveness timeouts) from just before the answer: the answer waits in the socket while
    the timeout falls due. That server is alive, not hung (it was taken for hung, and
    restarted, before); one that sends nothing is still hung."""
    loop = asyncio.get_running_loop()
    blocked = threading.Event()

    def busy() -> None:  # on the server's thread: the loop sleeps 1 s, then it answers
        loop.call_soon_threadsafe(lambda: (blocked.set(), time.sleep(1.0)))
        blocked.wait(5)
        time.sleep(0.05)

    with thread_server(answers, busy) as endpoint:
        prober = HttpProber()
        try:
            result = await prober.liveness(endpoint, ProbeSpec(), slot="s", timeout_s=0.3)
        finally:
            await prober.close()
    assert blocked.is_set()
    if answers:
        assert result.outcome is ProbeOutcome.READY, result.message
    else:
        assert result.outcome is ProbeOutcome.HUNG, result.message
        assert "no byte within 0.3s" in result.message


async def test_a_closed_prober_opens_no_new_session() -> None:
    """A probe still running when the manager closes the prober (shutdown) opens no
    session that nobody would close (an unclosed connector): it answers without one."""
    answer = reply("200 OK", MODELS, f"Content-Length: {len(MODELS)}")
    async with server(lambda _: answer) as (endpoint, heads):
        prober = HttpProber()
        await prober.liveness(endpoint, ProbeSpec(), slot="s")
        await prober.close()
        ready = await prober.probe(endpoint, ProbeSpec(), slot="s")
        alive = await prober.liveness(endpoint, ProbeSpec(), slot="s")
        await prober.close()  # twice is fine
    assert ready.outcome is ProbeOutcome.STILL_WARMING and "closed" in ready.message
    assert alive.outcome is ProbeOutcome.READY and "closed" in alive.message
    assert prober._session is None
    assert len(heads) == 1  # only the probe before the close reached the server


async def test_the_sentinel_goes_over_the_same_plain_client_with_its_json_body() -> None:
    """The sentinel (the last request of a load) is sent as the models list is: plain
    HTTP/1.1 with its JSON body; a 2xx is ready, anything else still warming."""
    from controller.probes.http import HttpCall

    requests: list[tuple[bytes, bytes]] = []
    sentinel_status = ["503 Service Unavailable"]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length)
        requests.append((head, body))
        if head.startswith(b"GET /v1/models "):
            writer.write(reply("200 OK", MODELS, f"Content-Length: {len(MODELS)}"))
        else:
            writer.write(reply(sentinel_status[0], b'{"ok": 1}', "Content-Length: 9"))
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    endpoint = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    body = {"model": "m1", "prompt": "é", "max_tokens": 1}
    spec = ProbeSpec(sentinel=HttpCall("POST", "/v1/completions", body))
    prober = HttpProber()
    try:
        warming = await prober.probe(endpoint, spec, slot="s")
        sentinel_status[0] = "200 OK"
        ready = await prober.probe(endpoint, spec, slot="s")
    finally:
        await prober.close()
        srv.close()
        await srv.wait_closed()
    assert warming.outcome is ProbeOutcome.STILL_WARMING
    assert warming.message == "sentinel /v1/completions: HTTP 503"
    assert ready.outcome is ProbeOutcome.READY and ready.models == ("m1", "m2")
    assert ready.message == "/v1/completions answered"
    head, sent = requests[-1]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"User-Agent: slotctl-probe\r\n" in head
    assert b"Content-Type: application/json\r\n" in head
    assert json.loads(sent) == body


@asynccontextmanager
async def keep_alive_server(
    close_after: Callable[[bytes], bool] = lambda head: False,
    models_head: tuple[str, ...] = (f"Content-Length: {len(MODELS)}",),
) -> AsyncIterator[tuple[str, list[list[bytes]]]]:
    """A raw HTTP/1.1 server that keeps connections open (as llama-server, uvicorn and
    the demo server do) unless the request says ``Connection: close`` or
    ``close_after(head)`` (then it closes without saying so). Yields the endpoint and the
    request heads, one list per connection."""
    connections: list[list[bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads: list[bytes] = []
        connections.append(heads)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                heads.append(head)
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                if head.startswith(b"GET /v1/models "):
                    writer.write(reply("200 OK", MODELS, *models_head))
                else:
                    writer.write(reply("200 OK", b'{"ok": 1}', "Content-Length: 9"))
                await writer.drain()
                if b"Connection: close" in head or close_after(head):
                    return
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", connections
    finally:
        srv.close()
        await srv.wait_closed()


async def _ready_attempt(endpoint: str) -> tuple[ProbeOutcome, str]:
    from controller.probes.http import HttpCall

    spec = ProbeSpec(sentinel=HttpCall("POST", "/v1/completions", {"max_tokens": 1}))
    prober = HttpProber()
    try:
        result = await prober.probe(endpoint, spec, slot="s")
    finally:
        await prober.close()
    return result.outcome, result.message


async def test_a_ready_attempt_sends_the_sentinel_on_the_models_list_connection() -> None:
    """The models list asks to keep the connection when a sentinel may follow; the
    sentinel goes on it and closes it: one connection a ready attempt, not two."""
    async with keep_alive_server() as (endpoint, connections):
        outcome, message = await _ready_attempt(endpoint)
    assert (outcome, message) == (ProbeOutcome.READY, "/v1/completions answered")
    assert len(connections) == 1 and len(connections[0]) == 2, connections
    listed, sentinel = connections[0]
    assert listed.startswith(b"GET /v1/models ") and b"Connection: keep-alive\r\n" in listed
    assert sentinel.startswith(b"POST /v1/completions ") and b"Connection: close\r\n" in sentinel


async def test_the_sentinel_takes_a_fresh_connection_when_the_first_cannot_carry_it() -> None:
    """A models list answered with ``Connection: close``, or with a body that ends at
    EOF, ends its connection; a server that closes a kept connection without saying so
    (a stale keep-alive) is asked again on a fresh one. Each is still ready."""
    cases: list[tuple[Callable[[bytes], bool], tuple[str, ...]]] = [
        (lambda head: False, (f"Content-Length: {len(MODELS)}", "Connection: close")),
        (lambda head: head.startswith(b"GET "), ()),  # no length: the body ends at EOF
        (lambda head: head.startswith(b"GET "), (f"Content-Length: {len(MODELS)}",)),
    ]
    for close_after, models_head in cases:
        async with keep_alive_server(close_after, models_head) as (endpoint, connections):
            outcome, message = await _ready_attempt(endpoint)
        assert (outcome, message) == (ProbeOutcome.READY, "/v1/completions answered"), models_head
        heads = [head[:5] for conn in connections for head in conn]
        assert heads == [b"GET /", b"POST "] and len(connections) == 2, connections


async def test_without_a_sentinel_or_when_still_loading_the_connection_is_closed() -> None:
    """Only a request that may be followed asks to keep the connection; a 503 (loading)
    ends the attempt and its connection."""
    async with keep_alive_server() as (endpoint, connections):
        assert (await probe(endpoint))[0] is ProbeOutcome.READY  # no sentinel
    assert b"Connection: close\r\n" in connections[0][0]
    loading = reply("503 Service Unavailable", b"{}", "Content-Length: 2")
    async with server(lambda _: loading) as (endpoint, heads):
        outcome, message = await _ready_attempt(endpoint)
    assert outcome is ProbeOutcome.STILL_WARMING and message == "models list: HTTP 503"
    assert len(heads) == 1 and b"Connection: keep-alive\r\n" in heads[0]


async def test_answers_llhttp_refuses_are_no_models_list() -> None:
    """Issue 27: the probe read answers with a parser of its own that took what llhttp
    (and aiohttp's client) refuse: a chunk size ``int(..., 16)`` takes (``0x…``, ``-…``),
    an HTTP/1.7 status line, a folded header, two lengths (the last won), a length beside
    chunks, a 101 (read as interim), a head too large (a stream error, not HTTP's). Each
    is now "bad HTTP answer": still warming, never a models list."""
    chunked = "Transfer-Encoding: chunked"
    for bad in (
        reply("200 OK", b"0x%x\r\n" % len(MODELS) + MODELS + b"\r\n0\r\n\r\n", chunked),
        reply("200 OK", MODELS, f"Content-Length: {len(MODELS)}").replace(b"1.1", b"1.7", 1),
        reply("200 OK", MODELS, "X-Fold: a", " b", f"Content-Length: {len(MODELS)}"),
        reply("200 OK", MODELS, f"Content-Length: {len(MODELS)}", "Content-Length: 2"),
        reply("200 OK", MODELS, f"Content-Length: {len(MODELS)}", chunked),
        reply("101 Switching Protocols", MODELS, "Upgrade: websocket", "Connection: upgrade"),
        reply("200 OK", MODELS, "X-Big: " + "a" * 70_000, f"Content-Length: {len(MODELS)}"),
    ):
        async with server(lambda _, bad=bad: bad) as (endpoint, _):
            outcome, message, models = await probe(endpoint)
        assert outcome is ProbeOutcome.STILL_WARMING and "bad HTTP answer" in message, message
        assert models == ()


async def test_bytes_after_a_whole_answer_are_not_the_next_answer() -> None:
    """Issue 27: bytes after the models list's whole answer (a second answer nobody asked
    for) were left on the kept connection and read as the sentinel's answer (HTTP 500
    here). The connection is now not reused: the sentinel goes on a fresh one."""
    answer = reply("200 OK", MODELS, f"Content-Length: {len(MODELS)}")
    extra = reply("500 Internal Server Error", b"", "Content-Length: 0")
    async with server(lambda _: answer + extra) as (endpoint, heads):
        outcome, message = await _ready_attempt(endpoint)
    assert (outcome, message) == (ProbeOutcome.READY, "/v1/completions answered")
    assert [head[:5] for head in heads] == [b"GET /", b"POST "]
