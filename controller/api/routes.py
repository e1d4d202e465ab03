"""REST routes: health, slots, models, stacks, OpenAPI. Registered with :func:`route`.

Handlers are thin: config writes go through the guard (``write_slot_config``), state
changes through the SlotManager, desired-state changes wake the reconciler. Loads that
take time answer ``202`` once admission passed (an admission refusal still answers
synchronously with its typed error), ``200`` when there was nothing to do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from controller.api.app import (
    API_CTX,
    ApiContext,
    Query,
    RouteTable,
    json_response,
    query_flag,
    read_body,
)
from controller.api.selection import ranked
from controller.apply import apply_to_config, plan_stack
from controller.errors import (
    InvalidRequest,
    ModelNotFound,
    SlotConfigError,
    SlotctlError,
    SlotNotFound,
    SlotOwnedByStack,
    SlotPinned,
)
from controller.lifecycle import SlotState
from controller.slots import SlotManager, SlotView
from controller.spec.configdir import ConfigSnapshot, read_config_dir, read_settings
from controller.spec.guard import delete_slot_config, write_slot_config
from controller.spec.loader import load_stack_texts
from controller.spec.render import slot_effective
from controller.spec.schema import MODEL_OWNED_KEYS, ModelSpec, SlotSpec

__all__: list[str] = []

log = logging.getLogger("slotctl.api")

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

S = SlotState
# Slot states as a catalogue model's state (the local-API vocabulary of SPEC §9).
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


# ----------------------------------------------------------------------------- schemas


class SlotOut(BaseModel):
    """A slot: its live view and, when declared, its effective spec."""

    model_config = ConfigDict(extra="allow")

    name: str
    state: str
    idle_reason: str | None = None
    dispatchable: bool
    model_id: str
    device: str
    priority: int
    pinned: bool
    autoload: bool
    resident: bool
    memory_bytes: int
    leases: int
    waiters: int
    since: str
    message: str
    endpoint: str | None = None
    failures: int
    retry_after_s: float
    config_hash: str | None = None
    stack: str
    waiting: str | None = None  # "waiting_for_memory": a background load waits for room
    paused: bool = False  # autoload paused by a user's unload (until a user's load)
    held_for_s: float | None = None
    holds: int = 0


class SlotList(BaseModel):
    slots: list[SlotOut]


class LoadAnswer(BaseModel):
    status: str  # loading | already loaded | unloading | already unloaded | ...
    slot: SlotOut | None = None
    plan: dict[str, Any] | None = None
    cleared: dict[str, list[str]] | None = None  # model unload: residency/failures cleared
    message: str | None = None


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


class ModelOut(BaseModel):
    id: str
    kind: str
    memory_gb: float
    exclusive_group: str | None = None
    state: str
    resident: bool
    loadable: bool
    slots: list[str]
    since: str | None = None
    error: str | None = None
    reason: str | None = None  # why an unloaded model is not loaded (waiting_for_memory)


class ModelList(BaseModel):
    models: list[ModelOut]


class StackFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="the file's name, for error locations")
    text: str = Field(description="the file's TOML text")


class StackBody(BaseModel):
    """One stack file (``stack`` + ``name``) or several that form one desired state
    (``files``, merged in the order given, like a directory of them)."""

    model_config = ConfigDict(extra="forbid")
    stack: str | None = Field(default=None, description="the stack file's TOML text")
    name: str = Field(default="request.toml", description="a name for error locations")
    files: list[StackFile] = Field(default_factory=list, description="several stack files")
    prune: bool | None = Field(
        default=None,
        description="apply: remove the stack's undeclared slots (default false); "
        "diff: show them as deletions (default true)",
    )
    dry_run: bool = False
    force: bool = Field(default=False, description="apply with prune: remove pinned slots too")

    def texts(self) -> list[tuple[str, str]]:
        out = [(f.name, f.text) for f in self.files]
        if self.stack is not None:
            out.insert(0, (self.name, self.stack))
        if not out:
            raise InvalidRequest("give the stack's TOML text in `stack` or `files`")
        return out


class SlotCreated(BaseModel):
    created: str
    spec: dict[str, Any]


class SlotWritten(BaseModel):
    written: str
    spec: dict[str, Any]


class ApplyAnswer(BaseModel):
    plan: list[dict[str, Any]]
    changed: list[str]
    dry_run: bool


class DiffAnswer(BaseModel):
    model_config = ConfigDict(extra="allow")

    in_sync: bool
    actions: list[dict[str, Any]]
    config_diffs: dict[str, str]
    drift: dict[str, list[str]]
    notes: dict[str, list[str]] = Field(default_factory=dict)
    orphans: list[str]
    models_changed: list[str]
    json_patch: list[dict[str, Any]]


class Health(BaseModel):
    status: str
    version: str | None = None


# ----------------------------------------------------------------------------- helpers


def _ctx(request: web.Request) -> ApiContext:
    return request.app[API_CTX]


def slot_out(view: SlotView) -> dict[str, Any]:
    data = dataclasses.asdict(view)
    data["state"] = view.state.value
    data["dispatchable"] = view.dispatchable
    return data


def _name(request: web.Request) -> str:
    return request.match_info["name"]


async def _start_load(ctx: ApiContext, name: str) -> tuple[int, dict[str, Any]]:
    """Start a load; answer once admission is decided (typed error if refused).

    A load already in flight answers ``202`` at once (its admission was decided).
    """
    manager = ctx.manager
    view: SlotView = manager.view(name)
    if view.dispatchable:
        return 200, {"status": "already loaded", "slot": slot_out(view)}
    view = await manager.start_load(name)
    if view.dispatchable:
        return 200, {"status": "loaded", "slot": slot_out(view)}
    return 202, {"status": "loading", "slot": slot_out(view)}


async def _wake(ctx: ApiContext, name: str | None = None) -> None:
    """After a config write: the reconciler re-reads the config dir (in a worker thread:
    with a thousand slots that read takes seconds) and looks at the slot(s) again."""
    reconciler = ctx.reconciler
    if reconciler is None:
        return
    await reconciler.refresh_async()
    if name is None:
        reconciler.enqueue_all()
    else:
        reconciler.enqueue(name)


async def _desired(ctx: ApiContext) -> ConfigSnapshot:
    """The desired state as the reconciler holds it: one cache, refreshed by the watcher,
    the resync and every API write (:func:`_wake`); read off the loop only without one."""
    if ctx.reconciler is not None:
        return ctx.reconciler.snapshot
    return await asyncio.to_thread(read_config_dir, ctx.config_dir)


async def _require_declared(ctx: ApiContext, name: str) -> None:
    if name not in (await _desired(ctx)).slots:
        raise SlotNotFound(name)


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
    if _ctx(request).ready.is_set():
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
    views = _ctx(request).manager.views()
    return json_response({"slots": [slot_out(v) for v in views]})


@route(
    "POST",
    "/api/slots",
    summary="create a slot (through the write guard)",
    tag="slots",
    body=SlotSpec,
    responses={201: ("created", SlotCreated), 400: ("invalid", None), 409: ("conflict", None)},
)
async def create_slot(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    payload = await read_body(request, dict[str, Any])
    name = payload.get("name")
    if isinstance(name, str) and name in (await _desired(ctx)).slots:
        raise SlotConfigError(
            f"slot {name!r} already exists: PUT its config instead", keys=["name"]
        )
    spec = write_slot_config(ctx.config_dir, payload)
    await _wake(ctx, spec.name)
    return json_response({"created": spec.name, "spec": slot_effective(spec)}, status=201)


@route(
    "GET",
    "/api/slots/{name}",
    summary="one slot: live view and spec",
    tag="slots",
    responses={200: ("slot", SlotOut), 404: ("unknown slot", None)},
)
async def get_slot(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    name = _name(request)
    data = slot_out(ctx.manager.view(name))
    desired = (await _desired(ctx)).slots.get(name)
    if desired is not None:
        data["spec"] = slot_effective(desired.spec)
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
    ctx = _ctx(request)
    name = _name(request)
    force = query_flag(request, "force")
    desired = (await _desired(ctx)).slots.get(name)
    if desired is None:
        raise SlotNotFound(name)
    if ctx.stack_dir is not None and desired.stack and desired.stack in ctx.gitops_stacks:
        # GitOps: the stack dir is the source of truth; a delete here would be undone
        # at the next apply (or silently stick until then). Refuse, naming the owner.
        raise SlotOwnedByStack(name, desired.stack, str(ctx.stack_dir), "remove")
    if desired.pinned and not force:
        raise SlotPinned(name, "delete")
    delete_slot_config(ctx.config_dir, name)
    await _wake(ctx, name)
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
    ctx = _ctx(request)
    name = _name(request)
    await _require_declared(ctx, name)
    payload = await read_body(request, dict[str, Any])
    if payload.setdefault("name", name) != name:
        raise InvalidRequest(f"the body names slot {payload['name']!r}, the path {name!r}")
    spec = write_slot_config(ctx.config_dir, payload)
    await _wake(ctx, name)
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
    ctx = _ctx(request)
    name = _name(request)
    await _require_declared(ctx, name)
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
    spec = write_slot_config(ctx.config_dir, patch, merge=True)
    await _wake(ctx, name)
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
        409: ("insufficient memory / pinned peer", None),
        503: ("crash looping", None),
    },
)
async def load_slot(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    name = _name(request)
    if query_flag(request, "dry_run"):
        return json_response({"status": "dry run", "plan": ctx.manager.explain_load(name)})
    status, body = await _start_load(ctx, name)
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
    ctx = _ctx(request)
    name = _name(request)
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
    ctx = _ctx(request)
    name = _name(request)
    body: SwapBody = await read_body(request, SwapBody)
    await _require_declared(ctx, name)
    desired = await _desired(ctx)
    if body.model not in desired.models:
        raise ModelNotFound(body.model)
    previous = desired.slots[name].spec.model_id
    write_slot_config(ctx.config_dir, {"name": name, "model": {"default": body.model}}, merge=True)
    await _wake(ctx, None)
    try:
        view = await ctx.manager.swap(name, body.model)
    except SlotctlError:
        # Refused (memory, breaker, pinned peer): the declared binding goes back, and the
        # reconciler brings the previous model back if the slot is meant to be loaded.
        write_slot_config(
            ctx.config_dir, {"name": name, "model": {"default": previous}}, merge=True
        )
        await _wake(ctx, name)
        raise
    return json_response({"status": "swapped", "slot": slot_out(view)})


@route(
    "POST",
    "/api/slots/{name}/reset",
    summary="clear the crash-loop breaker",
    tag="slots",
    responses={200: ("reset", LoadAnswer), 404: ("unknown", None)},
)
async def reset_slot(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    view = await ctx.manager.reset(_name(request))
    await _wake(ctx, view.name)
    return json_response({"status": "reset", "slot": slot_out(view)})


_MAX_LOG_LINES: Final = 10_000


@route(
    "GET",
    "/api/slots/{name}/logs",
    summary="the last lines the slot's server wrote",
    tag="slots",
    query=[Query("tail", "integer", f"how many lines (default 100, at most {_MAX_LOG_LINES})")],
    responses={200: ("log lines", SlotLogs), 400: ("bad tail", None), 404: ("unknown", None)},
)
async def slot_logs(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    name = _name(request)
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
    ctx = _ctx(request)
    body: HoldBody = await read_body(request, HoldBody)
    lease = await ctx.manager.hold(_name(request), body.ttl_s)
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
    ctx = _ctx(request)
    return json_response({"models": [_model_out(ctx, m) for m in ctx.manager.models.values()]})


@route(
    "GET",
    "/api/models/{model_id:.+}/state",
    summary="one model's state",
    tag="models",
    responses={200: ("state", ModelOut), 404: ("unknown model", None)},
)
async def model_state(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    return json_response(_model_out(ctx, _catalogue_model(ctx, request.match_info["model_id"])))


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
    ctx = _ctx(request)
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
    status, body = await _start_load(ctx, best.name)
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
    ctx = _ctx(request)
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


# ----------------------------------------------------------------------------- stacks


async def _load_stack_body(ctx: ApiContext, request: web.Request) -> tuple[StackBody, Any]:
    body: StackBody = await read_body(request, StackBody)
    settings, _ = read_settings(ctx.config_dir)
    # Parsing (up to 1 MiB per file) runs off the event loop: the API and router answer.
    report = await asyncio.to_thread(load_stack_texts, body.texts(), settings)
    if not report.ok or report.state is None:
        raise SlotConfigError(
            f"invalid stack: {report.errors[0].message}" if report.errors else "invalid stack",
            problems=[p.to_dict() for p in report.errors],
            keys=sorted({p.key for p in report.errors if p.key}),
        )
    return body, report.state


@route(
    "POST",
    "/api/stacks/apply",
    summary="validate, plan and apply a stack (TOML text)",
    tag="stacks",
    body=StackBody,
    responses={200: ("applied (or planned with dry_run)", ApplyAnswer), 400: ("invalid", None)},
)
async def apply_stack(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    body, state = await _load_stack_body(ctx, request)
    lock = ctx.apply_lock
    async with lock:
        prune = bool(body.prune)
        plan = await plan_stack(
            state, ctx.config_dir, ctx.state_dir, ctx.manager.runtime, prune=prune
        )
        changed: list[str] = []
        if not body.dry_run:
            changed = await asyncio.to_thread(
                apply_to_config, state, ctx.config_dir, prune=prune, force=body.force
            )
            await _wake(ctx)
    return json_response(
        {"plan": [a.to_dict() for a in plan.actions], "changed": changed, "dry_run": body.dry_run}
    )


@route(
    "POST",
    "/api/stacks/diff",
    summary="drift between a stack (TOML text) and the host",
    tag="stacks",
    body=StackBody,
    responses={200: ("the diff", DiffAnswer), 400: ("invalid", None)},
)
async def diff_stack(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    body, state = await _load_stack_body(ctx, request)
    prune = True if body.prune is None else body.prune
    plan = await plan_stack(state, ctx.config_dir, ctx.state_dir, ctx.manager.runtime, prune=prune)
    data = plan.to_dict()
    data["json_patch"] = plan.json_patch()
    return json_response(data)
