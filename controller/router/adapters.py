"""LoRA adapters in the routed call: which adapter a request's ``model`` names, the slots
that may serve it, the body its server must see, and the ``/v1/models`` entries.

A request names an adapter by its id, or as ``base:adapter`` (SGLang's spelling); a
catalogue model's or an alias' id wins over an adapter's. Its candidates are the slots of
the base model that can serve it, those already holding it first (Ray Serve's rule: a
request goes where its adapter is, unless that slot cannot take it now; the lease tries
them in order). The call then holds the adapter in the leased slot
(:meth:`~controller.slots.manager.SlotManager.acquire_adapter`): a load it waits for, or
a typed refusal — never the base model's answer, nor another adapter's.

:func:`adapter_body` is the request as each engine wants it (docs/adapters.md): vLLM
names the adapter in ``model``; SGLang ``base:adapter``; llama.cpp's server the base model
with ``lora: [{"id": N, "scale": S}]`` (the adapters not named run at scale 0);
llama-cpp-python's server (one adapter, always applied) the base model.
"""

from __future__ import annotations

import json
from typing import Any

from controller.access.keys import Principal
from controller.model.errors import AdapterNotFound
from controller.router.selection import openai_model
from controller.slots.interfaces import RouterPort
from controller.slots.records import AdapterHold
from controller.spec.schema import AdapterSpec

__all__ = ["adapter_body", "adapter_entries", "named_adapter"]


def named_adapter(manager: RouterPort, model: str) -> AdapterSpec | None:
    """The adapter ``model`` names (its id, or ``base:id``); None: it names none. Raises
    :class:`AdapterNotFound` for ``base:x`` of a catalogue base with no adapter ``x``."""
    adapters = manager.adapters
    if not adapters:
        return None
    found = adapters.get(model)
    if found is not None:
        return found
    base, sep, name = model.rpartition(":")
    if not sep or base not in manager.models:
        return None
    found = adapters.get(name)
    if found is None or found.base != base:
        raise AdapterNotFound(f"model {base!r} has no adapter {name!r}", adapter=name, model=base)
    return found


def adapter_body(body: bytes, hold: AdapterHold, base: str) -> bytes:
    """The JSON body ``body`` as the server of ``hold``'s slot must see it (see the
    module docstring)."""
    data: dict[str, Any] = json.loads(body)
    if hold.api == "vllm":
        data["model"] = hold.adapter
    elif hold.api == "sglang":
        data["model"] = f"{base}:{hold.adapter}"
    elif hold.api == "llamacpp":
        data["model"] = base
        data["lora"] = [{"id": hold.index, "scale": hold.scale}]
    else:  # llama-cpp-python: the server applies its one adapter to every request
        data["model"] = base
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def adapter_entries(
    manager: RouterPort, served: dict[str, str], principal: Principal | None = None
) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the adapters whose base is served (``served``: model ->
    kind) and that a slot can serve, with ``parent`` (the base) as vLLM lists them."""
    out = []
    for adapter in manager.adapters.values():
        if adapter.base not in served or adapter.id in served:
            continue
        if principal is not None and not principal.may_use(adapter.id):
            continue
        if not manager.adapter_slots(adapter.id):
            continue
        entry = openai_model(adapter.id, served[adapter.base])
        entry.update(parent=adapter.base, adapter=True)
        out.append(entry)
    return out
