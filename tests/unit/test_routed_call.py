"""The routed call, sans I/O (issue 41, item 4): the one script of a routed request, driven
here without a socket — begin (a lease now, a wait, a refusal), upstream, finish — against
a real SlotManager on FakeRuntime, as the data plane drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from controller.access.keys import TOKEN_PRINCIPAL, KeyLimits, KeyRing, Principal, Scope
from controller.kit.eventbus import EventBus
from controller.model.lifecycle import SlotState
from controller.router.call import CallStateError, Phase, RoutedCall, record_unserved
from controller.router.context import CLIENT_CLOSED
from controller.router.endpoints import AUDIO, CHAT, MODEL, MODELS, match
from controller.router.refusals import Refusal
from controller.slots.interfaces import RouterPort
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec

S = SlotState
CHAT_BODY = b'{"model": "m", "messages": []}'


@dataclass
class Recorder:
    done: list[tuple[str, str, int | str]] = field(default_factory=list)
    keys: list[tuple[str, str, int | str, float | None]] = field(default_factory=list)

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
        self.done.append((slot, model, status))
        if key is not None:
            self.keys.append((key, cls, status, waited))

    def key_tokens(self, key: str, cls: str, prompt: int, completion: int) -> None:
        pass


@dataclass
class Ctx:
    """A RouterContext over a manager (the API's ApiContext in production)."""

    manager: RouterPort
    events: EventBus
    keys: KeyRing
    limits: KeyLimits = field(default_factory=KeyLimits)
    recorder: Recorder = field(default_factory=Recorder)
    closed: bool = False


async def context(tmp_path: Path, *, load: bool = True) -> tuple[Harness, Ctx]:
    h = Harness(tmp_path)
    specs = [
        slot_spec("chat", "m", idle_timeout_s=0),
        slot_spec("emb", "e", type="embedding", idle_timeout_s=0),
    ]
    await h.manager.set_desired(desired(specs, [model_spec("m", 1), model_spec("e", 1)]))
    if load:
        await h.manager.load("chat")
    return h, Ctx(h.manager, h.manager.events, KeyRing(tmp_path, "t"))


async def test_a_warm_slot_is_leased_at_begin_and_released_at_finish(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path)
    call = RoutedCall(ctx, TOKEN_PRINCIPAL, "chat")
    assert call.phase is Phase.BEGUN
    assert call.begin(None, "application/json", CHAT_BODY) is True
    assert call.phase is Phase.LEASED and call.slot == "chat" and call.model == "m"
    assert h.manager.view("chat").state is S.SERVING
    endpoint, body = call.upstream()
    assert endpoint.startswith("http://") and body is CHAT_BODY  # passed unchanged
    assert call.phase is Phase.UPSTREAM
    call.answered(200)
    call.finish()
    call.finish()  # once
    assert call.phase is Phase.DONE
    assert h.manager.view("chat").state is S.READY and h.manager.lease_count() == 0
    assert ctx.recorder.done == [("chat", "m", 200)]
    assert ctx.recorder.keys == [("", "interactive", 200, None)]  # the default class


async def test_a_cold_slot_is_waited_for(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path, load=False)
    call = RoutedCall(ctx, TOKEN_PRINCIPAL, "chat")
    assert call.begin(None, "application/json", CHAT_BODY) is False
    assert call.phase is Phase.WAITING
    with pytest.raises(CallStateError):
        call.upstream()  # no lease yet: a driver's bug, said so
    await call.wait()
    assert call.phase is Phase.LEASED and call.waited is not None
    call.finish(200)
    assert h.manager.lease_count() == 0
    assert ctx.recorder.keys[0][3] is not None  # the wait is counted for its class


@pytest.mark.parametrize(
    ("kind", "body", "status", "code"),
    [
        ("chat", b'{"model": "nope"}', 404, "model_not_found"),
        ("chat", b"{not json", 400, "invalid_json"),
        ("chat", b'{"model": 7}', 400, "invalid_model"),
        ("embeddings", CHAT_BODY, 400, "model_not_supported"),
        ("", CHAT_BODY, 400, "invalid_request_error"),  # an audio path that is no endpoint
    ],
)
async def test_refusals_come_before_any_lease_or_load(
    tmp_path: Path, kind: str, body: bytes, status: int, code: str
) -> None:
    h, ctx = await context(tmp_path, load=False)
    call = RoutedCall(ctx, TOKEN_PRINCIPAL, kind, path="..")
    with pytest.raises(Refusal) as refused:
        call.begin(None, "application/json", body)
    assert (refused.value.status, refused.value.code) == (status, code)
    call.refused(refused.value)
    call.finish()
    assert [(slot, status) for slot, _, status in ctx.recorder.done] == [("", status)]
    assert h.manager.view("chat").state is S.OFFLINE and h.manager.lease_count() == 0


async def test_a_key_is_held_to_its_models_and_limits(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path)
    key = Principal("team", Scope.INFERENCE, models=("e",), max_concurrency=1)
    with pytest.raises(Refusal) as refused:
        RoutedCall(ctx, key, "chat").begin(None, "application/json", CHAT_BODY)
    assert refused.value.status == 403
    free = Principal("free", Scope.INFERENCE, max_concurrency=1)
    first = RoutedCall(ctx, free, "chat")
    assert first.begin(None, "application/json", CHAT_BODY)
    with pytest.raises(Refusal) as limited:
        RoutedCall(ctx, free, "chat").begin(None, "application/json", CHAT_BODY)
    assert limited.value.status == 429
    first.keep(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}}')
    first.finish(200)
    again = RoutedCall(ctx, free, "chat")
    assert again.begin(None, "application/json", CHAT_BODY)  # counted out at finish
    again.finish(200)
    assert h.manager.lease_count() == 0


async def test_what_a_given_up_call_answers(tmp_path: Path) -> None:
    h, ctx = await context(tmp_path)
    answers = {}
    for reason in ("lease", "timeout", "shutdown", "client"):
        call = RoutedCall(ctx, TOKEN_PRINCIPAL, "chat")
        assert call.begin(None, "application/json", CHAT_BODY)
        refusal = call.interrupted(reason, 3.0)
        answers[reason] = (refusal.status if refusal else None, call.status)
        call.finish()
    assert answers == {
        "lease": (502, 502),
        "timeout": (504, 504),
        "shutdown": (503, 503),
        "client": (None, CLIENT_CLOSED),
    }
    assert h.manager.lease_count() == 0
    record_unserved(ctx, 0.0, 413)
    assert ctx.recorder.done[-1] == ("", "", 413)


def test_the_endpoint_table_matches_paths_and_methods() -> None:
    assert match("POST", "/v1/chat/completions").endpoint is CHAT
    assert match("GET", "/v1/models").endpoint is MODELS
    found = match("GET", "/v1/models/org/m:q4")
    assert (found.endpoint, found.arg) == (MODEL, "org/m:q4")
    found = match("POST", "/v1/audio/speech")
    assert (found.endpoint, found.kind) == (AUDIO, "speech")
    assert match("POST", "/v1/audio/other").kind == "audio"
    assert match("GET", "/v1/chat/completions").allow == ("POST",)
    assert match("GET", "/v1/nothing") == match("GET", "/v1")
    assert match("GET", "/v1/nothing").allow == ()
