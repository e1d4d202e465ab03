"""REST routes of stacks: validate, plan and apply a stack, or diff it against the host."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from controller.api.app import (
    ApiContext,
    RouteTable,
    json_response,
    read_body,
)
from controller.api.rest import (
    ctx_of,
    disk_snapshot,
    wake,
)
from controller.model.errors import (
    InvalidRequest,
    SlotConfigError,
)
from controller.reconcile.apply import apply_to_config, plan_stack
from controller.spec.configdir import read_settings
from controller.spec.loader import load_stack_texts

__all__: list[str] = []

log = logging.getLogger("slotctl.api")

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route


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


class ApplyAnswer(BaseModel):
    plan: list[dict[str, Any]]
    changed: list[str]
    dry_run: bool
    aliases_changed: list[str] = Field(default_factory=list)  # "+ id ...", "~ id ...", "- id"
    # without prune: what the stack no longer declares and is kept ("slot x", "model y")
    left_behind: list[str] = Field(default_factory=list)
    adapters_changed: list[str] = Field(default_factory=list)


class DiffAnswer(BaseModel):
    model_config = ConfigDict(extra="allow")

    in_sync: bool
    actions: list[dict[str, Any]]
    config_diffs: dict[str, str]
    drift: dict[str, list[str]]
    notes: dict[str, list[str]] = Field(default_factory=dict)
    orphans: list[str]
    models_changed: list[str]
    models_unused: list[str] = Field(default_factory=list)  # in no stack, used by nothing
    left_behind: list[str] = Field(default_factory=list)  # without prune: slots kept
    aliases_changed: list[str] = Field(default_factory=list)
    adapters_changed: list[str] = Field(default_factory=list)
    json_patch: list[dict[str, Any]]


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
    ctx = ctx_of(request)
    body, state = await _load_stack_body(ctx, request)
    lock = ctx.apply_lock
    async with lock:
        prune = bool(body.prune)
        snapshot = await disk_snapshot(ctx)  # what is planned is what is written over
        plan = await plan_stack(
            state,
            ctx.config_dir,
            ctx.state_dir,
            ctx.manager.runtime,
            prune=prune,
            snapshot=snapshot,
            models_dir=ctx.manager.models_dir,
            rollout=ctx.manager.rollout_for,
        )
        changed: list[str] = []
        if not body.dry_run:
            changed = await asyncio.to_thread(
                apply_to_config,
                state,
                ctx.config_dir,
                prune=prune,
                force=body.force,
                snapshot=snapshot,
            )
            await wake(ctx, *sorted({a.slot for a in plan.actions}), whole=True)
    return json_response(
        {
            "plan": [a.to_dict() for a in plan.actions],
            "aliases_changed": plan.aliases_changed,
            "adapters_changed": plan.adapters_changed,
            "changed": changed,
            "dry_run": body.dry_run,
            "left_behind": plan.kept(prune=prune),
        }
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
    ctx = ctx_of(request)
    body, state = await _load_stack_body(ctx, request)
    prune = True if body.prune is None else body.prune
    plan = await plan_stack(
        state,
        ctx.config_dir,
        ctx.state_dir,
        ctx.manager.runtime,
        prune=prune,
        snapshot=await disk_snapshot(ctx),
        models_dir=ctx.manager.models_dir,
        rollout=ctx.manager.rollout_for,
    )
    data = plan.to_dict()
    data["json_patch"] = plan.json_patch()
    return json_response(data)
