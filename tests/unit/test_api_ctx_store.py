"""ApiContext's typed store (controller.api.app.CtxStore): each route module's objects
under typed keys, a value of the wrong type refused, one value per key and context."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.api import dashboard, metrics, sse
from controller.api.app import REQUEST_RECORDER, ApiContext, CtxKey, CtxStore
from controller.kit.eventbus import EventBus

TIMEOUT_KEY = CtxKey("timeout_s", float)


def test_get_set_pop_setdefault() -> None:
    store = CtxStore()
    assert store.get(TIMEOUT_KEY) is None
    store.set(TIMEOUT_KEY, 1.5)
    assert store.get(TIMEOUT_KEY) == 1.5
    assert store.setdefault(TIMEOUT_KEY, lambda: 9.0) == 1.5
    assert store.pop(TIMEOUT_KEY) == 1.5 and store.get(TIMEOUT_KEY) is None
    assert store.setdefault(TIMEOUT_KEY, lambda: 9.0) == 9.0


def test_a_value_of_the_wrong_type_is_refused() -> None:
    store = CtxStore()
    with pytest.raises(TypeError, match="timeout_s"):
        store.set(TIMEOUT_KEY, "soon")  # type: ignore[arg-type]
    assert store.get(TIMEOUT_KEY) is None


def test_two_keys_with_one_name_do_not_collide() -> None:
    store = CtxStore()
    other = CtxKey("timeout_s", float)
    store.set(TIMEOUT_KEY, 1.0)
    assert store.get(other) is None


def test_metrics_register_once_per_context_as_the_request_recorder(tmp_path: Path) -> None:
    ctx = ApiContext(None, None, tmp_path, tmp_path, "t", EventBus())  # type: ignore[arg-type]
    first = metrics.metrics_of(ctx)
    assert metrics.metrics_of(ctx) is first
    assert ctx.store.get(metrics.METRICS) is first
    assert ctx.store.get(REQUEST_RECORDER) is first


def test_login_codes_live_on_their_context(tmp_path: Path) -> None:
    ctx = ApiContext(None, None, tmp_path, tmp_path, "t", EventBus())  # type: ignore[arg-type]
    other = ApiContext(None, None, tmp_path, tmp_path, "t", EventBus())  # type: ignore[arg-type]
    code = dashboard.mint_login_code(ctx)
    assert code in (ctx.store.get(dashboard._LOGIN_CODES) or {})
    assert other.store.get(dashboard._LOGIN_CODES) is None
    assert sse.KEEPALIVE.type is float


async def test_a_routed_call_begun_after_the_app_cleanup_is_a_503(tmp_path: Path) -> None:
    """A request still arriving when the app cleans up gets a 503 (the API is closed),
    not a lease and an upstream exchange nobody would end."""
    from aiohttp import web

    from controller.access.keys import TOKEN_PRINCIPAL
    from controller.api import openai
    from controller.api.app import API_CTX
    from controller.router.call import RoutedCall
    from controller.router.refusals import Refusal

    ctx = ApiContext(None, None, tmp_path, tmp_path, "t", EventBus())  # type: ignore[arg-type]
    app = web.Application()
    app[API_CTX] = ctx
    openai.setup(app, ctx)
    assert not ctx.closed
    app.freeze()
    await app.cleanup()
    assert ctx.closed
    call = RoutedCall(ctx, TOKEN_PRINCIPAL, "chat")
    with pytest.raises(Refusal) as refused:
        call.begin(None, "application/json", b'{"model": "m"}')
    assert refused.value.status == 503 and refused.value.code == "slot.not_ready"
