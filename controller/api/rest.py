"""What the REST route modules share: the slot view as JSON, the load answer, the desired
state (the cache's, in memory), waking the reconciler after a config write.

Below the route modules (:mod:`.routes`, :mod:`.model_routes`, :mod:`.stack_routes`), above
the kernel (:mod:`.app`). Handlers are thin: config writes go through the guard, state
changes through the SlotManager, and every write wakes the reconciler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pydantic
from aiohttp import web
from pydantic import BaseModel

from controller.api.app import (
    API_CTX,
    ApiContext,
)
from controller.model.errors import (
    SlotNotFound,
)
from controller.model.lifecycle import SlotState
from controller.slots.records import SlotView
from controller.spec.configdir import ConfigSnapshot, ParseCache
from controller.spec.desired import DesiredCache
from controller.spec.loader import DesiredSlot

__all__ = [
    "LoadAnswer",
    "SlotOut",
    "ctx_of",
    "declared_slot",
    "desired_state",
    "disk_snapshot",
    "name_of",
    "parse_cache",
    "slot_out",
    "start_load",
    "wake",
]

log = logging.getLogger("slotctl.api")


S = SlotState


@pydantic.dataclasses.dataclass(frozen=True)
class SlotOut(SlotView):
    """A slot as JSON: its live view's fields (:class:`~controller.slots.records.SlotView`,
    their one definition: ``slot_out`` is the view as a dict) and, for one declared slot
    (``GET /api/slots/{name}``), its effective spec. For the OpenAPI document only: no
    handler builds one."""

    spec: dict[str, Any] | None = None


class LoadAnswer(BaseModel):
    status: str  # loading | already loaded | unloading | already unloaded | ...
    slot: SlotOut | None = None
    plan: dict[str, Any] | None = None
    cleared: dict[str, list[str]] | None = None  # model unload: residency/failures cleared
    message: str | None = None


def ctx_of(request: web.Request) -> ApiContext:
    return request.app[API_CTX]


def slot_out(view: SlotView) -> dict[str, Any]:
    """The view as JSON (the fields :class:`SlotOut` documents)."""
    data = dataclasses.asdict(view)
    data["state"] = view.state.value
    return data


def name_of(request: web.Request) -> str:
    return request.match_info["name"]


async def start_load(ctx: ApiContext, name: str) -> tuple[int, dict[str, Any]]:
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


async def wake(ctx: ApiContext, *names: str, whole: bool = False) -> None:
    """After a write: the desired-state cache re-reads what was written, in a worker
    thread — the files of ``names``, or with ``whole`` the config dir (a stack apply) —
    and the reconciler's listener queues the slots whose desired state changed; the
    ``names`` are looked at in any case (a reset or a swap changes no config, yet asks for
    a pass)."""
    reconciler = ctx.reconciler
    if reconciler is None:
        return
    await reconciler.refresh_async(None if whole else list(names))
    for name in names:
        reconciler.enqueue(name)


def parse_cache(ctx: ApiContext) -> ParseCache | None:
    """The config dir's parse cache (the desired-state cache's), for the guard's reads:
    an API write at a thousand slots parses one file, not a thousand."""
    return ctx.reconciler.desired.parse_cache if ctx.reconciler is not None else None


async def desired_state(ctx: ApiContext) -> ConfigSnapshot:
    """The desired state as its owner holds it (the reconciler's
    :class:`~controller.spec.desired.DesiredCache`, refreshed by the watcher, the resync
    and every API write: :func:`wake`); without a reconciler (a test's API), a cache of
    the API's own, refreshed off the loop at each look."""
    if ctx.reconciler is not None:
        return ctx.reconciler.snapshot
    return await DesiredCache(ctx.config_dir).refresh_async()


async def disk_snapshot(ctx: ApiContext) -> ConfigSnapshot:
    """The config dir as it is on disk now, read through its owner (the reconciler's
    :class:`~controller.spec.desired.DesiredCache`: ``read_fresh``, published to nobody)
    off the loop: what a stack diff or apply plans against before it writes."""
    desired = ctx.reconciler.desired if ctx.reconciler is not None else None
    return await asyncio.to_thread((desired or DesiredCache(ctx.config_dir)).read_fresh)


async def declared_slot(ctx: ApiContext, name: str) -> DesiredSlot:
    """The slot as the config dir declares it (:class:`SlotNotFound` if it does not)."""
    declared = (await desired_state(ctx)).slots.get(name)
    if declared is None:
        raise SlotNotFound(name)
    return declared
