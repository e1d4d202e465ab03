"""Malformed requests (issue 26, item 3): what aiohttp's parser refuses is answered ``400``
without echoing it and logged as one line without its bytes, rate-limited.

A real API server on 127.0.0.1 (the data plane's port, which hands aiohttp every head it
does not take, and the probe-only ``--metrics-listen`` app, aiohttp alone), raw TCP
clients sending each malformed head with a bearer token; the log is every record any
logger wrote meanwhile (caplog at DEBUG).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controller.api.assembly import build_probe_app
from controller.api.refused import REFUSALS, RefusalLog
from controller.api.server import ApiServer
from tests.integration.test_router import TOKEN, Harness, Router

SECRET = TOKEN.encode()

# Each head carries the token; each is refused by aiohttp's parser.
MALFORMED: dict[str, bytes] = {
    "bare-lf": (
        b"POST /v1/chat/completions HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer "
        + SECRET
        + b"\nContent-Length: 2\n\n{}"
    ),
    "conflicting-content-length": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + SECRET
        + b"\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"
    ),
    "content-length-and-chunked": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + SECRET
        + b"\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}"
    ),
    "obs-fold": (
        b"GET /api/slots HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + SECRET
        + b"\r\nX-Folded: one\r\n two\r\n\r\n"
    ),
    "nul": (
        b"GET /api/slots HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + SECRET
        + b"\r\nX-Nul: a\x00b\r\n\r\n"
    ),
}


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[tuple[Router, str]]:
    """The API (through the data plane) and a probe-only listener on one context."""
    harness = Harness(tmp_path)
    try:
        r = await harness.start([], [])
        probes = ApiServer(r.ctx, "127.0.0.1", 0, app_factory=build_probe_app)
        address = await probes.start()
        try:
            yield r, address
        finally:
            await probes.stop()
    finally:
        await harness.close()


def status_of(answer: bytes) -> int:
    parts = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def exchange(address: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the server answers until it closes."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.fixture(autouse=True)
def fresh_budget() -> None:
    """Each test starts with the whole line budget (the log is process-wide)."""
    REFUSALS._window = float("-inf")
    REFUSALS.suppressed = 0


@pytest.mark.parametrize("kind", sorted(MALFORMED))
async def test_a_malformed_request_is_a_400_that_echoes_and_logs_nothing_of_it(
    router: tuple[Router, str], kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: aiohttp logged "Error handling request" with a traceback carrying the raw
    head, token and all, and its 400 body echoed the head."""
    r, probes = router
    caplog.set_level(logging.DEBUG)
    for address in (r.base.removeprefix("http://"), probes):
        answer = await exchange(address, MALFORMED[kind])
        assert status_of(answer) == 400, answer
        assert SECRET not in answer
        assert b"Bearer" not in answer and b"X-" not in answer.partition(b"\r\n\r\n")[2]
    text = caplog.text
    assert SECRET.decode() not in text
    assert "Traceback" not in text and "Error handling request" not in text
    refused = [rec for rec in caplog.records if "refused a malformed HTTP request" in rec.message]
    assert len(refused) == 2, caplog.text  # one line per request: peer and reason
    assert all("127.0.0.1:" in rec.message for rec in refused)


async def test_a_flood_of_malformed_requests_costs_the_log_a_bounded_number_of_lines(
    router: tuple[Router, str], caplog: pytest.LogCaptureFixture
) -> None:
    r, probes = router
    caplog.set_level(logging.DEBUG)
    heads = list(MALFORMED.values())
    addresses = [r.base.removeprefix("http://"), probes]
    for start in range(0, 1000, 50):
        answers = await asyncio.gather(
            *(exchange(addresses[i % 2], heads[i % len(heads)]) for i in range(start, start + 50))
        )
        assert all(status_of(a) == 400 for a in answers)
    assert len(caplog.records) <= 10, caplog.text
    assert SECRET.decode() not in caplog.text
    assert REFUSALS.suppressed >= 990


def test_the_refusal_log_says_how_many_it_left_out() -> None:
    now = [0.0]
    refusals = RefusalLog(burst=2, window_s=10, clock=lambda: now[0])
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("slotctl.api")
    logger.addHandler(handler)
    try:
        for _ in range(7):
            refusals.note("127.0.0.1:1", "BadHttpMessage")
        now[0] = 10.0
        refusals.note("127.0.0.1:2", "InvalidHeader")
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 3
    assert "(5 more refused since, not logged)" in lines[2] and "InvalidHeader" in lines[2]
