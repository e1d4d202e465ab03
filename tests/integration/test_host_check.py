"""DNS rebinding (issue 26, item 4): a request whose ``Host`` is none of the API's names
is refused with ``421 request.host_not_allowed`` before its token or its route is looked
at — on the data plane (every /v1 request) and on the REST API (aiohttp behind it).

A real API server on 127.0.0.1 (:class:`tests.integration.test_router.Harness`),
real demo servers, aiohttp's client naming the ``Host`` it likes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from controller.api.server import ApiServer
from tests.integration.test_router import AUTH, Harness, Router, chat, model

REFUSED = ("evil.example", "evil.example:8800", "127.0.0.1.nip.io", "localhost.evil.example")


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        await h.close()


async def ask(
    r: Router, base: str, method: str, path: str, host: str, body: Any = None
) -> tuple[int, Any]:
    headers = {**AUTH, "Host": host}
    json = body if method == "POST" else None
    async with r.client.request(method, base + path, json=json, headers=headers) as resp:
        data = await resp.json(content_type=None) if resp.status != 200 or path != "/" else None
        return resp.status, data


ROUTES = (
    ("POST", "/v1/chat/completions"),  # the data plane's
    ("GET", "/v1/models"),
    ("GET", "/api/slots"),  # the REST API
    ("GET", "/"),  # the dashboard
)


async def test_a_foreign_host_is_refused_with_421_everywhere(harness: Harness) -> None:
    """Before: any ``Host`` was served, so a page that rebinds its own name to 127.0.0.1
    could talk to the API from the browser."""
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    await r.manager.load("chat")
    for host in REFUSED:
        for method, path in ROUTES:
            status, body = await ask(r, r.base, method, path, host, chat("m-chat", 2))
            assert status == 421, (host, path, body)
            code = body["error"]["code"]
            assert code == "request.host_not_allowed", body
            assert "--allowed-host" in body["error"]["message"]
    # A wrong token with a foreign Host learns nothing about the token: 421, not 401.
    headers = {"Authorization": "Bearer wrong", "Host": "evil.example"}
    async with r.client.get(r.url("/api/slots"), headers=headers) as resp:
        assert resp.status == 421
    assert r.manager.view("chat").leases == 0  # nothing reached the server


async def test_its_own_names_and_address_literals_are_served(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    await r.manager.load("chat")
    port = r.base.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST.", "[::1]:1"):
        for method, path in ROUTES:
            status, body = await ask(r, r.base, method, path, host, chat("m-chat", 2))
            assert status == 200, (host, path, body)


async def test_allowed_host_adds_names_and_domains(harness: Harness) -> None:
    """``--allowed-host models.lan --allowed-host .corp.example``: those names (and the
    subdomains of the second) are served too; a name that merely contains one is not."""
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    await r.manager.load("chat")
    ctx = dataclasses.replace(r.ctx, allowed_hosts=("models.lan", ".corp.example"))
    server = ApiServer(ctx, "127.0.0.1", 0)
    base = f"http://{await server.start()}"
    try:
        for host in ("models.lan:8800", "corp.example", "gpu1.corp.example"):
            for method, path in ROUTES:
                status, body = await ask(r, base, method, path, host, chat("m-chat", 2))
                assert status == 200, (host, path, body)
        for host in ("corp.example.evil.com", "xcorp.example", "models.lan.evil.com"):
            status, _ = await ask(r, base, "GET", "/api/slots", host)
            assert status == 421, host
            status, _ = await ask(r, base, "POST", "/v1/chat/completions", host, chat("m-chat"))
            assert status == 421, host
    finally:
        await server.stop()
