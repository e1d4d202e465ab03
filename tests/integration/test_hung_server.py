"""A server that hangs after it was ready (issue 26): the router's upstream idle timeout.

Real demo servers (child processes of a real :class:`SlotManager`), stopped with
``SIGSTOP``: the kernel still accepts their connections and takes the requests into its
buffers, but not one byte comes back — what a wedged GPU server looks like from outside.
The router is the data plane (it serves every routed request). The controller's side
(liveness, the stop, the restart) is in ``tests/e2e/test_hung_server.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.model.lifecycle import SlotState
from tests.integration.test_dataplane import WIRE, ask, post, wire
from tests.integration.test_router import (
    Harness,
    Router,
    assert_openai_error,
    chat,
    model,
    read_events,
    wait_for,
)

S = SlotState


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        await h.close()


async def server_pid(r: Router, slot: str) -> int:
    observed = await r.manager.runtime.inspect(slot)
    pid = int(observed.ident or 0)
    assert pid > 0
    return pid


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The server stopped (``SIGSTOP``) for the block, resumed after it (teardown stops it)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def upstream_timeouts(r: Router, slot: str) -> float:
    async with r.get("/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(f'slotctl_upstream_timeouts_total{{slot="{slot}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_server_stopped_mid_stream_ends_the_stream_with_an_upstream_timeout(
    harness: Harness,
) -> None:
    """Before: the stream stayed open and silent as long as the server was stopped (the
    slot ``serving``, its lease held). Now: within ``upstream_idle_s`` (+ the sweep's
    second) the stream's last event is ``slot.upstream_timeout``, the lease is released
    and the timeout is counted."""
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "20", upstream_idle_s=1.0)],
        [model("m-chat")],
    )
    await r.manager.load("chat")
    pid = await server_pid(r, "chat")
    with contextlib.ExitStack() as stack:

        async def stop() -> None:
            stack.enter_context(stopped(pid))

        started = time.monotonic()
        async with r.post("/v1/chat/completions", chat("m-chat", 400, stream=True)) as resp:
            assert resp.status == 200
            events = await asyncio.wait_for(read_events(resp, stop), 20)
        took = time.monotonic() - started
        assert took < 6, took
        assert events[-1][1] != b"[DONE]"
        error = assert_openai_error(json.loads(events[-1][1]), "slot.upstream_timeout")
        assert "sent nothing for 1s" in error["message"]
        await wait_for(lambda: r.manager.lease_count() == 0, timeout=5)
        # The router ended the request; the server is the liveness probe's to judge.
        assert r.manager.view("chat").state is S.READY
        assert await upstream_timeouts(r, "chat") == 1


async def test_a_server_stopped_before_the_head_is_a_504_and_does_not_hold_the_next(
    harness: Harness,
) -> None:
    """Before: the request, and a second one to the same model, hung. Now: each is a
    ``504 slot.upstream_timeout`` after ``upstream_idle_s``, and no lease is left."""
    r = await harness.start(
        [harness.slot("chat", "m-chat", upstream_idle_s=1.0)], [model("m-chat")]
    )
    await r.manager.load("chat")
    with stopped(await server_pid(r, "chat")):

        async def one() -> tuple[int, Any, float]:
            started = time.monotonic()
            async with r.post("/v1/chat/completions", chat("m-chat", 2)) as resp:
                return resp.status, await resp.json(), time.monotonic() - started

        answers = await asyncio.wait_for(asyncio.gather(one(), one()), 20)
        for status, body, took in answers:
            assert status == 504, body
            assert_openai_error(body, "slot.upstream_timeout")
            assert took < 6, took
        await wait_for(lambda: r.manager.lease_count() == 0, timeout=5)
        assert await upstream_timeouts(r, "chat") == 2


async def test_a_stream_longer_than_upstream_idle_s_in_total_is_not_cut(harness: Harness) -> None:
    """The timeout is for silence, not for length: a slow stream (a token every 0.5 s,
    6 s in all) passes whole with ``upstream_idle_s`` 1.5 s, as does a slow first token
    (a non-streamed answer of 2 tokens, 1 s before its head)."""
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "2", upstream_idle_s=1.5)],
        [model("m-chat")],
    )
    await r.manager.load("chat")
    async with r.post("/v1/chat/completions", chat("m-chat", 12, stream=True)) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert events[-1][1] == b"[DONE]"
    assert events[-1][0] - events[0][0] > 5
    async with r.post("/v1/chat/completions", chat("m-chat", 2)) as resp:
        assert resp.status == 200, await resp.text()
    assert await upstream_timeouts(r, "chat") == 0


async def test_a_client_that_reads_slowly_is_not_an_upstream_timeout(harness: Harness) -> None:
    """A client that reads nothing for 3 s pauses the server's connection (flow control):
    that silence is the client's, not the server's, and the answer goes on whole."""
    upstream = harness.slot(
        "wire", "", provider="kokoro", memory_gb=1.0, server={"cmd": WIRE}, upstream_idle_s=1.0
    )
    r = await harness.start([upstream], [])
    size = 64 << 20
    async with wire(r) as c:
        c.send(post("/v1/chat/completions", ask("flood", mib=size >> 20)))
        head = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200"), head
        await asyncio.sleep(3.0)
        got = 0
        while got < size:
            data = await asyncio.wait_for(c.reader.read(1 << 20), 30)
            assert data, f"cut after {got} bytes"
            got += len(data)
    assert await upstream_timeouts(r, "wire") == 0


def fill_accept_queue(port: int, limit: int = 4096) -> list[socket.socket]:
    """Connections to a stopped server until its accept queue is full (a connect then
    gets no answer): what a server that stopped accepting looks like to a new client."""
    held: list[socket.socket] = []
    while len(held) < limit:
        sock = socket.socket()
        sock.setblocking(False)
        held.append(sock)
        if sock.connect_ex(("127.0.0.1", port)) not in (0, 115):  # EINPROGRESS
            break
        deadline = time.monotonic() + 1.0
        while True:
            try:
                sock.getpeername()
                break
            except OSError:
                if time.monotonic() > deadline:
                    return held  # this one got no answer: the queue is full
                time.sleep(0.005)
    raise AssertionError(f"the accept queue never filled ({len(held)} connections)")


async def test_a_server_that_takes_no_connection_is_a_504_after_the_connect_timeout(
    harness: Harness,
) -> None:
    """A stopped server whose accept queue is full: a new connection gets no answer. The
    connect timeout (10 s, or the slot's shorter ``upstream_idle_s``) ends the request
    with ``504 slot.upstream_timeout`` instead of the router's generic 502."""
    r = await harness.start(
        [harness.slot("chat", "m-chat", upstream_idle_s=1.0)], [model("m-chat")]
    )
    await r.manager.load("chat")
    endpoint = r.endpoint("chat")
    with stopped(await server_pid(r, "chat")):
        held = await asyncio.to_thread(fill_accept_queue, int(endpoint.rsplit(":", 1)[1]))
        try:
            started = time.monotonic()
            async with r.post("/v1/chat/completions", chat("m-chat", 2)) as resp:
                status, body = resp.status, await resp.json()
            took = time.monotonic() - started
        finally:
            for sock in held:
                sock.close()
    assert status == 504, body
    error = assert_openai_error(body, "slot.upstream_timeout")
    assert "took no connection within 1s" in error["message"]
    assert took < 5, took
    await wait_for(lambda: r.manager.lease_count() == 0, timeout=5)
