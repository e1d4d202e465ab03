"""Aliases through the router (issue 25, item 3), against real demo servers.

A demo server answers 404 for a model it does not serve, so every 200 here proves the
router rewrote the body's ``model`` to the member it chose; the answer's ``model`` says
which member served it. Each test runs on the data plane and on aiohttp's path (the
``harness`` fixture of ``test_router``).
"""

from __future__ import annotations

import io
import sys
from typing import Any

from controller.model.lifecycle import SlotState
from controller.spec.schema import AliasSpec
from tests.integration.test_keys import bearer, create
from tests.integration.test_router import (
    ECHO_SERVER,
    Harness,
    Router,
    assert_openai_error,
    chat,
    harness,
    model,
)

__all__ = ["harness"]  # the fixture, imported for its tests

S = SlotState


def aliases(r: Router, *specs: AliasSpec) -> None:
    r.manager.set_aliases({a.id: a for a in specs})


def alias(alias_id: str, *members: str, prefer: str = "warm") -> AliasSpec:
    return AliasSpec.model_validate({"id": alias_id, "models": list(members), "prefer": prefer})


async def ask(r: Router, name: str, **kw: Any) -> tuple[int, Any]:
    async with r.post("/v1/chat/completions", chat(name), **kw) as resp:
        return resp.status, await resp.json()


async def test_warm_prefers_the_resident_member_and_says_which_served(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("s-big", "big"), harness.slot("s-small", "small")],
        [model("big", 3), model("small", 1)],
    )
    aliases(r, alias("chat", "big", "small"))
    await r.manager.load("s-small")
    status, answer = await ask(r, "chat")
    assert status == 200, answer
    assert answer["model"] == "small"
    assert r.manager.view("s-big").state is S.OFFLINE  # the first member was not loaded
    assert r.manager.view("s-small").requests == 1

    # Nothing resident: the first member that fits is loaded (big, here).
    await r.manager.unload("s-small")
    status, answer = await ask(r, "chat")
    assert status == 200 and answer["model"] == "big", answer
    assert r.manager.view("s-big").dispatchable
    assert r.manager.lease_count() == 0


async def test_warm_skips_a_member_that_would_evict_a_higher_priority_slot(
    harness: Harness,
) -> None:
    harness.budget_gb = 4.0
    r = await harness.start(
        [
            harness.slot("vip", "other", priority=90),
            harness.slot("s-big", "big"),
            harness.slot("s-small", "small"),
        ],
        [model("other", 2), model("big", 3), model("small", 1)],
    )
    aliases(r, alias("chat", "big", "small"))
    await r.manager.load("vip")
    status, answer = await ask(r, "chat")
    assert status == 200 and answer["model"] == "small", answer
    assert r.manager.view("vip").dispatchable  # nothing was evicted for the alias
    assert r.manager.view("s-big").state is S.OFFLINE


async def test_first_always_takes_the_first_member(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("s-big", "big"), harness.slot("s-small", "small")],
        [model("big", 3), model("small", 1)],
    )
    aliases(r, alias("chat", "big", "small", prefer="first"))
    await r.manager.load("s-small")
    status, answer = await ask(r, "chat")
    assert status == 200 and answer["model"] == "big", answer
    assert r.manager.view("s-small").requests == 0


async def test_spread_fills_the_least_busy_slot(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("a", "small"), harness.slot("b", "small")], [model("small", 1)]
    )
    aliases(r, alias("chat", "small", prefer="spread"))
    await r.manager.load("a")
    await r.manager.load("b")
    held = await r.manager.acquire("a")  # a request in flight on a
    try:
        for _ in range(3):
            status, answer = await ask(r, "chat")
            assert status == 200 and answer["model"] == "small", answer
        assert r.manager.view("b").requests == 3
        assert r.manager.view("a").requests == 0
    finally:
        r.manager.release(held)
    served_by_a = r.manager.view("a").requests  # (the release of its hold counted)
    held = await r.manager.acquire("b")
    try:
        status, _ = await ask(r, "chat")
        assert status == 200
        assert r.manager.view("a").requests == served_by_a + 1
    finally:
        r.manager.release(held)


