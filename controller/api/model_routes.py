"""REST routes of the model catalogue: each model's state, load and unload (SPEC §9)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel

from controller.access.withheld import sees_secrets, withhold_strings
from controller.api.app import (
    ApiContext,
    RouteTable,
    json_response,
    principal_of,
)
from controller.api.dryrun import footprint_json
from controller.api.rest import (
    LoadAnswer,
    ctx_of,
    start_load,
)
from controller.model.errors import (
    ModelNotFound,
    SlotConfigError,
    SlotPinned,
)
from controller.model.lifecycle import SlotState
from controller.router.aliases import resolve
from controller.router.selection import ranked
from controller.slots.manager import SlotManager
from controller.slots.records import SlotView
from controller.spec.schema import ModelSpec

__all__: list[str] = []

log = logging.getLogger("slotctl.api")

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

S = SlotState

_MODEL_STATE: Final = {
    S.OFFLINE: "unloaded",
    S.PULLING: "loading",
    S.STARTING: "loading",
    S.WARMING: "loading",
    S.READY: "loaded",
    S.SERVING: "loaded",
    S.IDLE: "loaded",
    S.UNLOADING: "unloading",
    S.ERROR: "failed",
}


class ModelOut(BaseModel):
    id: str
    kind: str
    memory_gb: float | None  # declared; None: estimated (GET /api/models/{id}/footprint)
    exclusive_group: str | None = None
    state: str
    resident: bool
    loadable: bool
    slots: list[str]
    since: str | None = None
    error: str | None = None
    reason: str | None = None  # why an unloaded model is not loaded (waiting_for_memory)


class AliasOut(BaseModel):
    id: str
    models: list[str]
    prefer: str
    serves: str | None = None  # the member a request for it would go to now (None: none)


class ModelList(BaseModel):
    models: list[ModelOut]
    aliases: list[AliasOut] = []


# ----------------------------------------------------------------------------- models


def _model_out(ctx: ApiContext, model: ModelSpec) -> dict[str, Any]:
    manager = ctx.manager
    views = [v for v in manager.views() if v.model_id == model.id]
    best = _best(manager, views)
    state = _MODEL_STATE.get(best.state, "unloaded") if best else "unloaded"
    if best is not None and best.idle_reason == "no_model":
        state = "failed"
    return {
        "id": model.id,
        "kind": model.kind,
        "memory_gb": model.memory_gb,
        "exclusive_group": model.exclusive_group,
        "state": state,
        "resident": any(v.resident for v in views),
        "loadable": any((s := manager.known(v.name)) is not None and s.activated for v in views),
        "slots": [v.name for v in views],
        "since": best.since if best else None,
        "error": best.message if best is not None and best.state is S.ERROR else None,
        "reason": best.waiting if best is not None else None,
    }


def _best(manager: SlotManager, views: list[SlotView]) -> SlotView | None:
    """The slot a request for their model would get (the router's ranking)."""
    best = ranked(manager, views)
    return best[0] if best else None


def _catalogue_model(ctx: ApiContext, model_id: str) -> ModelSpec:
    model: ModelSpec | None = ctx.manager.models.get(model_id)
    if model is None:
        raise ModelNotFound(model_id)
    return model


@route(
    "GET",
    "/api/models",
    summary="the catalogue with each model's state",
    tag="models",
    responses={200: ("models", ModelList)},
)
async def list_models(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    models = [_model_out(ctx, m) for m in ctx.manager.models.values()]
    if not sees_secrets(principal_of(request)):  # an error may name a source URL
        models = [withhold_strings(m) for m in models]
    return json_response({"models": models, "aliases": _aliases_out(ctx.manager)})


def _aliases_out(manager: SlotManager) -> list[dict[str, Any]]:
    out = []
    for alias in manager.aliases.values():
        choice = resolve(manager, alias)
        out.append(
            {
                "id": alias.id,
                "models": list(alias.models),
                "prefer": alias.prefer,
                "serves": choice.model if choice is not None else None,
            }
        )
    return out


@route(
    "GET",
    "/api/models/{model_id:.+}/state",
    summary="one model's state",
    tag="models",
    responses={200: ("state", ModelOut), 404: ("unknown model", None)},
)
async def model_state(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    out = _model_out(ctx, _catalogue_model(ctx, request.match_info["model_id"]))
    return json_response(out if sees_secrets(principal_of(request)) else withhold_strings(out))


class FootprintList(BaseModel):
    model: str
    slots: list[dict[str, Any]]  # one footprint per slot that binds it (footprint_json)


@route(
    "GET",
    "/api/models/{model_id:.+}/footprint",
    summary="what the model would hold on each slot that binds it, part by part",
    tag="models",
    responses={200: ("footprints", FootprintList), 404: ("unknown model", None)},
)
async def model_footprint(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    model = _catalogue_model(ctx, request.match_info["model_id"])
    views = await ctx.manager.footprints(model.id)
    return json_response({"model": model.id, "slots": [footprint_json(v) for v in views]})


@route(
    "POST",
    "/api/models/{model_id:.+}/load",
    summary="202 loading, 200 already, 409 insufficient_memory, 404 unknown, 400 disabled",
    tag="models",
    responses={
        200: ("already loaded", LoadAnswer),
        202: ("loading", LoadAnswer),
        400: ("no activated slot serves it", None),
        404: ("unknown model", None),
        409: ("insufficient memory", None),
        503: ("crash looping", None),
    },
)
async def load_model(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    model = _catalogue_model(ctx, request.match_info["model_id"])
    views = [v for v in ctx.manager.views() if v.model_id == model.id]
    active = [v for v in views if (spec := ctx.manager.known(v.name)) and spec.activated]
    if not active:
        raise SlotConfigError(
            f"model {model.id!r} is disabled: no activated slot serves it",
            keys=["model.default"],
            disabled=True,
        )
    best = _best(ctx.manager, active)
    assert best is not None
    status, body = await start_load(ctx, best.name)
    return json_response(body, status=status)


@route(
    "POST",
    "/api/models/{model_id:.+}/unload",
    summary="202 unloading, 200 already unloaded, 404 unknown",
    tag="models",
    responses={
        200: ("already unloaded", LoadAnswer),
        202: ("unloading", LoadAnswer),
        404: ("unknown model", None),
        409: ("pinned", None),
    },
)
async def unload_model(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    model = _catalogue_model(ctx, request.match_info["model_id"])
    views = [v for v in ctx.manager.views() if v.model_id == model.id]
    loaded = [v for v in views if v.state not in (S.OFFLINE, S.ERROR)]
    for view in loaded:
        if view.pinned:
            raise SlotPinned(view.name, "unload")
    # A failed or refused model may still be wished resident (it would be retried
    # forever, across restarts) or hold a crash-loop count: unloading it clears both.
    cleared: dict[str, list[str]] = {"residency": [], "failures": []}
    busy = {v.name for v in loaded}
    for view in views:
        if view.name in busy:
            continue
        if view.failures or view.state is S.ERROR:
            await ctx.manager.reset(view.name)
            cleared["failures"].append(view.name)
        if view.resident or view.waiting:
            await ctx.manager.unload(view.name, force=True)
            cleared["residency"].append(view.name)
    for view in loaded:
        ctx.tasks.spawn(ctx.manager.unload(view.name, pause=True), f"unload:{view.name}")
    await asyncio.sleep(0)
    if loaded:
        return json_response({"status": "unloading", "cleared": cleared}, status=202)
    if cleared["residency"] or cleared["failures"]:
        said = [f"{k} of {', '.join(v)}" for k, v in cleared.items() if v]
        message = f"not loaded; cleared the {' and the '.join(said)}"
        return json_response({"status": "unloaded", "cleared": cleared, "message": message})
    return json_response({"status": "already unloaded"})
