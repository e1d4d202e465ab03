"""Co-loaded units with real demo servers behind the real router (docs/design/0013).

A stack with ``[[unit]]`` is read by the loader; its slots run as ``python -m
controller.demo`` children under the process runtime, requests go over TCP through the
API server's router. Memory is deterministic: no probe for ``gpu``, a configured budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controller.api.dryrun import plan_json
from controller.model.lifecycle import SlotState
from controller.spec.loader import load_stack_texts
from controller.spec.schema import ModelSpec, SlotSpec
from tests.integration.helpers import free_ports
from tests.integration.test_router import Harness, Router, chat

S = SlotState


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path, budget_gb=8.0)
    try:
        yield h
    finally:
        await h.close()


def stack(embed_args: str = "") -> tuple[list[SlotSpec], list[ModelSpec]]:
    """chat (4 GiB) + embed (2 GiB) as unit "rag"; big (5 GiB, priority 90); low (3 GiB)."""
    ports = free_ports(4)  # distinct (free_port() four times can repeat one)
    text = f"""
[stack]
name = "units"
[[model]]
id = "chat-m"
source = "demo://chat-m"
memory_gb = 4
[[model]]
id = "embed-m"
source = "demo://embed-m"
kind = "embedding"
memory_gb = 2
[[model]]
id = "big-m"
source = "demo://big-m"
memory_gb = 5
[[model]]
id = "low-m"
source = "demo://low-m"
memory_gb = 3

[[unit]]
name = "rag"
slots = ["chat", "embed"]

[[slot]]
name = "chat"
provider = "demo"
port = {ports[0]}
model.default = "chat-m"
priority = 60
autoload = false

[[slot]]
name = "embed"
provider = "demo"
type = "embedding"
port = {ports[1]}
model.default = "embed-m"
priority = 40
autoload = false
server.extra_args = [{embed_args}]

[[slot]]
name = "big"
provider = "demo"
port = {ports[2]}
model.default = "big-m"
priority = 90
autoload = false

[[slot]]
name = "low"
provider = "demo"
port = {ports[3]}
model.default = "low-m"
priority = 10
autoload = false
"""
    report = load_stack_texts([("units.toml", text)])
    assert report.ok and report.state is not None, [p.message for p in report.errors]
    assert {n: s.spec.unit for n, s in report.state.slots.items()} == {
        "chat": "rag",
        "embed": "rag",
        "big": None,
        "low": None,
    }
    return [s.spec for s in report.state.slots.values()], list(report.state.models.values())


def states(r: Router) -> dict[str, SlotState]:
    return {n: r.manager.view(n).state for n in ("chat", "embed", "big", "low")}


async def embed(r: Router) -> int:
    async with r.post("/v1/embeddings", {"model": "embed-m", "input": "hello"}) as resp:
        await resp.read()
        return int(resp.status)


async def test_a_request_for_one_member_loads_both(harness: Harness) -> None:
    r = await harness.start(*stack())
    assert await embed(r) == 200
    assert states(r)["chat"] in (S.READY, S.IDLE) and states(r)["embed"] in (S.READY, S.IDLE)
    # both servers really answer
    async with r.post("/v1/chat/completions", chat("chat-m")) as resp:
        assert resp.status == 200
    plan = plan_json(r.manager.explain_load("chat"))
    assert plan["action"] == "none" and plan["unit"]["action"] == "none"
    assert [m["slot"] for m in plan["unit"]["members"]] == ["chat", "embed"]


async def test_a_member_failure_rolls_back(harness: Harness) -> None:
    r = await harness.start(*stack('"--fail-on-load"'))
    async with r.post("/v1/chat/completions", chat("chat-m")) as resp:
        assert resp.status >= 500
        await resp.read()
    assert r.manager.view("embed").state is S.ERROR
    assert r.manager.view("chat").state is S.OFFLINE
    assert "rolled back" in r.manager.view("chat").message
    assert (await r.manager.runtime.inspect("chat")).running is False


async def test_a_higher_priority_load_evicts_the_unit_whole(harness: Harness) -> None:
    r = await harness.start(*stack())
    # an outsider is evicted for the unit, never a member for a member
    await r.manager.load("low")
    assert await embed(r) == 200
    assert states(r)["low"] is S.OFFLINE
    assert states(r)["chat"] in (S.READY, S.IDLE)
    await asyncio.sleep(0.05)
    # big (5 GiB) needs 3 more: embed (2) alone is not enough and chat alone would do, but
    # the unit goes whole
    sub = r.manager.events.subscribe()
    async with r.post("/v1/chat/completions", chat("big-m")) as resp:
        assert resp.status == 200
    assert states(r)["chat"] is S.OFFLINE and states(r)["embed"] is S.OFFLINE
    evicted = []
    while (event := sub.get_nowait()) is not None:
        if event.kind == "eviction":
            evicted.append(event.slot)
    assert sorted(e for e in evicted if e) == ["chat", "embed"]
    for name in ("chat", "embed"):
        assert (await r.manager.runtime.inspect(name)).running is False
