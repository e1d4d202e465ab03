"""The OpenAI-compatible router against a real API server on 127.0.0.1 (SPEC §7, issue 6).

Each test builds a real :class:`SlotManager` on :class:`ProcessRuntime` (demo servers as
child processes, real health probes, the real clock) and serves it with
:class:`ApiServer` on port 0; requests go over TCP with aiohttp's client. Memory is
deterministic: the ``gpu`` device has no probe and a configured budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.api.app import REQUEST_RECORDER, ApiContext
from controller.api.assembly import ROUTES
from controller.api.server import ApiServer
from controller.model.errors import SlotctlError
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import HttpProber
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ADMITTED_STATES, ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.integration.helpers import free_port

S = SlotState
TOKEN = "router-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def model(model_id: str, gb: float = 1.0, group: str | None = None) -> ModelSpec:
    return ModelSpec(id=model_id, source=f"demo://{model_id}", memory_gb=gb, exclusive_group=group)


def chat(model_id: str, max_tokens: int = 4, *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": model_id,
        "messages": [{"role": "user", "content": "hello router"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


# ============================================================================ harness


@dataclass
class Router:
    """A manager, the API server in front of it and a client session."""

    manager: SlotManager
    ctx: ApiContext
    server: ApiServer
    client: aiohttp.ClientSession
    base: str

    def url(self, path: str) -> str:
        return self.base + path

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        headers = {**AUTH, **kw.pop("headers", {})}
        if body is not None and "data" not in kw:
            kw["json"] = body
        return self.client.post(self.url(path), headers=headers, **kw)

    def get(self, path: str, **kw: Any) -> Any:
        return self.client.get(self.url(path), headers={**AUTH, **kw.pop("headers", {})}, **kw)

    def endpoint(self, slot: str) -> str:
        endpoint = self.manager.view(slot).endpoint
        assert endpoint is not None
        return endpoint


@dataclass
class Harness:
    tmp: Path
    budget_gb: float = 8.0
    routers: list[Router] = field(default_factory=list)
    stops: list[tuple[asyncio.Event, asyncio.Task[None]]] = field(default_factory=list)
    _ports: set[int] = field(default_factory=set)

    def port(self) -> int:
        while True:
            port = free_port()
            if port not in self._ports:
                self._ports.add(port)
                return port

    def settings(self) -> ControllerSettings:
        return ControllerSettings(memory_budget_gb={"gpu": self.budget_gb}, safety_margin_gb=0)

    def slot(self, name: str, model_id: str, *args: str, **kw: Any) -> SlotSpec:
        data: dict[str, Any] = {
            "name": name,
            "provider": "demo",
            "port": self.port(),
            "model": {"default": model_id},
            "device": "gpu",
            "autoload": False,
            "pinned": False,
            "server": {"extra_args": list(args)},
        }
        data.update(kw)
        return normalise(SlotSpec.model_validate(data), self.settings())

    async def start(
        self,
        slots: Sequence[SlotSpec],
        models: Sequence[ModelSpec],
        config: ManagerConfig | None = None,
    ) -> Router:
        state_dir, config_dir = self.tmp / "state", self.tmp / "config"
        manager = SlotManager(
            runtime=ProcessRuntime(state_dir, kill_grace_s=5.0),
            state_dir=state_dir,
            config_dir=config_dir,
            settings=self.settings(),
            prober=HttpProber(timeout_s=5.0),
            memory=FakeMemoryProbe({}),
            config=config or ManagerConfig(stop_timeout_s=5.0),
        )
        desired = DesiredState(
            stacks=("router",),
            models={m.id: m for m in models},
            slots={s.name: DesiredSlot(spec=s, stack="router") for s in slots},
        )
        await manager.set_desired(desired)
        stop = asyncio.Event()
        self.stops.append((stop, asyncio.create_task(manager.run(stop))))
        ctx = ApiContext(
            manager=manager,
            reconciler=None,
            config_dir=config_dir,
            state_dir=state_dir,
            token=TOKEN,
            events=manager.events,
        )
        ctx.ready.set()
        server = ApiServer(ctx, "127.0.0.1", 0)
        address = await server.start()
        client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        router = Router(manager, ctx, server, client, f"http://{address}")
        self.routers.append(router)
        return router

    async def close(self) -> None:
        for router in self.routers:
            await router.client.close()
            await router.server.stop()
        for stop, task in self.stops:
            stop.set()
            await task
        for router in self.routers:
            with contextlib.suppress(SlotctlError):
                await router.manager.stop_all(reason="test teardown")
            await router.manager.close()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """A routed request's one path: the data plane (controller/dataplane/) driving the
    routed call (controller/router/call.py)."""
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        await h.close()


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> float:
    """Poll until ``predicate``; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def assert_openai_error(body: Any, code: str | None = None) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


