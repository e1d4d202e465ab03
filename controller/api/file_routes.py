"""REST routes of the models' files: pull ahead of a load, state, remove, GC (issue 35).

``/api/models/{id}/pull`` (``slotctl model pull ID``: a GitOps commit can prefetch what it
declares), ``/api/models/{id}/files`` (``GET`` the files' state: absent, partial, pulling n
%, present, verified; ``DELETE``: ``slotctl model rm``), ``/api/models/files`` (every
model's, with the models dir's free space: ``slotctl model list``) and ``/api/models/gc``
(``slotctl model gc [--dry-run]``). They call the slot manager's ``files`` seam (the
engine, :class:`~controller.modelfiles.pull.ModelFiles`); a controller that manages no model
files (the kubernetes runtime: its pods pull on their nodes) answers ``400``.

A pull asked here runs in the background (``202``): what it would meet first — a file no
source can pull, a pull that does not fit the disk — is answered at once, typed
(``409 model.file_missing``, ``507 model.insufficient_disk``); its progress is ``progress``
events (op ``pull``) and the files' state; its outcome (done, or the typed error) is the
model's ``last_pull``, which ``slotctl model pull --wait`` follows.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web
from pydantic import BaseModel

from controller.access.withheld import sees_secrets, withhold_strings
from controller.api.app import (
    ApiContext,
    CtxKey,
    Query,
    RouteTable,
    json_response,
    principal_of,
    query_flag,
)
from controller.api.rest import ctx_of
from controller.model.errors import InvalidRequest, ModelInUse, ModelNotFound, SlotctlError
from controller.model.events import EventKind, Op
from controller.model.lifecycle import SlotState
from controller.modelfiles.progress import PullProgress, progress_words
from controller.spec.schema import ModelSpec

if TYPE_CHECKING:
    from controller.modelfiles.pull import FileState, ModelFiles

__all__: list[str] = []

log = logging.getLogger("slotctl.api")

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route


class LastPull(BaseModel):
    id: int
    status: str  # pulling | done | failed
    started: float  # wall-clock seconds
    action: str | None = None  # done: pulled | resumed | present | verified
    bytes_pulled: int | None = None
    error: dict[str, Any] | None = None  # failed: the typed error's body


class FilesOut(BaseModel):
    """One model's files: ``state`` is none (nothing to pull: ``demo://``), absent,
    partial (an interrupted pull's bytes), pulling, present or verified."""

    model: str
    source: str
    path: str | None
    state: str
    size_bytes: int
    bytes_total: int | None = None
    percent: float | None = None
    progress: dict[str, Any] | None = None  # pulling: bytes done/total, rate, ETA
    pullable: bool = False
    last_pull: LastPull | None = None


class DiskOut(BaseModel):
    models_dir: str
    free_bytes: int
    margin_bytes: int
    reserved_bytes: int  # promised to pulls in flight


class FilesList(BaseModel):
    models: list[FilesOut]
    disk: DiskOut


class PullAnswer(BaseModel):
    status: str  # pulling | present
    pull: int | None = None  # the id of the pull started (``last_pull.id``)
    message: str  # "would pull 4.1 GB from hf://…", or "files present"
    files: FilesOut


class RemoveAnswer(BaseModel):
    model: str
    freed_bytes: int


class GcEntry(BaseModel):
    path: str
    kind: str  # file | snapshot
    size_bytes: int
    action: str  # remove | keep
    reason: str  # keep: declared: ID, pinned: ID, not needed


class GcAnswer(BaseModel):
    dry_run: bool
    freed_bytes: int
    entries: list[GcEntry]


@dataclass(slots=True)
class Pulls:
    """The pulls asked through the API, by model: the last one's outcome (``last_pull``)."""

    last: dict[str, LastPull] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))


PULLS: Final = CtxKey("model_pulls", Pulls)


def _files(ctx: ApiContext) -> ModelFiles:
    files = ctx.manager.files
    if files is None:
        raise InvalidRequest(
            "this controller manages no model files (on the kubernetes runtime each slot's "
            "pod pulls its model on its node, in an init container)",
            reason="no_model_files",
        )
    return files


def _model(ctx: ApiContext, request: web.Request) -> ModelSpec:
    model_id = request.match_info["model_id"]
    model: ModelSpec | None = ctx.manager.models.get(model_id)
    if model is None:
        raise ModelNotFound(model_id)
    return model


def files_json(state: FileState, last: LastPull | None) -> dict[str, Any]:
    """One model's files as :class:`FilesOut` documents them."""
    progress = state.progress.details() if state.progress is not None else None
    return {
        "model": state.model,
        "source": state.source,
        "path": str(state.path) if state.path is not None else None,
        "state": state.state,
        "size_bytes": state.size_bytes,
        "bytes_total": state.bytes_total,
        "percent": None if state.percent is None else round(state.percent, 1),
        "progress": progress,
        "pullable": _pullable(state.source),
        "last_pull": last.model_dump() if last is not None else None,
    }


def _pullable(source: str) -> bool:
    return source.startswith(("hf://", "http://", "https://"))


async def _state_json(ctx: ApiContext, files: ModelFiles, model: ModelSpec) -> dict[str, Any]:
    pulls = ctx.store.setdefault(PULLS, Pulls)
    return files_json(await files.state(model), pulls.last.get(model.id))


