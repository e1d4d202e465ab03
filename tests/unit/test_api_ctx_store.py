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


async def test_the_router_opens_no_session_after_the_app_cleanup(tmp_path: Path) -> None:
    """A request still running when the app cleans up gets a 503, not a new upstream
    session that nobody would close (an unclosed connector)."""
    from aiohttp import web

    from controller.api import router_proxy
    from controller.api.app import API_CTX
    from controller.router.refusals import Refusal

    ctx = ApiContext(None, None, tmp_path, tmp_path, "t", EventBus())  # type: ignore[arg-type]
    app = web.Application()
    app[API_CTX] = ctx
    session = router_proxy._session(ctx)
    assert router_proxy._session(ctx) is session  # one shared session
    await router_proxy._close_session(app)
    assert session.closed and ctx.store.get(router_proxy.SESSION) is None
    with pytest.raises(Refusal) as refused:
        router_proxy._session(ctx)
    assert refused.value.status == 503