async def read_events(
    response: aiohttp.ClientResponse, on_first: Callable[[], Awaitable[None]] | None = None
) -> list[tuple[float, bytes]]:
    """SSE events (``data: ...`` payloads) with the monotonic time each was complete."""
    events: list[tuple[float, bytes]] = []
    buffer = b""
    async for chunk in response.content.iter_any():
        now = time.monotonic()
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            events.append((now, event[len(b"data: ") :]))
            if len(events) == 1 and on_first is not None:
                await on_first()
    return events


def content_of(events: Sequence[tuple[float, bytes]]) -> str:
    text = []
    for _, data in events:
        if data == b"[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            text.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(text)


# ============================================================================ streaming


async def test_streaming_passes_each_chunk_through_as_it_arrives(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "10")], [model("m-chat")]
    )
    await r.manager.load("chat")
    seen_serving: list[tuple[SlotState, int]] = []

    async def during() -> None:
        view = r.manager.view("chat")
        seen_serving.append((view.state, view.leases))

    started = time.monotonic()
    async with r.post("/v1/chat/completions", chat("m-chat", 10, stream=True)) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert "Authorization" not in resp.headers
        events = await read_events(resp, during)
    offsets = [t - started for t, _ in events]

    # role chunk, 10 tokens, finish chunk, [DONE]: every event arrives on its own, paced
    # by the upstream (10 tokens/s), not in one burst at the end.
    assert len(events) == 13, events
    assert events[-1][1] == b"[DONE]"
    assert offsets[0] < 0.5, offsets
    assert offsets[-1] > 0.8, offsets
    token_times = offsets[1:11]
    assert token_times == sorted(token_times)
    assert token_times[-1] - token_times[0] > 0.7, token_times  # ~0.9 s at 10 tokens/s
    assert len({round(t, 2) for t in token_times}) >= 8, token_times
    assert seen_serving == [(S.SERVING, 1)]
    assert r.manager.lease_count() == 0
    assert r.manager.view("chat").state is S.READY

    # The bytes are the upstream's: the same tokens as asking the demo server directly.
    async with r.client.post(
        r.endpoint("chat") + "/v1/chat/completions", json=chat("m-chat", 10, stream=True)
    ) as direct:
        assert content_of(await read_events(direct)) == content_of(events)