@route(
    "GET",
    "/api/models/files",
    summary="every catalogue model's files (state, size, pull progress) and the disk",
    tag="models",
    responses={200: ("files", FilesList), 400: ("no model files here", None)},
)
async def list_files(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    files = _files(ctx)
    models = list(ctx.manager.models.values())
    out = [await _state_json(ctx, files, m) for m in models]
    if not sees_secrets(principal_of(request)):  # a source URL's credentials
        out = [withhold_strings(m) for m in out]
    disk = {
        "models_dir": str(files.models_dir),
        "free_bytes": await asyncio.to_thread(files.admission.free),
        "margin_bytes": files.admission.margin_bytes,
        "reserved_bytes": files.admission.reserved(),
    }
    return json_response({"models": out, "disk": disk})


@route(
    "GET",
    "/api/models/{model_id:.+}/files",
    summary="one model's files: absent, partial, pulling (progress), present, verified",
    tag="models",
    responses={
        200: ("files", FilesOut),
        400: ("no model files here", None),
        404: ("unknown", None),
    },
)
async def model_files(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    files = _files(ctx)
    out = await _state_json(ctx, files, _model(ctx, request))
    if not sees_secrets(principal_of(request)):  # a source URL's credentials
        out = withhold_strings(out)
    return json_response(out)


@route(
    "POST",
    "/api/models/{model_id:.+}/pull",
    summary="pull a model's files ahead of any load (202 pulling, 200 present)",
    tag="models",
    query=[Query("refresh", "boolean", "ask the hub or URL whether present files are current")],
    responses={
        200: ("present", PullAnswer),
        202: ("pulling", PullAnswer),
        400: ("no model files here", None),
        404: ("unknown model", None),
        409: ("a missing file no source can pull", None),
        507: ("the pull does not fit the models dir", None),
    },
)
async def pull_model(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    files = _files(ctx)
    model = _model(ctx, request)
    refresh = query_flag(request, "refresh")
    if not refresh and not files.needs_pull(model):
        body: dict[str, Any] = {
            "status": "present",
            "message": "files present",
            "files": await _state_json(ctx, files, model),
        }
        return json_response(body)
    plan = await files.plan(model)
    refusal = await files.refusal(plan)
    if refusal is not None:
        raise refusal
    pulls = ctx.store.setdefault(PULLS, Pulls)
    pull_id = next(pulls.ids)
    pulls.last[model.id] = LastPull(id=pull_id, status="pulling", started=time.time())
    ctx.tasks.spawn(_pull(ctx, files, model, pull_id, refresh), f"pull:{model.id}")
    await asyncio.sleep(0)  # started: its state says pulling
    body = {
        "status": "pulling",
        "pull": pull_id,
        "message": plan.message,
        "files": await _state_json(ctx, files, model),
    }
    return json_response(body, status=202)


async def _pull(
    ctx: ApiContext, files: ModelFiles, model: ModelSpec, pull_id: int, refresh: bool
) -> None:
    """One pull asked through the API: its progress as events, its outcome as
    ``last_pull`` (a failure is said there and in an error event, never raised)."""
    pulls = ctx.store.setdefault(PULLS, Pulls)
    started = pulls.last[model.id].started

    def progressed(progress: PullProgress) -> None:
        ctx.events.emit(
            EventKind.PROGRESS,
            Op.PULL,
            model=model.id,
            message=progress_words(progress),
            details=progress.details(),
        )

    try:
        outcome = await files.ensure(model, on_progress=progressed, refresh=refresh)
    except SlotctlError as exc:
        pulls.last[model.id] = LastPull(
            id=pull_id, status="failed", started=started, error=exc.to_dict()["error"]
        )
        ctx.events.emit(
            EventKind.ERROR, Op.PULL, model=model.id, message=exc.message, error=exc.code
        )
        return
    pulls.last[model.id] = LastPull(
        id=pull_id,
        status="done",
        started=started,
        action=outcome.action,
        bytes_pulled=outcome.bytes_pulled,
    )


@route(
    "DELETE",
    "/api/models/{model_id:.+}/files",
    summary="remove a model's pulled files (refused while a slot serves or loads it)",
    tag="models",
    responses={
        200: ("removed", RemoveAnswer),
        400: ("a local path, a pull in flight, or no model files here", None),
        404: ("unknown model", None),
        409: ("in use by a slot", None),
    },
)
async def remove_files(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    files = _files(ctx)
    model = _model(ctx, request)
    busy = [
        v.name
        for v in ctx.manager.views()
        if v.model_id == model.id and v.state not in (SlotState.OFFLINE, SlotState.ERROR)
    ]
    if busy:
        raise ModelInUse(model.id, busy)
    freed = await files.remove(model)
    ctx.store.setdefault(PULLS, Pulls).last.pop(model.id, None)
    return json_response({"model": model.id, "freed_bytes": freed})


@route(
    "POST",
    "/api/models/gc",
    summary="remove model files no declared model references, oldest first (never pinned)",
    tag="models",
    query=[Query("dry_run", "boolean", "list what would go, remove nothing")],
    responses={200: ("the GC's plan (and what it removed)", GcAnswer), 400: ("no files", None)},
)
async def gc_files(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    files = _files(ctx)
    dry_run = query_flag(request, "dry_run")
    plan = await files.gc(ctx.manager.file_references(), dry_run=dry_run)
    entries: list[dict[str, Any]] = [
        {
            "path": str(e.path),
            "kind": e.kind,
            "size_bytes": e.size,
            "action": "remove",
            "reason": "not declared",
        }
        for e in plan.remove
    ]
    entries += [
        {"path": str(e.path), "kind": e.kind, "size_bytes": e.size, "action": "keep", "reason": why}
        for e, why in plan.kept
    ]
    return json_response({"dry_run": dry_run, "freed_bytes": plan.freed_bytes, "entries": entries})
