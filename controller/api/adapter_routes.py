"""``/api/adapters``: the declared LoRA adapters, where each is resident, and the explicit
load and unload (``slotctl adapter list|load|unload``; docs/adapters.md).

The residency itself is the manager's (:mod:`controller.slots.adapters`): a load here is a
request's load without the request (into a ready slot of the base model), an unload
drains the adapter's requests first.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel

from controller.api.app import RouteTable, json_response, read_body
from controller.api.rest import ctx_of
from controller.model.errors import AdapterNotFound, SlotNotReady
from controller.model.lifecycle import DISPATCHABLE_STATES
from controller.slots.manager import SlotManager

__all__ = ["routes"]

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route


class AdapterCommand(BaseModel):
    slot: str | None = None  # None: the best slot (load), every slot holding it (unload)


class AdapterList(BaseModel):
    adapters: list[dict[str, Any]]
    declared: list[dict[str, Any]]


def _listing(manager: SlotManager) -> dict[str, Any]:
    slots = []
    for view in manager.views():
        spec = manager.known(view.name)
        if spec is None or spec.lora_api is None:
            continue
        slots.append(
            {
                "slot": view.name,
                "model": spec.model_id,
                "api": spec.lora_api,
                "max_loras": spec.max_loras or len(spec.adapters),
                "state": view.state.value,
                "resident": manager.lora.resident(view.name),
            }
        )
    declared = [
        {**a.model_dump(mode="json", exclude_none=True), "slots": manager.adapter_slots(a.id)}
        for a in manager.adapters.values()
    ]
    return {"adapters": slots, "declared": declared}


def _declared(manager: SlotManager, adapter: str) -> None:
    if adapter not in manager.adapters:
        raise AdapterNotFound(f"adapter {adapter!r} is not declared", adapter=adapter)


@route(
    "GET",
    "/api/adapters",
    summary="each slot's resident adapters, and the declared ones",
    tag="adapters",
    responses={200: ("adapters", AdapterList)},
)
async def list_adapters(request: web.Request) -> web.Response:
    return json_response(_listing(ctx_of(request).manager))


@route(
    "POST",
    "/api/adapters/{adapter}/load",
    summary="load an adapter into a ready slot of its base model (the best, or `slot`)",
    tag="adapters",
    body=AdapterCommand,
    responses={
        200: ("loaded", AdapterList),
        404: ("unknown adapter", None),
        503: ("no place, or no ready slot", None),
    },
)
async def load_adapter(request: web.Request) -> web.Response:
    manager = ctx_of(request).manager
    adapter = request.match_info["adapter"]
    body: AdapterCommand = await read_body(request, AdapterCommand)
    _declared(manager, adapter)
    slots = [body.slot] if body.slot else manager.adapter_slots(adapter)
    ready = [s for s in slots if manager.view(s).state in DISPATCHABLE_STATES]
    if not ready:
        raise SlotNotReady(
            f"no ready slot can take adapter {adapter!r} (load its base model first)",
            adapter=adapter,
        )
    await manager.lora.load(ready[0], adapter)
    return json_response(_listing(manager))


@route(
    "POST",
    "/api/adapters/{adapter}/unload",
    summary="drain and unload an adapter (from `slot`, else every slot holding it)",
    tag="adapters",
    body=AdapterCommand,
    responses={200: ("unloaded", AdapterList), 404: ("unknown adapter", None)},
)
async def unload_adapter(request: web.Request) -> web.Response:
    manager = ctx_of(request).manager
    adapter = request.match_info["adapter"]
    body: AdapterCommand = await read_body(request, AdapterCommand)
    _declared(manager, adapter)
    slots = [body.slot] if body.slot else manager.adapter_slots(adapter)
    for slot in slots:
        if manager.lora.holds(slot, adapter):
            await manager.lora.unload(slot, adapter)
    return json_response(_listing(manager))
