"""The router checks what a model is for (issue 24): a request for an endpoint its slot's
``type`` does not serve gets OpenAI's 400 ``invalid_request_error`` with ``param:
"model"`` before anything is leased or loaded (the routed call, driven by the data
plane); ``/v1/models`` says what each model is for.

Real demo servers on 127.0.0.1 through :class:`tests.integration.test_router.Harness`.
"""

from __future__ import annotations

from typing import Any

from controller.model.lifecycle import SlotState
from tests.integration.test_router import (
    Harness,
    assert_openai_error,
    chat,
    harness,
    model,
)

__all__ = ["harness"]  # the fixture, imported for this module's tests

S = SlotState


def wrong(error: dict[str, Any]) -> None:
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == "model" and error["code"] == "model_not_supported", error


async def test_a_request_its_models_slot_type_does_not_serve_is_refused_before_any_load(
    harness: Harness,
) -> None:
    r = await harness.start(
        [
            harness.slot("chat", "m-chat", "--load-seconds", "0.2"),
            harness.slot("emb", "m-emb", "--embedding-dim", "8", type="embedding"),
            harness.slot("tts", "m-tts", type="tts"),
            harness.slot("stt", "m-stt", type="stt"),
        ],
        [model("m-chat"), model("m-emb"), model("m-tts"), model("m-stt")],
    )
    events_before = r.manager.events.last_id
    refused = [
        ("/v1/embeddings", {"model": "m-chat", "input": "x"}, "'llm'"),
        ("/v1/chat/completions", chat("m-emb"), "'embedding'"),
        ("/v1/completions", {"model": "m-emb", "prompt": "x"}, "'embedding'"),
        ("/v1/audio/speech", {"model": "m-chat", "input": "hi", "voice": "a"}, "'llm'"),
        ("/v1/audio/speech", {"model": "m-stt", "input": "hi", "voice": "a"}, "'stt'"),
        ("/v1/audio/transcriptions", {"model": "m-tts"}, "'tts'"),
        ("/v1/audio/translations", {"model": "m-emb"}, "'embedding'"),
        ("/v1/chat/completions", chat("m-tts"), "'tts'"),
    ]
    for path, body, slot_type in refused:
        async with r.post(path, body) as resp:
            assert resp.status == 400, (path, body, await resp.text())
            error = assert_openai_error(await resp.json())
        wrong(error)
        assert slot_type in error["message"] and path in error["message"], error
    # nothing was leased or loaded, and no slot changed state
    assert r.manager.lease_count() == 0
    assert {v.name: v.state for v in r.manager.views()} == dict.fromkeys(
        ("chat", "emb", "tts", "stt"), S.OFFLINE
    )
    transitions = [e for e in r.manager.events.since(events_before) if e.kind == "transition"]
    assert transitions == []

    # what each is for: the right endpoint still loads and answers
    async with r.post("/v1/chat/completions", chat("m-chat")) as resp:
        assert resp.status == 200, await resp.text()
    async with r.post("/v1/embeddings", {"model": "m-emb", "input": ["a"]}) as resp:
        assert resp.status == 200, await resp.text()
        assert len((await resp.json())["data"][0]["embedding"]) == 8


async def test_a_model_bound_by_two_kinds_of_slot_goes_to_the_one_that_serves_the_endpoint(
    harness: Harness,
) -> None:
    r = await harness.start(
        [
            harness.slot("gen", "m-both", priority=90),  # ranked first for any request
            harness.slot("vec", "m-both", "--embedding-dim", "4", type="embedding", priority=10),
        ],
        [model("m-both")],
    )
    async with r.post("/v1/embeddings", {"model": "m-both", "input": ["a"]}) as resp:
        assert resp.status == 200, await resp.text()
        assert len((await resp.json())["data"][0]["embedding"]) == 4
    assert r.manager.view("vec").state is S.READY
    assert r.manager.view("gen").state is S.OFFLINE  # never loaded for an embedding


async def test_models_list_says_what_each_model_is_for(harness: Harness) -> None:
    r = await harness.start(
        [
            harness.slot("chat", "m-chat"),
            harness.slot("emb", "m-emb", type="embedding"),
            harness.slot("stt", "m-stt", type="stt"),
        ],
        [model("m-chat"), model("m-emb"), model("m-stt")],
    )
    async with r.get("/v1/models") as resp:
        assert resp.status == 200
        listing = (await resp.json())["data"]
    by_id = {m["id"]: m for m in listing}
    assert by_id["m-chat"]["type"] == "llm"
    assert by_id["m-chat"]["endpoints"] == ["/v1/chat/completions", "/v1/completions"]
    assert by_id["m-emb"]["type"] == "embedding"
    assert by_id["m-emb"]["endpoints"] == ["/v1/embeddings"]
    assert by_id["m-stt"]["endpoints"] == ["/v1/audio/transcriptions", "/v1/audio/translations"]
    for entry in listing:  # still OpenAI's model object
        assert entry["object"] == "model" and entry["owned_by"] == "slotctl"
    async with r.get("/v1/models/m-emb") as resp:
        assert resp.status == 200
        assert (await resp.json()) == by_id["m-emb"]
