"""The operator's status writes against KMock when kopf's view of a Slot lags behind the API
server (a loaded API server or a busy operator: the watch event of a status patch is
processed seconds after the patch): an unchanged status is not written again, a ``Ready``
condition that stays ``True`` keeps its ``lastTransitionTime``, and a settled cluster
sends no writes.

The lag is made by delaying kopf's processing of every Slot watch event (the live body a
status timer reads is replaced there), as a loaded machine delays it: the 200-Slot run of
``bench/k8s_scale.py`` re-wrote ``state: ready`` and a new ``lastTransitionTime`` up to a
dozen times a Slot.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kopf._core.reactor import processing

from tests.integration.helpers import free_ports
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.test_operator import model, ready, running_operator, slot, state  # noqa: F401

pytestmark = pytest.mark.timeout(180)
LAG_S = 2.0  # under the operator's 5 s status resync


def status_patches(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    """The bodies of the operator's status patches of Slot ``name``, in order."""
    out = []
    for request in cluster.emulator._requests:
        resource = request.resource
        if resource is None or resource.plural != "slots" or request.name != name:
            continue
        method = str(getattr(request.method, "value", request.method)).upper()
        if method == "PATCH" and request.subresource == "status" and isinstance(request.data, dict):
            out.append(request.data.get("status") or {})
    return out


def lag_slot_events(monkeypatch: pytest.MonkeyPatch) -> None:
    real = processing.process_resource_event

    async def late(*args: Any, **kwargs: Any) -> Any:
        if kwargs["resource"].plural == "slots":
            await asyncio.sleep(LAG_S)
        return await real(*args, **kwargs)

    monkeypatch.setattr(processing, "process_resource_event", late)


async def test_a_lagging_view_rewrites_no_unchanged_status(
    cluster: Cluster,
    state: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lag_slot_events(monkeypatch)
    names = ["a", "b", "c", "d"]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    async with running_operator(cluster, state, monkeypatch):
        await cluster.create(model("m"))
        for name in names[:3]:
            await cluster.create(slot(name, "m", ports[name]))
        await eventually(lambda: ready(cluster, "a"), "a Ready")
        # while kopf still holds a's older status: another slot's transitions wake a's timer
        await cluster.create(slot("d", "m", ports["d"]))
        for name in names:
            await eventually(lambda name=name: ready(cluster, name), f"{name} Ready")
        await asyncio.sleep(3 * LAG_S)  # every lagging event processed
        settled = {name: len(status_patches(cluster, name)) for name in names}
        await asyncio.sleep(6.0)  # over a status resync period (5 s)
        for name in names:
            patches = status_patches(cluster, name)
            assert len(patches) == settled[name], f"{name}: written while settled"
            states = [p["state"] for p in patches if "state" in p]
            repeats = [s for s, before in zip(states[1:], states, strict=False) if s == before]
            assert not repeats, f"{name}: state re-written unchanged: {patches}"
            since = {
                c["lastTransitionTime"]
                for p in patches
                for c in p.get("conditions") or []
                if c["type"] == "Ready" and c["status"] == "True"
            }
            assert len(since) == 1, f"{name}: Ready's lastTransitionTime moved: {sorted(since)}"
