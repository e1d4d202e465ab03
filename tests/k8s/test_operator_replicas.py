"""A Slot with replicas against KMock (real kopf, the real controller core, the process
runtime, real demo servers): its status sums up its replicas — how many are wanted, run
and are ready, and each one's state — and a replica's change shows in its Slot's status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.model.lifecycle import SlotState
from controller.operator.status import Observed, Verdict, replicas_status, slot_status
from tests.integration.helpers import free_ports
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.test_operator import model, running_operator, slot, state  # noqa: F401

pytestmark = pytest.mark.timeout(180)


async def _replicas(
    cluster: Cluster, name: str, ready: int, second: str | None = None
) -> dict[str, Any] | None:
    """The Slot's replica summary once ``ready`` replicas are (and its second replica's
    state is ``second``, when given)."""
    obj = await cluster.get("slots", name)
    summed = ((obj or {}).get("status") or {}).get("replicas")
    if summed is None or summed["ready"] != ready:
        return None
    return summed if second is None or summed["items"][1]["state"] == second else None


async def test_a_slots_status_sums_up_its_replicas(
    cluster: Cluster,
    state: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (port,) = free_ports(1)
    async with running_operator(cluster, state, monkeypatch) as op:
        await cluster.create(model("m-chat"))
        spec = {"min_replicas": 1, "max_replicas": 2, "max_concurrency": 4}
        await cluster.create(slot("chat", "m-chat", port, scale_down_after_s=600, **spec))
        summed = await eventually(
            lambda: _replicas(cluster, "chat", 1, "offline"), "the first replica"
        )
        assert (summed["min"], summed["max"], summed["running"]) == (1, 2, 1)
        first, second = summed["items"]
        assert (first["name"], first["index"], first["state"], first["ready"]) == (
            "chat",
            0,
            "ready",
            True,
        )
        assert (second["name"], second["index"], second["ready"]) == ("chat-r1", 1, False)
        assert second["state"] == "offline"

        # the second replica loaded: its events wake the Slot's status, both show
        manager = op.controller.manager
        assert manager is not None
        await manager.load("chat-r1")
        summed = await eventually(lambda: _replicas(cluster, "chat", 2), "both replicas ready")
        assert summed["running"] == 2
        endpoints = [i["endpoint"] for i in summed["items"]]
        assert all(endpoints) and endpoints[0] != endpoints[1]

        # unloaded by hand: the Slot's status says so
        await manager.unload("chat-r1")
        summed = await eventually(
            lambda: _replicas(cluster, "chat", 1, "offline"), "one replica again"
        )
        assert summed["running"] == 1 and summed["items"][1]["state"] == "offline"

        # a Slot without replicas has no summary
        (other,) = free_ports(1)
        await cluster.create(slot("solo", "m-chat", other))
        solo = await eventually(lambda: _ready_status(cluster, "solo"), "solo ready")
        assert "replicas" not in solo


async def _ready_status(cluster: Cluster, name: str) -> dict[str, Any] | None:
    obj = await cluster.get("slots", name)
    status = (obj or {}).get("status") or {}
    return status if status.get("state") == "ready" else None


def test_replicas_status_counts_running_and_ready() -> None:
    members = [
        ("chat-r2", 2, None),  # not known to the controller yet
        ("chat", 0, Observed(SlotState.READY, endpoint="http://a", dispatchable=True)),
        ("chat-r1", 1, Observed(SlotState.STARTING, node="n1")),
    ]
    summed = replicas_status(1, 3, members)
    assert (summed["min"], summed["max"], summed["running"], summed["ready"]) == (1, 3, 2, 1)
    assert [(i["name"], i["state"], i["ready"]) for i in summed["items"]] == [
        ("chat", "ready", True),
        ("chat-r1", "starting", False),
        ("chat-r2", "pending", False),
    ]
    assert summed["items"][1]["node"] == "n1" and "node" not in summed["items"][0]
    status = slot_status(None, Verdict(accepted=True), None, replicas=summed)
    assert status["replicas"] == summed
    assert "replicas" not in slot_status(None, Verdict(accepted=True), None)