async def test_json_endpoints_models_list_and_query_pass_through(harness: Harness) -> None:
    r = await harness.start(
        [
            harness.slot("chat", "m-chat", "--tokens-per-second", "0"),
            harness.slot("emb", "m-emb", "--embedding-dim", "8", type="embedding"),
        ],
        [model("m-chat"), model("m-emb"), model("m-unserved")],
    )
    async with r.get("/v1/models") as resp:
        assert resp.status == 200
        listing = await resp.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["m-chat", "m-emb"]  # catalogue order
    for entry in listing["data"]:
        assert entry["object"] == "model" and isinstance(entry["created"], int)
        assert entry["owned_by"] == "slotctl"

    # Cold: the first request loads the slot, then is served.
    body = {"model": "m-chat", "prompt": "once upon", "max_tokens": 3}
    async with r.post("/v1/completions", body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    assert answer["object"] == "text_completion" and answer["model"] == "m-chat"
    assert answer["usage"]["completion_tokens"] == 3

    async with r.post("/v1/embeddings", {"model": "m-emb", "input": ["a", "b"]}) as resp:
        assert resp.status == 200, await resp.text()
        vectors = await resp.json()
    assert [len(d["embedding"]) for d in vectors["data"]] == [8, 8]

    # An upstream refusal passes through unchanged (status and body).
    async with r.post("/v1/chat/completions", {"model": "m-chat", "messages": []}) as resp:
        assert resp.status == 400
        upstream_error = (await resp.json())["error"]  # the demo's own body, code null
        assert upstream_error["param"] == "messages" and upstream_error["code"] is None
    assert r.manager.lease_count() == 0
    assert {v.state for v in r.manager.views()} == {S.READY}


ECHO_SERVER = """
import sys
from aiohttp import web

port, model = int(sys.argv[1]), sys.argv[2]


async def models(request):
    return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})


async def echo(request):
    body = await request.read()
    return web.Response(
        body=body,
        content_type="application/octet-stream",
        headers={
            "X-Echo-Content-Type": request.headers.get("Content-Type", ""),
            "X-Echo-Path": request.path_qs,
            "X-Echo-Authorization": request.headers.get("Authorization", "(none)"),
        },
    )


app = web.Application(client_max_size=64 * 2**20)
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/audio/{path:.+}", echo)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


async def test_audio_multipart_body_passes_through_byte_for_byte(harness: Harness) -> None:
    script = harness.tmp / "echo_server.py"
    script.write_text(ECHO_SERVER)
    stt = harness.slot(
        "stt",
        "m-stt",
        provider="openai-compatible",
        type="stt",
        server={"cmd": [sys.executable, str(script), "{port}", "{model_id}"]},
    )
    r = await harness.start([stt], [model("m-stt")])

    boundary = "slotctl-router-test-boundary"
    audio = random.Random(7).randbytes(3 * 1024 * 1024)  # larger than the whole-relay cap
    body = (
        (
            f"--{boundary}\r\n"
            'Content-Disposition: form-data; name="file"; filename="clip.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + audio
        + (
            f"\r\n--{boundary}\r\n"
            'Content-Disposition: form-data; name="model"\r\n\r\n'
            f"m-stt\r\n--{boundary}--\r\n"
        ).encode()
    )
    content_type = f"multipart/form-data; boundary={boundary}"
    async with r.post(
        "/v1/audio/transcriptions?language=en",
        data=io.BytesIO(body),
        headers={"Content-Type": content_type},
    ) as resp:
        assert resp.status == 200, await resp.text()
        echoed = await resp.read()
        assert resp.headers["X-Echo-Content-Type"] == content_type
        assert resp.headers["X-Echo-Path"] == "/v1/audio/transcriptions?language=en"
        assert resp.headers["X-Echo-Authorization"] == "(none)"  # our token never leaks
    assert echoed == body

    # Only the OpenAI endpoint itself is forwarded: no way out to a server's other routes.
    for sneaky in ("/v1/audio/../../slots/0?action=save", "/v1/audio/%2e%2e/%2e%2e/props"):
        async with r.post(sneaky, {"model": "m-stt"}) as resp:
            assert resp.status in (400, 404), sneaky
            if resp.status == 400:
                assert_openai_error(await resp.json())
    assert r.manager.lease_count() == 0

    as_json = {"model": "m-stt", "input": "hello", "voice": "alloy"}  # a JSON audio body
    async with r.post("/v1/audio/translations", as_json) as resp:
        assert resp.status == 200
        assert json.loads(await resp.read()) == as_json
    async with r.post("/v1/audio/speech", as_json) as resp:  # speech is a tts slot's
        assert resp.status == 400
        assert assert_openai_error(await resp.json())["param"] == "model"

    missing = body.replace(b'name="model"', b'name="other"')
    async with r.post(
        "/v1/audio/transcriptions", data=io.BytesIO(missing), headers={"Content-Type": content_type}
    ) as resp:
        assert resp.status == 400
        assert_openai_error(await resp.json())
    assert r.manager.lease_count() == 0


# ============================================================================ load


async def test_200_concurrent_requests_across_3_models_with_swaps(harness: Harness) -> None:
    """3 models on a budget that fits 2; a and b share an exclusive group, so they swap."""
    harness.budget_gb = 2.0
    args = ("--tokens-per-second", "200")
    slots = [
        harness.slot("a", "m-a", *args, drain_timeout_s=10),
        harness.slot("b", "m-b", *args, drain_timeout_s=10),
        harness.slot("c", "m-c", *args, drain_timeout_s=10),
    ]
    models = [model("m-a", 1, group="g"), model("m-b", 1, group="g"), model("m-c", 1)]
    r = await harness.start(slots, models)
    budget = 2 * GIB
    violations: list[str] = []
    sampling = True

    async def sample() -> None:
        while sampling:
            admitted = r.manager.admitted_bytes("gpu")
            states = {v.name: v.state for v in r.manager.views()}
            if admitted > budget:
                violations.append(f"admitted {admitted} > budget: {states}")
            if states["a"] in ADMITTED_STATES and states["b"] in ADMITTED_STATES:
                violations.append(f"both exclusive members admitted: {states}")
            await asyncio.sleep(0.005)

    rng = random.Random(2024)
    plan = [(rng.choice("abc"), rng.random() < 0.5, rng.uniform(0.0, 3.0)) for _ in range(200)]

    async def one(slot: str, stream: bool, delay: float) -> tuple[str, int, Any, dict[str, str]]:
        await asyncio.sleep(delay)
        async with r.post("/v1/chat/completions", chat(f"m-{slot}", 4, stream=stream)) as resp:
            raw = await resp.read()
            headers = dict(resp.headers)
            if resp.status == 200 and stream:
                assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
                return slot, 200, None, headers
            return slot, resp.status, json.loads(raw), headers

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    try:
        async with asyncio.timeout(100):  # never a hang
            results = await asyncio.gather(*(one(*p) for p in plan))
    finally:
        sampling = False
        await sampler
    elapsed = time.monotonic() - started

    by_status: dict[int, int] = {}
    for slot, status, body, headers in results:
        by_status[status] = by_status.get(status, 0) + 1
        assert status in (200, 429, 503), (slot, status, body)
        if status == 200:
            if body is not None:
                assert body["object"] == "chat.completion" and body["model"] == f"m-{slot}"
            continue
        error = assert_openai_error(body)  # typed, never a 5xx without a body
        assert int(headers["Retry-After"]) >= 1, headers
        assert error["code"] in ("slot.queue_full", "slot.not_ready"), error
    served = {s for s, status, _, _ in results if status == 200}
    assert served == {"a", "b", "c"}, by_status
    assert by_status[200] >= 100, by_status

    swaps = [t for t in r.manager.transitions if t[0] in "ab" and t[2] == "unloading"]
    assert swaps, "the exclusive group never swapped"
    assert violations == []
    # Leases never leak: every response is complete, so every lease is back.
    assert r.manager.lease_count() == 0
    assert all(v.state is not S.SERVING and v.waiters == 0 for v in r.manager.views())
    print(f"\n200 requests in {elapsed:.1f}s: {by_status}, {len(swaps)} swap(s)")


async def test_exclusive_swap_serves_the_waiters_of_both_members(harness: Harness) -> None:
    """Cold cohorts of both group members: each load's waiters get their leases before the
    peer's queued swap unloads it (they used to get 503 ``slot is unloading``, every time).
    """
    slots = [harness.slot("a", "m-a"), harness.slot("b", "m-b")]
    r = await harness.start(slots, [model("m-a", 1, group="g"), model("m-b", 1, group="g")])

    async def one(name: str) -> int:
        async with r.post("/v1/chat/completions", chat(f"m-{name}")) as resp:
            await resp.read()
            return resp.status

    statuses = await asyncio.gather(*(one(n) for n in "ab" * 15))
    assert statuses == [200] * 30
    assert r.manager.lease_count() == 0
    swaps = [t for t in r.manager.transitions if t[2] == "unloading"]
    assert len(swaps) == 1, swaps  # one swap: each cohort served by one load


# ============================================================================ release


async def test_client_disconnect_mid_stream_releases_the_lease(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "10")], [model("m-chat")]
    )
    await r.manager.load("chat")
    resp = await r.post("/v1/chat/completions", chat("m-chat", 200, stream=True))
    assert resp.status == 200
    first = await resp.content.readany()
    assert first.startswith(b"data: ")
    assert r.manager.lease_count() == 1 and r.manager.view("chat").state is S.SERVING

    resp.close()  # drops the connection mid-stream (20 s of tokens left)
    took = await wait_for(lambda: r.manager.lease_count() == 0, timeout=5)
    assert took < 1.0, took
    await wait_for(lambda: r.manager.view("chat").state is S.READY, timeout=2)

    # The slot serves the next request normally.
    async with r.post("/v1/chat/completions", chat("m-chat", 1)) as again:
        assert again.status == 200


async def test_client_disconnect_while_waiting_releases_the_lease(harness: Harness) -> None:
    """Non-streaming: the client leaves while the upstream still generates (no byte sent)."""
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "10")], [model("m-chat")]
    )
    await r.manager.load("chat")

    async def call() -> None:
        async with r.post("/v1/chat/completions", chat("m-chat", 100)) as resp:
            await resp.read()

    task = asyncio.create_task(call())
    await wait_for(lambda: r.manager.lease_count() == 1, timeout=5)
    task.cancel()  # closes the client's connection
    with contextlib.suppress(asyncio.CancelledError):
        await task
    took = await wait_for(lambda: r.manager.lease_count() == 0, timeout=5)
    assert took < 1.0, took
    assert r.manager.view("chat").state is S.READY


async def test_client_disconnect_during_a_cold_load_leaves_the_queue(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("cold", "m-cold", "--load-seconds", "2")], [model("m-cold")]
    )

    async def call() -> None:
        async with r.post("/v1/chat/completions", chat("m-cold")) as resp:
            await resp.read()

    task = asyncio.create_task(call())
    await wait_for(lambda: r.manager.view("cold").waiters == 1, timeout=5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    took = await wait_for(lambda: r.manager.view("cold").waiters == 0, timeout=5)
    assert took < 1.0, took
    # Nobody wants it any more: once the load settles the manager unloads it again.
    await wait_for(lambda: r.manager.view("cold").state is S.OFFLINE, timeout=15)
    assert r.manager.lease_count() == 0


async def test_upstream_crash_mid_stream_ends_with_an_error_event(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "10")], [model("m-chat")]
    )
    await r.manager.load("chat")
    observed = await r.manager.runtime.inspect("chat")
    pid = int(observed.ident or 0)
    assert pid > 0

    async def kill() -> None:
        os.kill(pid, signal.SIGKILL)

    started = time.monotonic()
    async with r.post("/v1/chat/completions", chat("m-chat", 100, stream=True)) as resp:
        assert resp.status == 200
        events = await read_events(resp, kill)
    assert time.monotonic() - started < 5
    assert events[-1][1] != b"[DONE]"
    last = json.loads(events[-1][1])
    error = assert_openai_error(last)
    assert error["code"] in ("upstream.failed", "slot.health_failed"), error
    assert r.manager.lease_count() == 0
    await wait_for(lambda: r.manager.view("chat").state is S.ERROR, timeout=5)


async def test_lease_revoked_mid_request_answers_503(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "10", drain_timeout_s=0.3)],
        [model("m-chat")],
    )
    await r.manager.load("chat")

    async def call() -> tuple[int, Any, float]:
        started = time.monotonic()
        async with r.post("/v1/chat/completions", chat("m-chat", 100)) as resp:
            return resp.status, await resp.json(), time.monotonic() - started

    task = asyncio.create_task(call())
    await wait_for(lambda: r.manager.lease_count() == 1, timeout=5)
    await r.manager.unload("chat")  # drains 0.3 s, then revokes the lease
    status, body, took = await task
    assert status == 503, body
    assert_openai_error(body, "slot.not_ready")
    assert took < 3, took
    assert r.manager.lease_count() == 0
    assert r.manager.view("chat").state is S.OFFLINE


async def test_upstream_error_answers_502_and_releases(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--crash-after", "1")], [model("m-chat")]
    )
    await r.manager.load("chat")  # the probe's sentinel request is the one served
    async with r.post("/v1/chat/completions", chat("m-chat")) as resp:
        assert resp.status == 502
        assert resp.headers["Content-Type"].startswith("application/json")
        error = assert_openai_error(await resp.json())
    assert error["code"].startswith("upstream."), error
    assert error["type"] == "server_error"
    assert r.manager.lease_count() == 0


# ============================================================================ refusals


async def test_crash_looping_and_failed_loads_are_typed(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("bad", "m-bad", "--fail-on-load")],
        [model("m-bad")],
        ManagerConfig(stop_timeout_s=5.0, breaker_base_s=30.0),
    )
    async with r.post("/v1/chat/completions", chat("m-bad")) as resp:
        assert resp.status == 502
        assert_openai_error(await resp.json(), "slot.spawn_failed")
    async with r.post("/v1/chat/completions", chat("m-bad")) as resp:
        assert resp.status == 503
        assert 1 <= int(resp.headers["Retry-After"]) <= 30
        error = assert_openai_error(await resp.json(), "slot.crash_looping")
    assert error["type"] == "unavailable_error"
    assert r.manager.lease_count() == 0


async def test_insufficient_memory_is_503_with_retry_after(harness: Harness) -> None:
    harness.budget_gb = 2.0
    r = await harness.start([harness.slot("huge", "m-huge")], [model("m-huge", 4)])
    async with r.post("/v1/chat/completions", chat("m-huge")) as resp:
        assert resp.status == 503  # not the explicit-load API's 409
        assert int(resp.headers["Retry-After"]) >= 1
        assert_openai_error(await resp.json(), "model.insufficient_memory")
    assert r.manager.view("huge").state is S.OFFLINE


async def test_queue_full_is_429_with_retry_after(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("cold", "m-cold", "--load-seconds", "1.5", max_queue=2)],
        [model("m-cold")],
    )

    async def one() -> tuple[int, Any, dict[str, str]]:
        async with r.post("/v1/chat/completions", chat("m-cold")) as resp:
            return resp.status, await resp.json(), dict(resp.headers)

    first = [asyncio.create_task(one()) for _ in range(2)]
    await wait_for(lambda: r.manager.view("cold").waiters == 2, timeout=5)
    rest = await asyncio.gather(*(one() for _ in range(3)))
    for status, body, headers in rest:
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        error = assert_openai_error(body, "slot.queue_full")
        assert error["type"] == "rate_limit_error"
    assert [s for s, _, _ in await asyncio.gather(*first)] == [200, 200]
    assert r.manager.lease_count() == 0


async def test_unknown_model_and_bad_bodies_in_openai_shape(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat"), model("m-idle")])
    for body in (chat("nope"), chat("m-idle")):  # m-idle: in the catalogue, no slot
        async with r.post("/v1/chat/completions", body) as resp:
            assert resp.status == 404
            error = assert_openai_error(await resp.json(), "model_not_found")
            assert error["param"] == "model" and error["type"] == "invalid_request_error"
    cases: list[tuple[str, bytes]] = [
        ("/v1/chat/completions", b""),
        ("/v1/chat/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/embeddings", b'{"input": "x"}'),
        ("/v1/embeddings", b'{"model": 7}'),
    ]
    for path, raw in cases:
        async with r.post(path, data=raw, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400, (path, raw)
            assert_openai_error(await resp.json())
    assert r.manager.view("chat").state is S.OFFLINE  # nothing was loaded for them


async def test_every_openai_route_needs_the_token(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    openai_routes = [spec for spec in ROUTES if spec.tag == "openai"]
    paths = {(spec.method, spec.path) for spec in openai_routes}
    assert {
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/audio/{path}"),
    } <= paths
    # A connection each (a fresh head each, not a recalled one).
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    async with fresh:
        for spec in openai_routes:
            assert not spec.public, spec.path
            path = spec.path.replace("{path}", "speech").replace("{model_id}", "m-chat")
            for headers, said in (
                ({}, "missing"),
                ({"Authorization": "Bearer wrong"}, "wrong"),
                ({"Authorization": TOKEN}, "missing"),  # no scheme: no bearer token
                ({"Authorization": "Bearer "}, "missing"),
            ):
                async with fresh.request(
                    spec.method, r.url(path), json=chat("m-chat"), headers=headers
                ) as resp:
                    assert resp.status == 401, (spec.method, path, headers)
                    error = (await resp.json())["error"]
                    assert error["message"].startswith(said), (spec.method, path, headers)
    assert r.manager.view("chat").state is S.OFFLINE


async def test_requests_are_recorded_in_metrics(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    calls: list[tuple[str, str, int, float]] = []

    class Recorder:
        def call_done(
            self,
            slot: str,
            model: str,
            status: int | str,
            seconds: float,
            key: str | None,
            cls: str,
            waited: float | None,
        ) -> None:
            calls.append((slot, model, int(status), seconds))

    r.ctx.store.set(REQUEST_RECORDER, Recorder())
    async with r.post("/v1/chat/completions", chat("m-chat")) as resp:
        assert resp.status == 200
    async with r.post("/v1/chat/completions", chat("nope")) as resp:
        assert resp.status == 404
    big = io.BytesIO(b'{"model": "m-chat", "pad": "' + b"p" * (8 * 1024 * 1024) + b'"}')
    async with r.post("/v1/chat/completions", data=big) as resp:
        assert resp.status == 413
    assert [(s, m, st) for s, m, st, _ in calls] == [
        ("chat", "m-chat", 200),
        ("", "", 404),
        ("", "", 413),  # the data plane's, refused from the head alone, too
    ]
    big.seek(0)  # without the token: 401 first (no router metrics), as for any request
    async with r.client.post(r.url("/v1/chat/completions"), data=big) as resp:
        assert resp.status == 401
    assert len(calls) == 3
    host, _, port = r.base.removeprefix("http://").rpartition(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(  # a client that leaves halfway through its body: 499
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}"
        '\r\nContent-Length: 1000\r\n\r\n{"model"'.encode()
    )
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    await wait_for(lambda: len(calls) == 4)
    assert calls[3][:3] == ("", "", 499)
    assert all(seconds >= 0 for *_, seconds in calls)


async def test_a_self_managed_slot_is_routed_by_its_name_and_listed(harness: Harness) -> None:
    """A kokoro-style slot has no catalogue model: ``model`` names the slot (or provider)."""
    demo = [sys.executable, "-m", "controller.demo", "--port", "{port}", "--model", "tts"]
    tts = harness.slot("tts", "", provider="kokoro", memory_gb=1.0, server={"cmd": demo})
    r = await harness.start([tts, harness.slot("chat", "m-chat")], [model("m-chat")])
    async with r.get("/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["m-chat", "tts"]
    async with r.post("/v1/chat/completions", chat("tts")) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["model"] == "tts"
    assert r.manager.view("tts").state is S.READY
    # The provider's name reaches its model-less slot too (this demo then refuses the id:
    # the upstream's 404, not the router's).
    async with r.post("/v1/chat/completions", chat("kokoro")) as resp:
        assert resp.status == 404
        assert "no activated slot" not in (await resp.json())["error"]["message"]
    assert r.manager.view("chat").state is S.OFFLINE  # nothing else was loaded for them


async def test_router_refusals_are_reported_once(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    sub = r.manager.events.subscribe()
    async with r.post("/v1/chat/completions", chat("nope")) as resp:
        assert resp.status == 404
    harness.budget_gb = 0.5  # not read again: refuse through memory instead
    r.manager.settings = r.manager.settings.model_copy(update={"memory_budget_gb": {"gpu": 0.5}})
    async with r.post("/v1/chat/completions", chat("m-chat")) as resp:
        assert resp.status == 503
    refusals = []
    while (event := sub.get_nowait()) is not None:
        if event.kind == "refusal":
            refusals.append((event.op, event.error))
    assert refusals == [("route", "model.not_found"), ("admit", "model.insufficient_memory")]
