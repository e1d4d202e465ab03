"""API keys with scopes, per-key limits and priority classes (issue 23), on both router
paths (the data plane and aiohttp's) and on the REST API, against real demo servers on
127.0.0.1 (:class:`tests.integration.test_router.Harness`).

The scope matrix is generated from the route table (``controller.api.assembly.ROUTES``):
a new route cannot ship without the scope it needs, and each scope is tried on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
from typing import Any

import aiohttp
import pytest

from controller.access.keys import KEYS_FILE, Scope
from controller.api.app import route_scope
from controller.api.assembly import ROUTES
from controller.model.lifecycle import SlotState
from controller.spec.guard import write_catalogue
from controller.spec.schema import AliasSpec
from tests.integration.test_router import (
    AUTH,
    Harness,
    Router,
    assert_openai_error,
    chat,
    harness,
    model,
    wait_for,
)

__all__ = ["harness"]  # the fixture, imported for this module's tests

S = SlotState


async def create(r: Router, name: str, **body: Any) -> str:
    async with r.post("/api/keys", {"name": name, **body}) as resp:
        assert resp.status == 201, await resp.text()
        answer = await resp.json()
    assert answer["name"] == name and "sha256" not in answer
    return str(answer["key"])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def status_of(r: Router, method: str, path: str, headers: dict[str, str]) -> int:
    kw: dict[str, Any] = {"headers": headers}
    if method in ("POST", "PUT", "PATCH"):
        kw["json"] = {}
    async with r.client.request(method, r.url(path), **kw) as resp:
        await resp.read()
        if resp.status == 403:  # the typed refusal, never an empty answer
            body = await resp.json()
            assert body["error"]["code"] in ("auth.forbidden", "permission_error") or (
                path.startswith("/v1") and body["error"]["type"] == "permission_error"
            ), body
        return resp.status


def _concrete(path: str) -> str:
    """A path of the route table with its parameters filled in."""
    return re.sub(r"\{([a-z_]+)(:[^}]*)?\}", lambda m: "x", path)


async def test_scope_matrix_over_every_route(harness: Harness) -> None:
    """Every route of the table: a key whose scope is below the route's gets 403 (and
    nothing runs), one at or above it does not; public routes need no key at all."""
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    keys = {s: await create(r, f"k-{s.label}", scope=s.label) for s in Scope}
    tried = 0
    for spec in ROUTES:
        needed = route_scope(spec)
        path = _concrete(spec.path)
        if path in ("/api/events", "/api/slots/x/logs") or "stream" in path:
            continue  # streams: tried below with a read key (they never end by themselves)
        if spec.method == "DELETE" and path == "/api/keys/x":
            pass  # a 404 (no key x) for admin, 403 below it
        for scope, key in keys.items():
            status = await status_of(r, spec.method, path, bearer(key))
            if needed is not None and scope < needed:
                assert status == 403, (spec.method, spec.path, scope, status)
            else:
                assert status not in (401, 403), (spec.method, spec.path, scope, status)
            tried += 1
        if needed is None:
            assert await status_of(r, spec.method, path, {}) != 401, spec.path
    assert tried >= 3 * 30  # the table was walked, not skipped
    async with r.client.get(r.url("/api/events"), headers=bearer(keys[Scope.INFERENCE])) as resp:
        assert resp.status == 403
    async with r.client.get(r.url("/api/events"), headers=bearer(keys[Scope.READ])) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
    # nothing a refused key asked for happened: the slot was never loaded
    assert r.manager.view("chat").state in (S.OFFLINE, S.READY)


async def test_every_route_declares_a_scope_rule() -> None:
    """The rule itself: /v1 inference, the other GETs read, the rest admin, keys admin."""
    by_route = {(s.method, s.path): route_scope(s) for s in ROUTES}
    assert by_route[("POST", "/v1/chat/completions")] is Scope.INFERENCE
    assert by_route[("GET", "/v1/models")] is Scope.INFERENCE
    assert by_route[("GET", "/api/slots")] is Scope.READ
    assert by_route[("GET", "/metrics")] is Scope.READ
    assert by_route[("GET", "/api/keys")] is Scope.ADMIN
    assert by_route[("GET", "/api/slots/{name}/logs")] is Scope.ADMIN  # prompts, secrets
    assert by_route[("POST", "/api/slots/{name}/load")] is Scope.ADMIN
    assert all(s.public or route_scope(s) is not None for s in ROUTES)


async def test_keys_are_hashed_at_rest_and_listed_without_secrets(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    key = await create(r, "chat-ui", scope="inference", priority="interactive")
    path = r.ctx.state_dir / KEYS_FILE
    raw = path.read_text()
    assert key not in raw and key[12:] not in raw
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(key)) as resp:
        assert resp.status == 200, await resp.text()
    async with r.get("/api/keys") as resp:
        listing = (await resp.json())["keys"]
    assert [k["name"] for k in listing] == ["chat-ui"]
    assert listing[0]["last_used"] is not None and key not in json.dumps(listing)
    assert "sha256" not in listing[0]


async def test_x_api_key_is_accepted_and_never_forwarded(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    key = await create(r, "cli", scope="inference")
    async with r.client.post(
        r.url("/v1/chat/completions"), json=chat("m-chat"), headers={"x-api-key": key}
    ) as resp:
        assert resp.status == 200, await resp.text()
    async with r.client.post(
        r.url("/v1/chat/completions"), json=chat("m-chat"), headers={"x-api-key": "sk-nope"}
    ) as resp:
        assert resp.status == 401
        error = assert_openai_error(await resp.json())
        assert error["code"] == "invalid_api_key" and "wrong" in error["message"]
    async with r.client.get(r.url("/api/slots"), headers={"x-api-key": key}) as resp:
        assert resp.status == 403  # an inference key on a read route
        assert (await resp.json())["error"]["code"] == "auth.forbidden"


async def test_a_key_reaches_only_its_models(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("a", "team-a-chat"), harness.slot("b", "team-b-chat")],
        [model("team-a-chat"), model("team-b-chat")],
    )
    key = await create(r, "team-a", models=["team-a-*"])
    async with r.client.get(r.url("/v1/models"), headers=bearer(key)) as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["team-a-chat"]
    async with r.client.get(r.url("/v1/models/team-b-chat"), headers=bearer(key)) as resp:
        assert resp.status == 404
    async with r.post("/v1/chat/completions", chat("team-b-chat"), headers=bearer(key)) as resp:
        assert resp.status == 403
        error = assert_openai_error(await resp.json())
        assert error["type"] == "permission_error" and error["code"] == "model_not_allowed"
        assert error["param"] == "model"
    assert r.manager.view("b").state is S.OFFLINE  # nothing loaded for a refused key
    async with r.post("/v1/chat/completions", chat("team-a-chat"), headers=bearer(key)) as resp:
        assert resp.status == 200


async def test_expired_and_revoked_keys_are_refused_while_running_requests_finish(
    harness: Harness,
) -> None:
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "20")], [model("m-chat")]
    )
    key = await create(r, "ci")
    body = chat("m-chat", max_tokens=20, stream=True)
    async with r.post("/v1/chat/completions", body, headers=bearer(key)) as resp:
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data:")
        async with r.client.delete(r.url("/api/keys/ci"), headers=AUTH) as gone:
            assert gone.status == 200, await gone.text()
        async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(key)) as again:
            assert again.status == 401  # revoked: the next request is refused at once
        rest = await resp.read()  # the stream that began before still ends whole
        assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
    async with r.client.delete(r.url("/api/keys/ci"), headers=AUTH) as twice:
        assert twice.status == 404
    short = await create(r, "short", expires="1s")
    async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(short)) as resp:
        assert resp.status == 200
    await asyncio.sleep(1.2)
    async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(short)) as resp:
        assert resp.status == 401
    async with r.get("/api/keys") as resp:
        assert [k["expired"] for k in (await resp.json())["keys"]] == [True]


async def test_a_keys_limits_answer_429_with_retry_after(harness: Harness) -> None:
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "20")], [model("m-chat")]
    )
    one = await create(r, "one-at-a-time", max_concurrency=1)
    slow = chat("m-chat", max_tokens=20, stream=True)
    async with r.post("/v1/chat/completions", slow, headers=bearer(one)) as resp:
        assert resp.status == 200
        await resp.content.readline()
        async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(one)) as busy:
            assert busy.status == 429
            assert int(busy.headers["Retry-After"]) >= 1
            error = assert_openai_error(await busy.json())
            assert error["type"] == "rate_limit_error" and error["code"] == "key.concurrency_limit"
        await resp.read()
    await wait_for(lambda: sum(r.ctx.limits.in_flight.values()) == 0)
    async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(one)) as resp:
        assert resp.status == 200  # the slot is free again for this key
    rpm = await create(r, "two-a-minute", rpm=2)
    statuses = []
    for _ in range(3):
        async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(rpm)) as resp:
            statuses.append(resp.status)
            if resp.status == 429:
                assert 1 <= int(resp.headers["Retry-After"]) <= 60
                assert (await resp.json())["error"]["code"] == "key.rate_limited"
    assert statuses == [200, 200, 429]
    async with r.get("/metrics") as resp:
        text = await resp.text()
    assert 'slotctl_key_requests_total{class="interactive",code="429",key="two-a-minute"} 1.0' in (
        text
    )
    assert "sk-slotctl-" not in text  # key names only, never a secret


async def test_a_header_lowers_a_class_but_cannot_raise_it(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat", max_concurrency=1)], [model("m-chat")])
    batch = await create(r, "ci", priority="batch")
    ui = await create(r, "ui", priority="interactive")
    for key, asked, want in (
        (batch, "interactive", "batch"),  # spoofing: the key's own class stays
        (ui, "batch", "batch"),  # lowering: granted
        (ui, None, "interactive"),
    ):
        headers = bearer(key) | ({"X-Slotctl-Priority": asked} if asked else {})
        async with r.post("/v1/chat/completions", chat("m-chat"), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        async with r.get("/metrics") as resp:
            text = await resp.text()
        name = "ci" if key == batch else "ui"
        assert f'class="{want}",code="200",key="{name}"' in text, (asked, want)
    headers = bearer(ui) | {"X-Slotctl-Priority": "vip"}
    async with r.post("/v1/chat/completions", chat("m-chat"), headers=headers) as resp:
        assert resp.status == 400
        error = assert_openai_error(await resp.json())
        assert error["code"] == "invalid_priority" and error["param"] == "x-slotctl-priority"


async def test_the_api_token_keeps_working_with_and_without_keys(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    async with r.post("/v1/chat/completions", chat("m-chat")) as resp:
        assert resp.status == 200
    await create(r, "someone")
    async with r.post("/v1/chat/completions", chat("m-chat")) as resp:
        assert resp.status == 200
    async with r.client.post(r.url("/api/slots/chat/unload"), headers=AUTH) as resp:
        assert resp.status in (200, 202), await resp.text()


@pytest.mark.parametrize("body", [{"name": "Bad Name"}, {"name": "x", "scope": "root"}])
async def test_bad_key_requests_are_typed_400s_and_change_nothing(
    harness: Harness, body: dict[str, Any]
) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    async with r.post("/api/keys", body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "request.invalid"
    assert not (r.ctx.state_dir / KEYS_FILE).exists()
    await create(r, "dup")
    async with r.post("/api/keys", {"name": "dup"}) as resp:
        assert resp.status == 400
    async with r.post("/api/keys", {"name": "p", "priority": "vip"}) as resp:
        assert resp.status == 400 and "unknown priority class" in await resp.text()


async def test_a_wrong_key_is_401_on_rest_and_v1(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    for path, method in (("/api/slots", "GET"), ("/v1/chat/completions", "POST")):
        async with r.client.request(
            method, r.url(path), json=chat("m-chat"), headers=bearer("sk-slotctl-wrong")
        ) as resp:
            assert resp.status == 401
    async with aiohttp.ClientSession() as anon, anon.get(r.url("/v1/models")) as resp:
        assert resp.status == 401


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_keys_tokens_are_counted_where_the_server_reports_usage(harness: Harness) -> None:
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    key = await create(r, "counted", priority="batch")
    async with r.post("/v1/chat/completions", chat("m-chat", 5), headers=bearer(key)) as resp:
        usage = (await resp.json())["usage"]
    body = chat("m-chat", 3, stream=True) | {"stream_options": {"include_usage": True}}
    async with r.post("/v1/chat/completions", body, headers=bearer(key)) as resp:
        events = [line for line in (await resp.read()).split(b"\n") if b'"usage"' in line]
    streamed = json.loads(events[-1].removeprefix(b"data: "))["usage"]
    async with r.post("/v1/chat/completions", chat("m-chat", 2, stream=True), headers=bearer(key)):
        pass  # a stream without include_usage reports none: nothing counted for it
    await wait_for(lambda: sum(r.ctx.limits.in_flight.values()) == 0)
    async with r.get("/metrics") as resp:
        text = await resp.text()
    tokens = "slotctl_key_tokens_total"
    prompt = _metric(text, tokens, key="counted", kind="prompt", **{"class": "batch"})
    completion = _metric(text, tokens, key="counted", kind="completion", **{"class": "batch"})
    assert prompt == usage["prompt_tokens"] + streamed["prompt_tokens"]
    assert completion == usage["completion_tokens"] + streamed["completion_tokens"] > 0
    assert _metric(text, tokens, key="@token") == 0  # the API token's calls are not kept


async def test_a_key_is_authorized_on_the_model_that_serves_not_the_name_asked(
    harness: Harness,
) -> None:
    """Issue 40, item 1 (OWASP API1): a key allowed ``m-a*`` asks for ``m-a-spare`` — the
    name of a slot whose model is ``m-big`` — and is refused before anything loads (the
    router's fallback to a slot by its name resolves the model first); an alias whose
    member is that slot's name is refused too. The key's own model still serves."""
    r = await harness.start(
        [harness.slot("m-a-spare", "m-big"), harness.slot("a", "m-a-chat")],
        [model("m-big"), model("m-a-chat")],
    )
    r.manager.set_aliases(
        {"m-a-any": AliasSpec.model_validate({"id": "m-a-any", "models": ["m-a-spare"]})}
    )
    key = await create(r, "team-a", models=["m-a*"])
    for asked in ("m-a-spare", "m-a-any"):
        async with r.post("/v1/chat/completions", chat(asked), headers=bearer(key)) as resp:
            assert resp.status == 403, (asked, await resp.text())
            error = assert_openai_error(await resp.json())
            assert error["code"] == "model_not_allowed" and "m-big" in error["message"], error
    assert r.manager.view("m-a-spare").state is S.OFFLINE  # nothing loaded for it
    async with r.post("/v1/chat/completions", chat("m-a-chat"), headers=bearer(key)) as resp:
        assert resp.status == 200, await resp.text()
    async with r.post("/v1/chat/completions", chat("m-a-spare")) as resp:
        assert resp.status != 403  # the API token may use every model


async def test_a_read_key_sees_no_secrets_and_admin_sees_them(harness: Harness) -> None:
    """Issue 40, item 2: a ``read`` key (the docs' Grafana example) reads a slot's spec
    with the values of ``server.env`` withheld (their names kept), a secret flag's value
    in its arguments withheld, and a URL's credentials (user:password@, the query) cut;
    an ``admin`` key (and the API token) sees them as written."""
    secrets = ("hf_SECRET_token_1", "sk-upstream-SECRET", "pw-SECRET", "sig-SECRET")
    spec = harness.slot(
        "chat",
        "m-chat",
        server={
            "extra_args": [
                "--api-key",
                secrets[1],
                f"--hf-endpoint=https://bot:{secrets[2]}@hub.example/?sig={secrets[3]}",
                "--tokens-per-second",
                "50",
            ],
            "env": {"HF_TOKEN": secrets[0], "LOG_LEVEL": "debug"},
        },
    )
    r = await harness.start([spec], [model("m-chat")])
    write_catalogue(r.ctx.config_dir, [model("m-chat")])
    payload = spec.model_dump(mode="json", exclude_none=True)
    async with r.post("/api/slots", payload) as resp:  # declared: its spec is shown
        assert resp.status == 201, await resp.text()
    reader = await create(r, "grafana", scope="read")
    admin = await create(r, "ops", scope="admin")
    for path in ("/api/slots/chat", "/api/slots", "/api/models"):
        async with r.client.get(r.url(path), headers=bearer(reader)) as resp:
            assert resp.status == 200, (path, await resp.text())
            text = await resp.text()
        leaked = [s for s in secrets if s in text]
        assert not leaked, (path, leaked, text)
    async with r.client.get(r.url("/api/slots/chat"), headers=bearer(reader)) as resp:
        server = (await resp.json())["spec"]["server"]
    assert server["env"] == {"HF_TOKEN": "<redacted>", "LOG_LEVEL": "<redacted>"}
    assert server["extra_args"][:2] == ["--api-key", "<redacted>"]
    assert server["extra_args"][2].startswith("--hf-endpoint=https://")
    assert "hub.example" in server["extra_args"][2]
    assert server["extra_args"][3:] == ["--tokens-per-second", "50"]  # not a secret
    # a server's log may carry prompts and its own secrets (vLLM logs its non-default
    # arguments): admin only
    async with r.client.get(r.url("/api/slots/chat/logs"), headers=bearer(reader)) as resp:
        assert resp.status == 403
        assert (await resp.json())["error"]["code"] == "auth.forbidden"
    for headers in (bearer(admin), AUTH):
        async with r.client.get(r.url("/api/slots/chat"), headers=headers) as resp:
            shown = (await resp.json())["spec"]["server"]
        assert shown["env"]["HF_TOKEN"] == secrets[0]
        assert shown["extra_args"][1] == secrets[1]
        async with r.client.get(r.url("/api/slots/chat/logs"), headers=headers) as resp:
            assert resp.status == 200


@pytest.mark.parametrize("path", ["cold", "turns"])
async def test_one_keys_flood_cannot_take_another_keys_place_in_line(
    harness: Harness, path: str
) -> None:
    """Issue 40, item 3: a batch key's flood fills the slot's ``max_queue``; another key's
    first request still gets in line (and is served), and the flooder's newest waiter is
    refused ``429 slot.queue_full`` in its place. Both places requests wait: a cold
    slot's load (no ``max_concurrency``) and the turns of a slot at its ``max_concurrency``."""
    if path == "cold":
        spec = harness.slot("q", "m-q", "--load-seconds", "2", max_queue=6)
    else:
        spec = harness.slot("q", "m-q", "--tokens-per-second", "5", max_queue=6, max_concurrency=1)
    r = await harness.start([spec], [model("m-q")])
    batch = await create(r, "nightly", priority="batch")
    ui = await create(r, "chat-ui", priority="interactive")
    if path == "turns":  # the slot is loaded and busy: a long request holds its one seat
        async with r.post("/v1/chat/completions", chat("m-q")) as resp:
            assert resp.status == 200
        holder = asyncio.create_task(_ask(r, chat("m-q", max_tokens=15), None))
        await wait_for(lambda: r.manager.view("q").leases == 1, timeout=10)

    flood = [asyncio.create_task(_ask(r, chat("m-q"), batch)) for _ in range(10)]
    await wait_for(lambda: _waiting(r) == 6, timeout=10)  # the line is full of the flood
    mine = await _ask(r, chat("m-q"), ui)
    assert mine[0] == 200, mine  # not 429 slot.queue_full
    results = await asyncio.gather(*flood)
    statuses = sorted(s for s, _ in results)
    assert statuses.count(200) == 5 and statuses.count(429) == 5, statuses
    refused = [code for s, code in results if s == 429]
    assert set(refused) == {"slot.queue_full"}
    if path == "turns":
        assert (await holder)[0] == 200
    await wait_for(lambda: sum(r.ctx.limits.in_flight.values()) == 0)


def _waiting(r: Router) -> int:
    book = r.manager.core.table.get("q").book
    return book.waiters + book.queued


async def _ask(r: Router, body: dict[str, Any], key: str | None) -> tuple[int, str]:
    headers = bearer(key) if key is not None else AUTH
    async with r.client.post(r.url("/v1/chat/completions"), json=body, headers=headers) as resp:
        answer = await resp.json()
        return resp.status, answer.get("error", {}).get("code", "") if resp.status != 200 else ""


async def test_a_recreated_key_does_not_inherit_the_revoked_keys_counters(
    harness: Harness,
) -> None:
    """Issue 40, item 3: a key's counters (its requests a minute, in flight, its place in
    the fair queue) are the key's, by its id: revoked and created again under the same
    name, the new key starts with none of the old one's."""
    r = await harness.start([harness.slot("chat", "m-chat")], [model("m-chat")])
    old = await create(r, "ci", rpm=2)
    for want in (200, 200, 429):
        async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(old)) as resp:
            assert resp.status == want
    async with r.client.delete(r.url("/api/keys/ci"), headers=AUTH) as resp:
        assert resp.status == 200
    new = await create(r, "ci", rpm=2)
    async with r.post("/v1/chat/completions", chat("m-chat"), headers=bearer(new)) as resp:
        assert resp.status == 200, await resp.text()  # not the old key's 429