async def test_models_list_names_aliases_with_their_members(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("s-small", "small")], [model("big", 3), model("small", 1)]
    )
    aliases(r, alias("chat", "big", "small"), alias("nothing-served", "big"))
    async with r.get("/v1/models") as resp:
        listing = await resp.json()
    entries = {e["id"]: e for e in listing["data"]}
    assert list(entries) == ["small", "chat"]  # an alias no member of which is served: absent
    assert entries["chat"]["alias"] is True
    assert entries["chat"]["members"] == ["big", "small"]
    assert entries["chat"]["type"] == "llm"
    assert "alias" not in entries["small"]
    async with r.get("/v1/models/chat") as resp:
        assert resp.status == 200 and (await resp.json())["members"] == ["big", "small"]
    status, answer = await ask(r, "nothing-served")
    assert status == 404
    assert_openai_error(answer, "model_not_found")
    async with r.get("/api/models") as resp:
        shown = (await resp.json())["aliases"]
    assert shown[0] == {
        "id": "chat",
        "models": ["big", "small"],
        "prefer": "warm",
        "serves": "small",
    }


async def test_a_key_must_allow_the_alias_and_the_member(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("s-big", "big"), harness.slot("s-small", "small")],
        [model("big", 3), model("small", 1)],
    )
    aliases(r, alias("chat", "big", "small"))
    await r.manager.load("s-big")
    members_only = await create(r, "members", models=["big", "small"])
    status, answer = await ask(r, "chat", headers=bearer(members_only))
    assert status == 403 and answer["error"]["code"] == "model_not_allowed", answer
    alias_only = await create(r, "alias", models=["chat"])
    status, answer = await ask(r, "chat", headers=bearer(alias_only))
    assert status == 403 and answer["error"]["code"] == "model_not_allowed", answer
    # Allowed the alias and small only: small serves, though big is the warm one.
    small = await create(r, "small", models=["chat", "small"])
    status, answer = await ask(r, "chat", headers=bearer(small))
    assert status == 200 and answer["model"] == "small", answer
    # Listed as the key may use them: an alias without a member it may use is not.
    async with r.get("/v1/models", headers=bearer(small)) as resp:
        assert [e["id"] for e in (await resp.json())["data"]] == ["small", "chat"]
    for key in (alias_only, members_only):
        async with r.get("/v1/models", headers=bearer(key)) as resp:
            assert "chat" not in [e["id"] for e in (await resp.json())["data"]]
    assert r.manager.lease_count() == 0


async def test_an_alias_of_the_wrong_type_is_refused_before_a_load(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("emb", "e", "--embedding-dim", "8", type="embedding")], [model("e", 1)]
    )
    aliases(r, alias("vectors", "e"))
    status, answer = await ask(r, "vectors")
    assert status == 400, answer
    assert answer["error"]["code"] == "model_not_supported"
    assert "'embedding'" in answer["error"]["message"]  # the member's slot type
    assert r.manager.view("emb").state is S.OFFLINE
    async with r.post("/v1/embeddings", {"model": "vectors", "input": "hi"}) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["model"] == "e"


async def test_a_multipart_alias_request_reaches_the_member(harness: Harness) -> None:
    """An stt alias: the member's server (an echo server) gets the form with its ``model``
    field naming the member, and nothing else changed."""
    script = harness.tmp / "echo_server.py"
    script.write_text(ECHO_SERVER)
    stt = harness.slot(
        "stt",
        "whisper",
        provider="openai-compatible",
        type="stt",
        server={"cmd": [sys.executable, str(script), "{port}", "{model_id}"]},
    )
    r = await harness.start([stt], [model("whisper")])
    aliases(r, alias("ears", "whisper"))
    boundary = "alias-boundary"
    form = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        f"Content-Type: audio/wav\r\n\r\nRIFF0000WAVE\r\n"
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n%s\r\n'
        f"--{boundary}--\r\n"
    )
    async with r.post(
        "/v1/audio/transcriptions",
        data=io.BytesIO((form % "ears").encode()),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    ) as resp:
        assert resp.status == 200, await resp.text()
        assert await resp.read() == (form % "whisper").encode()
