"""REST routes of the API keys (``slotctl key``): list, create, revoke. Admin scope only.

A key is shown once, in the answer that creates it; ``keys.json`` holds its hash
(:mod:`controller.access.keys`). A created or revoked key counts from the next request on: the
requests in flight finish as they started.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Final

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from controller.access.keys import NAME_PATTERN, Scope, create_key, parse_duration, revoke_key
from controller.api.app import API_CTX, ApiContext, CtxKey, RouteTable, json_response, read_body
from controller.model.errors import InvalidRequest

__all__: list[str] = []

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

_LOCK: Final = CtxKey("keys_lock", asyncio.Lock)  # one change of keys.json at a time


class KeyCreate(BaseModel):
    """A key to create (``slotctl key create``)."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=NAME_PATTERN, description="the key's name")]
    scope: Annotated[str, Field(pattern="^(inference|read|admin)$")] = "inference"
    models: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, description="fnmatch patterns of the models it may use (none: all)"
    )
    priority: str | None = Field(default=None, description="its priority class (a declared one)")
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    rpm: Annotated[int, Field(ge=1)] | None = None
    expires: str | None = Field(default=None, description="a duration: 90s, 15m, 2h, 7d, 2w")


class KeyOut(BaseModel):
    name: str
    scope: str
    models: list[str]
    priority: str | None
    max_concurrency: int | None
    rpm: int | None
    created_at: float
    expires_at: float | None
    expired: bool
    last_used: float | None
    in_flight: int = 0


class KeyList(BaseModel):
    keys: list[KeyOut]
    waiting: dict[str, int] = Field(
        description="requests waiting now (a load, a turn), by priority class"
    )


class KeyCreated(KeyOut):
    key: str = Field(description="the key itself: shown this once, never stored")


def _lock(ctx: ApiContext) -> asyncio.Lock:
    lock = ctx.store.get(_LOCK)
    if lock is None:
        lock = asyncio.Lock()
        ctx.store.set(_LOCK, lock)
    return lock


def _listing(ctx: ApiContext) -> list[dict[str, Any]]:
    return ctx.keys.describe(time.time(), ctx.limits.in_flight)


@route(
    "GET",
    "/api/keys",
    summary="the API keys (never a key itself), with their last use",
    tag="keys",
    scope=Scope.ADMIN,
    responses={200: ("keys", KeyList)},
)
async def list_keys(request: web.Request) -> web.Response:
    ctx = request.app[API_CTX]
    return json_response({"keys": _listing(ctx), "waiting": ctx.manager.waiting_by_class()})


@route(
    "POST",
    "/api/keys",
    summary="create an API key: the answer shows it once",
    tag="keys",
    scope=Scope.ADMIN,
    body=KeyCreate,
    responses={201: ("the key, once", KeyCreated), 400: ("invalid, or a name in use", None)},
)
async def create(request: web.Request) -> web.Response:
    ctx = request.app[API_CTX]
    body: KeyCreate = await read_body(request, KeyCreate)
    classes = [c.name for c in ctx.manager.settings.priority_classes]
    if body.priority is not None and body.priority not in classes:
        raise InvalidRequest(
            f"unknown priority class {body.priority!r} (declared: {', '.join(classes)})",
            priority=body.priority,
        )
    expires = parse_duration(body.expires) if body.expires else None
    async with _lock(ctx):
        key, entry = await asyncio.to_thread(
            create_key,
            ctx.state_dir,
            body.name,
            scope=Scope.parse(body.scope),
            models=body.models,
            priority=body.priority,
            max_concurrency=body.max_concurrency,
            rpm=body.rpm,
            expires_in_s=expires,
        )
        ctx.keys.refresh()
    public = next(k for k in _listing(ctx) if k["name"] == entry.name)
    return json_response({**public, "key": key}, status=201)


@route(
    "DELETE",
    "/api/keys/{name}",
    summary="revoke an API key (its requests in flight finish)",
    tag="keys",
    scope=Scope.ADMIN,
    responses={200: ("the revoked key", KeyOut), 404: ("no such key", None)},
)
async def revoke(request: web.Request) -> web.Response:
    ctx = request.app[API_CTX]
    name = request.match_info["name"]
    async with _lock(ctx):
        entry = await asyncio.to_thread(revoke_key, ctx.state_dir, name)
        ctx.keys.refresh()
    data = entry.model_dump(mode="json", exclude={"sha256"})
    return json_response({**data, "expired": False, "last_used": None, "in_flight": 0})
