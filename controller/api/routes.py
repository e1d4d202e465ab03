"""REST routes: health and slots. Registered in this module's table (:data:`routes`).

Handlers are thin: config writes go through the guard (``write_slot_config``), state
changes through the SlotManager, desired-state changes wake the reconciler. Loads that
take time answer ``202`` once admission passed (an admission refusal still answers
synchronously with its typed error), ``200`` when there was nothing to do.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from controller.access.keys import Scope
from controller.access.withheld import sees_secrets, withhold_slot
from controller.api.app import (
    ApiContext,
    Query,
    RouteTable,
    json_response,
    principal_of,
    query_flag,
    read_body,
)
from controller.api.dryrun import plan_json
from controller.api.rest import (
    LoadAnswer,
    SlotOut,
    ctx_of,
    declared_slot,
    desired_state,
    name_of,
    parse_cache,
    slot_out,
    start_load,
    wake,
)
from controller.model.errors import (
    InvalidRequest,
    ModelNotFound,
    SlotConfigError,
    SlotctlError,
    SlotNotFound,
    SlotOwnedByStack,
    SlotPinned,
)
from controller.model.lifecycle import SlotState
from controller.spec.guard import delete_slot_config, write_slot_config
from controller.spec.loader import DesiredSlot
from controller.spec.render import slot_effective
from controller.spec.schema import MODEL_OWNED_KEYS, SlotSpec

__all__: list[str] = []

log = logging.getLogger("slotctl.api")

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

S = SlotState


class SlotList(BaseModel):
    slots: list[SlotOut]


class SwapBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)


class HoldBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl_s: float = Field(gt=0, le=7 * 24 * 3600)


class SlotLogs(BaseModel):
    slot: str
    lines: list[str]


class HoldAnswer(BaseModel):
    lease: int
    slot: str
    expires_in_s: float


class SlotDefaults(BaseModel):
    """Slot-owned scheduling defaults; any other key is reported (model-owned or unknown)."""

    model_config = ConfigDict(extra="allow")

    priority: int | None = Field(default=None, ge=0, le=100)
    pinned: bool | None = None
    autoload: bool | None = None
    idle_timeout_s: float | None = Field(default=None, ge=0)
    ttl_s: float | None = Field(default=None, ge=0)
    drain_timeout_s: float | None = Field(default=None, ge=0)
    max_queue: int | None = Field(default=None, ge=0)


class SlotCreated(BaseModel):
    created: str
    spec: dict[str, Any]


class SlotWritten(BaseModel):
    written: str
    spec: dict[str, Any]


class Health(BaseModel):
    status: str
    version: str | None = None


# ----------------------------------------------------------------------------- health


@route(
    "GET",
    "/healthz",
    summary="liveness of the controller (no auth)",
    tag="health",
    public=True,
    responses={200: ("alive", Health)},
)
async def healthz(request: web.Request) -> web.Response:
    from controller import __version__

    return json_response({"status": "ok", "version": __version__})


@route(
    "GET",
    "/readyz",
    summary="ready: state recovered and the reconciler running",
    tag="health",
    responses={200: ("ready", Health), 503: ("starting", None)},
)
async def readyz(request: web.Request) -> web.Response:
    if ctx_of(request).ready.is_set():
        return json_response({"status": "ready"})
    return json_response(
        {"error": {"code": "controller.starting", "message": "recovering state"}}, status=503
    )


# ----------------------------------------------------------------------------- slots


@route(
    "GET",
    "/api/slots",
    summary="every slot with its live state",
    tag="slots",
    responses={200: ("slots", SlotList)},
)
async def list_slots(request: web.Request) -> web.Response:
    views = ctx_of(request).manager.views()
    slots = [slot_out(v) for v in views]
    if not sees_secrets(principal_of(request)):  # a message may name a URL
        slots = [withhold_slot(s) for s in slots]
    return json_response({"slots": slots})


@route(
    "POST",
    "/api/slots",
    summary="create a slot (through the write guard)",
    tag="slots",
    body=SlotSpec,
    responses={201: ("created", SlotCreated), 400: ("invalid", None), 409: ("conflict", None)},
)
async def create_slot(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    payload = await read_body(request, dict[str, Any])
    spec = await asyncio.to_thread(
        write_slot_config, ctx.config_dir, payload, create=True, cache=parse_cache(ctx)
    )
    await wake(ctx, spec.name)
    return json_response({"created": spec.name, "spec": slot_effective(spec)}, status=201)


@route(
    "GET",
    "/api/slots/{name}",
    summary="one slot: live view and spec",
    tag="slots",
    responses={200: ("slot", SlotOut), 404: ("unknown slot", None)},
)
async def get_slot(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    name = name_of(request)
    data = slot_out(ctx.manager.view(name))
    desired = (await desired_state(ctx)).slots.get(name)
    if desired is not None:
        data["spec"] = slot_effective(desired.spec)
    if not sees_secrets(principal_of(request)):  # below admin: env values, secret flags
        data = withhold_slot(data)
    return json_response(data)


@route(
    "DELETE",
    "/api/slots/{name}",
    summary="delete a slot (pinned: force=true)",
    tag="slots",
    query=[Query("force", "boolean", "needed for a pinned slot")],
    responses={
        202: ("deleting", LoadAnswer),
        404: ("unknown slot", None),
        409: ("pinned, or declared by the GitOps stack dir", None),
    },
)
async def delete_slot(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    name = name_of(request)
    force = query_flag(request, "force")
    desired = (await desired_state(ctx)).slots.get(name)
    if desired is None:
        raise SlotNotFound(name)
    _refuse_if_owned(ctx, desired, "remove")
    if desired.pinned and not force:
        raise SlotPinned(name, "delete")
    await asyncio.to_thread(
        delete_slot_config, ctx.config_dir, name, force=force, cache=parse_cache(ctx)
    )
    await wake(ctx, name)
    return json_response({"status": "deleting", "slot": None}, status=202)


@route(
    "PUT",
    "/api/slots/{name}/config",
    summary="replace a slot's config (guarded)",
    tag="slots",
    body=SlotSpec,
    responses={
        200: ("written", SlotWritten),
        400: ("invalid", None),
        404: ("unknown", None),
        409: ("conflict", None),
    },
)
async def put_config(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    name = name_of(request)
    _refuse_if_owned(ctx, await declared_slot(ctx, name), "change")
    payload = await read_body(request, dict[str, Any])
    if payload.setdefault("name", name) != name:
        raise InvalidRequest(f"the body names slot {payload['name']!r}, the path {name!r}")
    spec = await asyncio.to_thread(
        write_slot_config, ctx.config_dir, payload, cache=parse_cache(ctx)
    )
    await wake(ctx, name)
    return json_response({"written": name, "spec": slot_effective(spec)})


@route(
    "PATCH",
    "/api/slots/{name}/defaults",
    summary="change slot-owned defaults; model-owned keys are reported",
    tag="slots",
    body=SlotDefaults,
    responses={
        200: ("written", SlotWritten),
        400: ("invalid or model-owned", None),
        404: ("unknown", None),
        409: ("conflict (NPU exclusivity)", None),
    },
)
async def patch_defaults(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    name = name_of(request)
    _refuse_if_owned(ctx, await declared_slot(ctx, name), "change")
    patch = await read_body(request, dict[str, Any])
    # Defaults are the slot's scheduling knobs. Model-owned keys pass on to the guard, which
    # reports them as model-owned; anything else (provider, port, server...) belongs to
    # PUT /config, never to a defaults patch.
    other = sorted(set(patch) - set(SlotDefaults.model_fields) - MODEL_OWNED_KEYS - {"name"})
    if other:
        raise SlotConfigError(
            f"not slot defaults: {', '.join(other)} (change them with PUT "
            f"/api/slots/{name}/config)",
            keys=other,
        )
    patch["name"] = name
    spec = await asyncio.to_thread(
        write_slot_config, ctx.config_dir, patch, merge=True, cache=parse_cache(ctx)
    )
    await wake(ctx, name)
    return json_response({"written": name, "spec": slot_effective(spec)})


@route(
    "POST",
    "/api/slots/{name}/load",
    summary="load a slot (202 loading, 200 already); dry_run explains the plan",
    tag="slots",
    query=[Query("dry_run", "boolean", "explain, change nothing")],
    responses={
        200: ("loaded or plan", LoadAnswer),
        202: ("loading", LoadAnswer),
        400: ("not activated", None),
        404: ("unknown slot", None),
        409: ("insufficient memory / pinned peer / model file missing", None),
        503: ("crash looping", None),
        507: ("the model's pull does not fit the models dir", None),
    },
)
async def load_slot(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    name = name_of(request)
    if query_flag(request, "dry_run"):
        plan = plan_json(await ctx.manager.explain(name))  # with its model files' pull
        return json_response({"status": "dry run", "plan": plan})
    status, body = await start_load(ctx, name)
    return json_response(body, status=status)


@route(
    "POST",
    "/api/slots/{name}/unload",
    summary="unload (drain, stop); pinned: force",
    tag="slots",
    query=[Query("force", "boolean", "needed for a pinned slot")],
    responses={200: ("unloaded", LoadAnswer), 404: ("unknown", None), 409: ("pinned", None)},
)
async def unload_slot(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    name = name_of(request)
    view = await ctx.manager.unload(name, force=query_flag(request, "force"), pause=True)
    body: dict[str, Any] = {"status": "unloaded", "slot": slot_out(view)}
    if view.paused:
        body["message"] = (
            f"autoload slot {name} paused: it stays unloaded until `slotctl slot load {name}`"
        )
    return json_response(body)


@route(
    "POST",
    "/api/slots/{name}/swap",
    summary="serve another catalogue model on a slot",
    tag="slots",
    body=SwapBody,
    responses={
        200: ("swapped", LoadAnswer),
        400: ("invalid", None),
        404: ("unknown slot or model", None),
        409: ("insufficient memory", None),
        503: ("crash looping or not ready", None),
    },
)
async def swap_slot(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    name = name_of(request)
    body: SwapBody = await read_body(request, SwapBody)
    current = await declared_slot(ctx, name)
    _refuse_if_owned(ctx, current, "change its model")
    desired = await desired_state(ctx)
    if body.model not in desired.models:
        raise ModelNotFound(body.model)
    previous = current.spec.model_id  # "" for a slot not activated yet: it goes back to that
    # The binding has one writer, the guard: write it, read the declared slot back, and
    # the manager takes that (as the reconciler would), never a binding of its own.
    declared = await _rebind(ctx, name, body.model)
    try:
        view = await ctx.manager.swap(declared)
    except SlotctlError as refused:
        # Refused (memory, breaker, pinned peer): the declared binding goes back, and the
        # reconciler brings the previous model back if the slot is meant to be loaded.
        try:
            ctx.manager.upsert(await _rebind(ctx, name, previous))
        except SlotctlError as exc:  # the refusal is the answer; the failed undo is logged
            log.error("slot %s: swap refused, and its binding not put back: %s", name, exc)
        raise refused
    return json_response({"status": "swapped", "slot": slot_out(view)})


def _refuse_if_owned(ctx: ApiContext, declared: DesiredSlot, action: str) -> None:
    """GitOps: the stack dir is the source of truth; an API write to a slot it declares
    would be undone at the next apply (or silently stick until then). Refuse, naming
    the owner."""
    if ctx.stack_dir is not None and declared.stack and declared.stack in ctx.gitops_stacks:
        raise SlotOwnedByStack(declared.name, declared.stack, str(ctx.stack_dir), action)


async def _rebind(ctx: ApiContext, name: str, model_id: str) -> DesiredSlot:
    """Write ``name``'s model binding through the guard (off the event loop), let the
    reconciler re-read, and return the slot as now declared."""
    patch = {"name": name, "model": {"default": model_id}}
    await asyncio.to_thread(
        write_slot_config, ctx.config_dir, patch, merge=True, cache=parse_cache(ctx)
    )
    await wake(ctx, name)
    return await declared_slot(ctx, name)


@route(
    "POST",
    "/api/slots/{name}/reset",
    summary="clear the crash-loop breaker",
    tag="slots",
    responses={200: ("reset", LoadAnswer), 404: ("unknown", None)},
)
async def reset_slot(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    view = await ctx.manager.reset(name_of(request))
    await wake(ctx, view.name)
    return json_response({"status": "reset", "slot": slot_out(view)})


_MAX_LOG_LINES: Final = 10_000


@route(
    "GET",
    "/api/slots/{name}/logs",
    summary="the last lines the slot's server wrote (admin: they may carry prompts, secrets)",
    tag="slots",
    scope=Scope.ADMIN,  # a server's log may carry prompts and its own secrets
    query=[Query("tail", "integer", f"how many lines (default 100, at most {_MAX_LOG_LINES})")],
    responses={200: ("log lines", SlotLogs), 400: ("bad tail", None), 404: ("unknown", None)},
)
async def slot_logs(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    name = name_of(request)
    raw = request.query.get("tail", "100")
    if not raw.isdigit() or not 0 < int(raw) <= _MAX_LOG_LINES:
        raise InvalidRequest(f"tail must be an integer from 1 to {_MAX_LOG_LINES}, got {raw!r}")
    ctx.manager.view(name)  # SlotNotFound (404) for a slot the controller does not know
    lines = await ctx.manager.runtime.logs(name, tail=int(raw))
    return json_response({"slot": name, "lines": lines})


_HOLD_RESPONSES: Final[dict[int, tuple[str, Any]]] = {
    200: ("held", HoldAnswer),
    404: ("unknown", None),
    409: ("insufficient memory", None),
    503: ("not ready", None),
}


@route(
    "POST",
    "/api/slots/{name}/hold",
    summary="batch lease: keep loaded and unevictable for ttl_s",
    tag="slots",
    body=HoldBody,
    responses=_HOLD_RESPONSES,
)
async def hold_slot(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    body: HoldBody = await read_body(request, HoldBody)
    lease = await ctx.manager.hold(name_of(request), body.ttl_s)
    return json_response({"lease": lease.id, "slot": lease.slot, "expires_in_s": body.ttl_s})


@route(
    "POST",
    "/api/slots/{name}/lease",
    summary="batch lease (SPEC §7's name for /hold): keep loaded and unevictable for ttl_s",
    tag="slots",
    body=HoldBody,
    responses=_HOLD_RESPONSES,
)
async def lease_slot(request: web.Request) -> web.StreamResponse:
    return await hold_slot(request)
