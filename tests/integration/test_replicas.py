"""Replicas of one model against real demo servers on 127.0.0.1 (issue 38): requests
routed by prompt prefix keep each conversation on one replica, whose prefix cache then
holds it (the demo models one and reports ``cached_tokens``, counted per replica in
``/metrics``); round-robin alternates; a kill -9 of one replica mid-stream fails its
request once and the next ones go to its sibling."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from controller.model.lifecycle import SlotState
from controller.spec.replicas import replica_specs
from controller.spec.schema import SlotSpec
from tests.integration.test_router import (
    Harness,
    Router,
    assert_openai_error,
    harness,
    model,
    read_events,
    wait_for,
)

__all__ = ["harness"]  # the fixture, imported for pytest

S = SlotState
SYSTEM = "You are a travel planner. Answer in short lists. " * 4


def group(h: Harness, *args: str, **kw: Any) -> list[SlotSpec]:
    base = h.slot("chat", "m", "--prefix-cache", "32", *args, replicas=2, **kw)
    return [base, *replica_specs(base)]


def turn(messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "max_tokens": 6, **kw}


def served(r: Router) -> dict[str, int]:
    return {v.name: v.requests for v in r.manager.views()}


async def converse(r: Router, topic: str, turns: int) -> tuple[set[str], list[int]]:
    """One conversation of ``turns`` turns: the replicas that served it, and the cached
    prompt tokens each turn's answer reported."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": topic}]
    where: set[str] = set()
    cached: list[int] = []
    for i in range(turns):
        before = served(r)
        async with r.post("/v1/chat/completions", turn(messages)) as resp:
            assert resp.status == 200
            body = await resp.json()
        after = served(r)
        where |= {n for n in after if after[n] != before.get(n)}
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert body["timings"]["cache_n"] == cached[-1]  # llama.cpp's way of saying it
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": f"and then {i}?"})
    return where, cached


async def test_prefix_routing_keeps_conversations_on_a_warm_replica(harness: Harness) -> None:
    r = await harness.start(group(harness), [model("m")])
    await r.manager.load("chat")
    await r.manager.load("chat-r1")
    used: set[str] = set()
    for topic in ("Lyon", "Oslo", "Porto", "Kyoto", "Quito", "Hanoi"):
        where, cached = await converse(r, f"Plan three days in {topic}.", 3)
        assert len(where) == 1, where  # every turn on the same replica
        used |= where
        # from the second turn on, the replica's cache holds the whole previous turn
        assert cached[1] > 0 and cached[2] > cached[1], cached
    assert used == {"chat", "chat-r1"}  # and the conversations spread over both
    async with r.get("/api/slots") as resp:
        views = {v["name"]: v for v in (await resp.json())["slots"]}
    assert (views["chat-r1"]["replica_of"], views["chat-r1"]["replica_index"]) == ("chat", 1)
    assert views["chat"]["replica_of"] == "chat"
    async with r.get("/metrics") as resp:
        text = await resp.text()
    lines = [x for x in text.splitlines() if x.startswith("slotctl_slot_prompt_tokens_total{")]
    cached = {
        line.split('slot="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if 'kind="cached"' in line
    }
    assert set(cached) == {"chat", "chat-r1"} and all(v > 0 for v in cached.values()), lines
    assert all('replica_of="chat"' in line for line in lines)
    assert 'slotctl_slot_replica{index="1",replica_of="chat",slot="chat-r1"} 1.0' in text


async def test_round_robin_alternates(harness: Harness) -> None:
    r = await harness.start(group(harness, routing="round-robin"), [model("m")])
    await r.manager.load("chat")
    await r.manager.load("chat-r1")
    order = []
    for _ in range(4):
        before = served(r)
        async with r.post(
            "/v1/chat/completions", turn([{"role": "user", "content": "hi"}])
        ) as resp:
            assert resp.status == 200
        after = served(r)
        order += [n for n in after if after[n] != before.get(n)]
    assert order[0] != order[1] and order[0::2] == [order[0]] * 2 and order[1::2] == [order[1]] * 2


async def test_kill_9_of_a_replica_mid_stream_fails_once_then_its_sibling_serves(
    harness: Harness,
) -> None:
    r = await harness.start(group(harness, "--tokens-per-second", "10"), [model("m")])
    await r.manager.load("chat")
    await r.manager.load("chat-r1")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Lyon?"}]
    victim: list[str] = []

    async def kill() -> None:  # the first chunk came: kill -9 the replica serving it
        name = next(v.name for v in r.manager.views() if v.leases)
        victim.append(name)
        observed = await r.manager.runtime.inspect(name)
        os.kill(int(observed.ident or 0), signal.SIGKILL)

    async with r.post("/v1/chat/completions", turn(messages, stream=True, max_tokens=100)) as resp:
        assert resp.status == 200
        events = await read_events(resp, kill)
    error = assert_openai_error(json.loads(events[-1][1]))  # ends in-band, once
    assert error["code"] in ("upstream.failed", "slot.health_failed"), error
    dead = victim[0]
    sibling = "chat-r1" if dead == "chat" else "chat"
    await wait_for(lambda: r.manager.view(dead).state is S.ERROR, timeout=10)
    before = served(r)
    for _ in range(3):  # the same conversation: its replica is gone, the sibling serves
        async with r.post("/v1/chat/completions", turn(messages)) as resp:
            assert resp.status == 200, await resp.text()
    after = served(r)
    assert after[sibling] - before[sibling] == 3
    assert r.manager.lease_count() == 0


async def test_scaled_up_under_a_driven_load_and_down_after(harness: Harness) -> None:
    """Real servers, the real clock: clients keep the one replica saturated (one request
    at a time, others waiting) until the scaler adds the second, which then serves; once
    they stop, the quiet window takes it away. Waits on states, with deadlines."""
    import asyncio

    from controller.slots.records import ManagerConfig

    base = harness.slot(
        "chat",
        "m",
        "--tokens-per-second",
        "50",
        min_replicas=1,
        max_replicas=2,
        max_concurrency=1,
        scale_up_after_s=0.3,
        scale_down_after_s=1.5,
    )
    config = ManagerConfig(stop_timeout_s=5.0, tick_interval_s=0.1)
    r = await harness.start([base, *replica_specs(base)], [model("m")], config)
    await r.manager.load("chat")
    sub = r.manager.events.subscribe()
    stop = asyncio.Event()

    async def client(i: int) -> None:
        while not stop.is_set():
            body = turn([{"role": "user", "content": f"client {i}"}], max_tokens=5)
            async with r.post("/v1/chat/completions", body) as resp:
                assert resp.status == 200

    clients = [asyncio.create_task(client(i)) for i in range(3)]
    try:
        await wait_for(lambda: r.manager.view("chat-r1").state is S.READY, timeout=20)
        served_before = r.manager.view("chat-r1").requests
        await wait_for(lambda: r.manager.view("chat-r1").requests > served_before, timeout=10)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    await wait_for(lambda: r.manager.view("chat-r1").state is S.OFFLINE, timeout=20)
    assert r.manager.view("chat").state in (S.READY, S.IDLE)
    scale = []
    while (event := sub.get_nowait()) is not None:
        if event.kind == "scale":
            scale.append((event.details["action"], event.slot, event.message))
    assert [(a, s) for a, s, _ in scale] == [("up", "chat-r1"), ("down", "chat-r1")], scale
    assert "saturated" in scale[0][2] and "removed" in scale[1][2]
