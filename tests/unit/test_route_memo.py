"""A connection's last route (controller/router/memo.py; issue 41, item 4): two routed calls
on one memo, as two requests on one kept-alive connection, with a change between them —
a slot's, a key's, an alias', an adapter's, the settings' — and the second call sees it.
The lease, the limits and the recorder still run for every call.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.access.keys import TOKEN_PRINCIPAL, KeyRing, Principal, Scope
from controller.router.call import RoutedCall
from controller.router.memo import RouteMemo
from controller.router.refusals import Refusal
from controller.spec.schema import AdapterSpec, AliasSpec
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec
from tests.unit.test_routed_call import CHAT_BODY, Ctx, context

JSON = "application/json"


def served(
    ctx: Ctx, memo: RouteMemo, principal: Principal = TOKEN_PRINCIPAL, **kw: str
) -> RoutedCall:
    """One routed call through ``memo``, leased, sent and finished (its answer a 200)."""
    call = RoutedCall(ctx, principal, "chat", memo=memo)
    body = kw.get("body", CHAT_BODY.decode()).encode()
    assert call.begin(kw.get("asked"), JSON, body) is True
    call.upstream()
    call.answered(200)
    call.finish()
    return call


def refused(
    ctx: Ctx, memo: RouteMemo, principal: Principal = TOKEN_PRINCIPAL, **kw: str
) -> Refusal:
    call = RoutedCall(ctx, principal, "chat", memo=memo)
    body = kw.get("body", CHAT_BODY.decode()).encode()
    with pytest.raises(Refusal) as info:
        call.begin(kw.get("asked"), JSON, body)
    call.finish(info.value.status)
    return info.value


async def test_a_plain_route_is_kept_and_taken_again_with_every_step_still_run(
    tmp_path: Path,
) -> None:
    h, ctx = await context(tmp_path)
    memo = RouteMemo()
    first = served(ctx, memo)
    kept = memo.routing
    assert kept is not None and memo.candidates == ("chat",) and memo.model == "m"
    assert memo.who is first.who
    second = served(ctx, memo)
    assert memo.routing is kept  # taken, not decided again
    assert second.slot == "chat" and second.model == "m" and second.who is first.who
    assert h.manager.lease_count() == 0  # leased and released, both
    assert ctx.recorder.done == [("chat", "m", 200)] * 2  # and recorded, both


async def test_a_slot_bound_elsewhere_between_two_requests_is_seen(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path)
    memo = RouteMemo()
    assert served(ctx, memo).slot == "chat"
    specs = [slot_spec("chat", "m2", idle_timeout_s=0), slot_spec("other", "m", idle_timeout_s=0)]
    await h.manager.set_desired(desired(specs, [model_spec("m", 1), model_spec("m2", 1)]))
    await h.manager.load("other")
    assert served(ctx, memo).slot == "other"  # m's slot now


async def test_a_slot_type_changed_between_two_requests_is_seen(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path)
    memo = RouteMemo()
    served(ctx, memo)
    specs = [slot_spec("chat", "m", type="embedding", idle_timeout_s=0)]
    await h.manager.set_desired(desired(specs, [model_spec("m", 1)]))
    assert refused(ctx, memo).status == 400  # the model's slot serves no chat now
    assert memo.candidates == ("chat",)  # a refusal is not kept: it decides again


async def test_a_key_changed_between_two_requests_is_seen(tmp_path: Path) -> None:
    _, ctx = await context(tmp_path)
    memo = RouteMemo()
    key = Principal("k", Scope.INFERENCE, models=("m",), id="h1")
    served(ctx, memo, key)
    # keys.json changed: the key ring names the key by a new principal, its models narrowed
    narrowed = Principal("k", Scope.INFERENCE, models=("e",), id="h1")
    assert refused(ctx, memo, narrowed).status == 403
    assert served(ctx, memo, key).slot == "chat"  # and back


async def test_an_alias_declared_between_two_requests_is_seen(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path)
    specs = [slot_spec("chat", "m", idle_timeout_s=0), slot_spec("two", "m2", idle_timeout_s=0)]
    await h.manager.set_desired(desired(specs, [model_spec("m", 1), model_spec("m2", 1)]))
    await h.manager.load("chat")
    await h.manager.load("two")
    memo = RouteMemo()
    body = '{"model": "chat", "messages": []}'  # a slot's name: a plain route
    assert served(ctx, memo, body=body).slot == "chat"
    h.manager.set_aliases({"chat": AliasSpec(id="chat", models=["m2"])})
    call = served(ctx, memo, body=body)
    assert call.slot == "two" and call.model == "m2" and call.alias == "chat"


async def test_an_adapter_declared_between_two_requests_is_seen(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path)
    memo = RouteMemo()
    body = '{"model": "chat", "messages": []}'
    served(ctx, memo, body=body)
    h.manager.set_adapters({"chat": AdapterSpec(id="chat", base="m", source="/tmp/x.gguf")})
    refusal = refused(ctx, memo, body=body)  # an adapter now: no slot of m serves adapters
    assert refusal.status == 404 and "adapter" in refusal.message


async def test_settings_changed_between_two_requests_are_seen(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path)
    memo = RouteMemo()
    assert served(ctx, memo).who is not None
    assert memo.who is not None and memo.who.cls == "interactive"
    h.manager.settings = h.manager.settings.model_copy(update={"default_priority": "batch"})
    call = served(ctx, memo)
    assert call.who is not None and call.who.cls == "batch"
    assert refused(ctx, memo, asked="nope").status == 400  # the header: decided too


async def test_a_model_of_two_slots_and_refusals_are_not_kept(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    specs = [slot_spec("a", "m", idle_timeout_s=0), slot_spec("b", "m", idle_timeout_s=0)]
    await h.manager.set_desired(desired(specs, [model_spec("m", 1)]))
    await h.manager.load("a")
    ctx = Ctx(h.manager, h.manager.events, KeyRing(tmp_path, "t"))
    memo = RouteMemo()
    assert served(ctx, memo).slot == "a"  # two slots: ranked by their states each time
    assert memo.routing is None
    assert refused(ctx, memo, body='{"model": "nope"}').status == 404
    assert memo.routing is None
