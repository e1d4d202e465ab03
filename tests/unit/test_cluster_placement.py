"""Placement across a cluster's nodes, per (node, GPU): the slot manager with a fake
cluster probe (:class:`controller.scheduling.nodes.NodeGpus` as the kubernetes runtime reads them)
over a FakeRuntime of kind ``kubernetes``, and the pure pieces under it
(:mod:`controller.scheduling.cluster`, :mod:`controller.runtime.kubernetes.nodes`).

The controller decides the node: unpinned slots go to nodes whose free GPUs and per-GPU
memory fit them, at once (not one after another against one shared budget), a node
without GPU feature discovery's memory label is used by GPU count, GPUs other pods hold,
and nodes that are not ready, cordoned or tainted, are never chosen; evictions happen on
the chosen node only; a node the scheduler left the pod Pending on is avoided for a while.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from lightkube.resources.core_v1 import Node, Pod

from controller.api.dryrun import plan_json
from controller.kit.clock import FakeClock
from controller.model.errors import DeviceUnavailable, InsufficientMemory
from controller.model.events import EventKind
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.runtime.fake import FakeProber, FakeRuntime, FakeSleeper
from controller.runtime.kubernetes.nodes import node_gpus, pod_gpus, unusable
from controller.scheduling.cluster import Held, by_count, cluster_devices
from controller.scheduling.fit import DeviceMemory
from controller.scheduling.nodes import ClusterProbe, NodeGpus
from controller.scheduling.placement import Need, place
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.unit.manager_fixtures import desired, events_of, model_spec, settle, slot_spec

S = SlotState


class ClusterRuntime(FakeRuntime):
    kind = "kubernetes"


class FakeCluster:
    """A cluster probe over a list of nodes the test edits."""

    def __init__(self, nodes: Sequence[NodeGpus]) -> None:
        self.nodes = list(nodes)

    def cluster(self) -> tuple[NodeGpus, ...]:
        return tuple(self.nodes)

    def sample(self, device: str) -> DeviceMemory | None:
        return None

    def gpus(self) -> tuple[DeviceMemory, ...]:
        return ()


def node(name: str, gpus: int = 1, gib: int | None = 16, **kw: Any) -> NodeGpus:
    return NodeGpus(
        name=name,
        resource="nvidia.com/gpu",
        allocatable=kw.pop("allocatable", gpus),
        physical=gpus,
        per_gpu=gib * GIB if gib is not None else None,
        **kw,
    )


class Cluster:
    def __init__(self, tmp: Path, nodes: Sequence[NodeGpus], margin_gb: float = 0.0) -> None:
        self.clock = FakeClock(start=100.0)
        self.runtime = ClusterRuntime(self.clock)
        self.probe = FakeCluster(nodes)
        self.tmp, self.margin_gb = tmp, margin_gb
        self.manager = self.new_manager()

    def new_manager(self) -> SlotManager:
        """A manager over this cluster (a restarted controller: the same runtime)."""
        return SlotManager(
            runtime=self.runtime,
            state_dir=self.tmp / "state",
            config_dir=self.tmp / "config",
            settings=ControllerSettings(safety_margin_gb=self.margin_gb, min_resident_s=0),
            prober=FakeProber(self.runtime),
            memory=self.probe,
            clock=self.clock,
            config=ManagerConfig(stop_timeout_s=1.0),
            sleeper=FakeSleeper(self.runtime),
        )

    async def declare(self, slots: list[SlotSpec], models: list[ModelSpec]) -> None:
        await self.manager.set_desired(desired(slots, models))

    def node_of(self, name: str) -> str | None:
        return self.manager.view(name).node


def cslot(name: str, model: str, **kw: Any) -> SlotSpec:
    return slot_spec(name, model, server={"image": "slotctl:test"}, **kw)


def test_the_fake_is_a_cluster_probe() -> None:
    assert isinstance(FakeCluster([]), ClusterProbe)


async def test_unpinned_slots_on_free_gpus_are_admitted_at_once(tmp_path: Path) -> None:
    """The issue's case: N unpinned slots on N free one-GPU nodes are admitted side by
    side, each on its own node, none refused while another's pod has yet to land (they
    were, against one shared budget the size of the largest node)."""
    cluster = Cluster(tmp_path, [node("a"), node("b"), node("c")], margin_gb=0.5)
    slots = [cslot(n, "m10") for n in ("s1", "s2", "s3")]
    await cluster.declare(slots, [model_spec("m10", 10)])
    m = cluster.manager
    with m.events.subscribe() as sub:
        views = await asyncio.gather(*(m.start_load(s.name) for s in slots))
        await settle(m)
        seen = events_of(sub)
    assert all(v.state is not S.OFFLINE for v in views)
    assert {cluster.node_of(s.name) for s in slots} == {"a", "b", "c"}
    assert not [e for e in seen if e.kind == EventKind.REFUSAL]
    for s in slots:
        (gpu,) = cluster.runtime.objects[s.name].launch.visible  # the runtime pins it there
        assert gpu.node == cluster.node_of(s.name) and gpu.key == f"{gpu.node}/gpu:0"
    assert m.admitted_bytes("a/gpu") == 10 * GIB  # a node's GPUs, summed
    record = m.store.read("s1")
    assert record is not None and record.extra.gpus[0].node == cluster.node_of("s1")
    # a fourth fits nowhere: kept loaded in the background, it waits (it evicts no peer
    # of its priority), with each node's figures; nothing started for it
    await cluster.declare([*slots, cslot("s4", "m10")], [model_spec("m10", 10)])
    with pytest.raises(InsufficientMemory, match=r"whole GPU.*a: 0 of 1 free"):
        await m.load("s4", background=True)
    assert "s4" not in cluster.runtime.objects and m.view("s4").waiting == "waiting_for_memory"


async def test_a_node_without_gfd_labels_admits_by_gpu_count_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``nvidia.com/gpu: 2`` and no ``nvidia.com/gpu.memory`` label (the device plugin
    alone), no ``memory_budget_gb.gpu``: a slot per GPU, memory not checked, said once;
    a node whose memory is known is preferred."""
    cluster = Cluster(tmp_path, [node("plain", gpus=2, gib=None)])
    slots = [cslot(n, "m40") for n in ("a", "b", "c")]
    await cluster.declare(slots, [model_spec("m40", 40)])
    m = cluster.manager
    with caplog.at_level(logging.WARNING, logger="slotctl.manager"):
        await m.load("a")
        await m.load("b")
        with pytest.raises(InsufficientMemory, match="whole GPU"):
            await m.load("c", background=True)
    assert {m.view(n).devices for n in ("a", "b")} == {("plain/gpu:0",), ("plain/gpu:1",)}
    said = [r for r in caplog.records if "admitted there by GPU count" in r.getMessage()]
    assert len(said) == 1 and "plain" in said[0].getMessage()
    # GPUs of known memory first, by count last
    cluster.probe.nodes.append(node("gfd", gib=48))
    await m.unload("a")
    await m.load("c")
    assert cluster.node_of("c") == "gfd"
    # the controller's per-GPU setting stands in for the label
    assert (
        by_count(cluster.probe.nodes, None) == ["plain"] and by_count(cluster.probe.nodes, 1) == []
    )


async def test_gpus_other_pods_request_and_unusable_nodes_are_never_chosen(
    tmp_path: Path,
) -> None:
    nodes = [
        node("busy", gpus=2, others=2),  # every GPU requested by pods slotctl does not manage
        node("down", unusable="NotReady (NodeStatusUnknown)"),
        node("cordoned", unusable="cordoned (spec.unschedulable)"),
        node("free", gpus=2, others=1),
    ]
    cluster = Cluster(tmp_path, nodes)
    slots = [cslot(n, "m4") for n in ("a", "b")]
    await cluster.declare(slots, [model_spec("m4", 4)])
    await cluster.manager.load("a")
    assert cluster.manager.view("a").devices == ("free/gpu:0",)  # gpu:1: the other pod's
    with pytest.raises(InsufficientMemory, match="free: 0 of 1 free"):  # a user load evicts a
        await cluster.manager.load("b", background=True)
    await cluster.manager.unload("a")
    cluster.probe.nodes[-1] = node("free", gpus=2, others=2)  # the other pod takes both now
    with pytest.raises(DeviceUnavailable) as err:
        await cluster.manager.load("b")
    message = err.value.message
    assert (
        "busy: 0 of 2 (requested by other pods" in message and "down: 0 of 1 (NotReady" in message
    )
    assert "cordoned" in message


async def test_a_slot_spanning_gpus_gets_them_on_one_node(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, [node("one-a"), node("one-b"), node("four", gpus=4)])
    await cluster.declare([cslot("tp", "m30", gpus=2)], [model_spec("m30", 30)])
    await cluster.manager.load("tp")
    assert cluster.manager.view("tp").devices == ("four/gpu:0", "four/gpu:1")
    assert cluster.manager.admitted_bytes("four/gpu:1") == 15 * GIB


async def test_an_eviction_clears_a_whole_gpu_on_the_chosen_node_only(tmp_path: Path) -> None:
    """One slot per GPU (no time-slicing): a load that needs a GPU evicts the slot holding
    one (lowest priority first), on that node only, even if that slot has no memory
    estimate; a higher-priority holder is never evicted for it."""
    cluster = Cluster(tmp_path, [node("a"), node("b")])
    slots = [
        cslot("low", "m0", priority=10),  # no memory estimate at all
        cslot("high", "m8", priority=90),
        cslot("new", "m8", priority=50),
    ]
    await cluster.declare(slots, [ModelSpec(id="m0", source="demo://m0"), model_spec("m8", 8)])
    m = cluster.manager
    await m.load("low")
    await m.load("high")
    assert {cluster.node_of("low"), cluster.node_of("high")} == {"a", "b"}
    where = cluster.node_of("low")
    await m.load("new")
    await settle(m)
    assert m.view("low").state is S.OFFLINE and m.view("high").state is S.READY
    assert cluster.node_of("new") == where
    # kept loaded in the background, low waits: high (90) and new (50) are above it
    assert not m.decide("low", background=True).ok


async def test_a_time_sliced_gpu_is_shared_by_memory_and_needs_a_free_replica(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path, [node("sliced", gpus=1, gib=16, allocatable=2)])
    slots = [cslot(n, "m5") for n in ("a", "b", "c")]
    await cluster.declare(slots, [model_spec("m5", 5)])
    m = cluster.manager
    await m.load("a")
    await m.load("b")
    assert m.admitted_bytes("sliced/gpu:0") == 10 * GIB  # 5 + 5 of 16 on the one GPU
    with pytest.raises(DeviceUnavailable, match=r"no free nvidia.com/gpu replica \(2 allocatable"):
        await m.load("c")  # 6 GiB are left, but both replicas are taken


async def test_a_node_the_scheduler_left_the_pod_pending_on_is_avoided(tmp_path: Path) -> None:
    """The runtime's start fails naming the node (its pod stayed unschedulable there):
    the next load goes to another node, and the node is tried again after a while."""
    cluster = Cluster(tmp_path, [node("a"), node("b")])
    await cluster.declare([cslot("chat", "m4")], [model_spec("m4", 4)])
    m = cluster.manager
    real_start = cluster.runtime.start
    tried: list[str | None] = []

    async def start(launch: Any) -> Any:
        node_name = launch.visible[0].node
        tried.append(node_name)
        if node_name == "a":
            from controller.model.errors import SlotSpawnFailed

            raise SlotSpawnFailed(
                "pod stayed unschedulable", slot="chat", node="a", unschedulable="Too many pods"
            )
        return await real_start(launch)

    cluster.runtime.start = start  # type: ignore[method-assign]
    with pytest.raises(Exception, match="unschedulable"):
        await m.load("chat")
    cluster.clock.advance(2.0)  # the crash-loop breaker's backoff
    await m.load("chat")
    assert tried == ["a", "b"] and cluster.node_of("chat") == "b"
    explained = plan_json(m.explain_load("chat"))
    assert explained["action"] == "none"
    record = m.core.table.get("chat")
    assert "Too many pods" in record.flight.avoided(cluster.clock.monotonic())["a"]


def test_cluster_devices_per_node() -> None:
    nodes = [
        node("sliced", gpus=2, gib=24, allocatable=8),
        node("whole", gpus=2, gib=None, others=1),
    ]
    held = Held(
        bytes={"sliced/gpu:0": (6 * GIB, 0)},
        peers={},
        holders={"sliced/gpu:0": 1},
        units={"sliced": {"x": 1}},
    )
    devices = cluster_devices(nodes, held, span=1, margin=GIB)
    by_key = {d.key: d for d in devices}
    assert list(by_key) == ["sliced/gpu:0", "sliced/gpu:1", "whole/gpu:0", "whole/gpu:1"]
    assert not by_key["sliced/gpu:0"].exclusive and by_key["sliced/gpu:0"].admitted == 6 * GIB
    assert by_key["sliced/gpu:0"].budget == 24 * GIB and by_key["sliced/gpu:0"].group == "sliced"
    assert by_key["whole/gpu:0"].exclusive and by_key["whole/gpu:0"].budget is None
    assert by_key["whole/gpu:1"].lost and by_key["whole/gpu:0"].lost is None  # the other pod's
    # pinned to a node: only its GPUs; avoided: all of its GPUs unusable, with why
    pinned = cluster_devices(nodes, held, span=1, margin=GIB, node="whole", avoid={"whole": "no"})
    assert [d.key for d in pinned] == ["whole/gpu:0", "whole/gpu:1"]
    assert all(d.lost == "no" for d in pinned)
    placed = place(Need("y", 20 * GIB), devices, lambda: (), 0.0)
    assert placed.devices == ("sliced/gpu:1",)  # gpu:0 has 18 GiB left: too little


# ---------------------------------------------------------------------- from the API objects


def _node(**status: Any) -> Node:
    body: dict[str, Any] = {
        "metadata": {"name": "n", "labels": {"nvidia.com/gpu.memory": "16384"}},
        "spec": status.pop("spec", {}),
        "status": {
            "allocatable": {"nvidia.com/gpu": "2"},
            "conditions": [{"type": "Ready", "status": status.pop("ready", "True")}],
        },
    }
    return Node.from_dict(body)


def _pod(name: str, gpus: int, namespace: str = "ml", **extra: Any) -> Pod:
    labels = extra.pop("labels", {})
    body = {
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "nodeName": "n",
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
            **extra.pop("spec", {}),
        },
        "status": extra.pop("status", {"phase": "Running"}),
    }
    return Pod.from_dict(body)


def test_node_gpus_counts_every_pod_bound_to_the_node() -> None:
    ours = _pod("slotctl-chat-x", 1, labels={"slotctl.managed": "true", "slotctl.slot": "chat"})
    other = _pod("train", 1, namespace="research")
    done = _pod("batch", 1, status={"phase": "Succeeded"})
    init = _pod(
        "init",
        0,
        spec={
            "initContainers": [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": "2"}}}]
        },
    )

    def slot_of(pod: Pod) -> str | None:
        labels = (pod.metadata.labels if pod.metadata else None) or {}
        return (
            labels.get("slotctl.slot") if pod.metadata and pod.metadata.namespace == "ml" else None
        )

    gpus = node_gpus(_node(), [ours, other, done, init], slot_of)
    assert gpus is not None
    assert (gpus.allocatable, gpus.physical, gpus.per_gpu) == (2, 2, 16 * GIB)
    assert gpus.pods == {"chat": 1} and gpus.others == 3  # train 1 + init's 2; batch is done
    assert pod_gpus(init, "nvidia.com/gpu") == 2 and pod_gpus(other, "amd.com/gpu") == 0
    assert (
        node_gpus(Node.from_dict({"metadata": {"name": "cpu"}, "status": {}}), [], slot_of) is None
    )


def test_which_nodes_a_slot_may_go_to() -> None:
    assert unusable(_node()) is None
    assert unusable(_node(ready="Unknown")) == "NotReady"
    assert unusable(_node(spec={"unschedulable": True})) == "cordoned (spec.unschedulable)"
    tainted = _node(
        spec={"taints": [{"key": "dedicated", "value": "infra", "effect": "NoSchedule"}]}
    )
    assert unusable(tainted) == "tainted dedicated=infra:NoSchedule (not tolerated)"
    gpu_taint = _node(spec={"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]})
    assert unusable(gpu_taint) is None  # the slot's pod tolerates its GPU resource's taint
    soft = _node(spec={"taints": [{"key": "x", "effect": "PreferNoSchedule"}]})
    assert unusable(soft) is None


async def test_a_slot_s_own_pod_never_counts_against_its_load(tmp_path: Path) -> None:
    """A slot in error whose Deployment runs a pod again (a user's ``kubectl scale
    --replicas=0`` put back by the drift repair while the slot failed): its load goes to
    that GPU (its start adopts or replaces its own pod: strategy Recreate). Another slot's
    stray pod still holds the GPU for every other load."""
    cluster = Cluster(tmp_path, [node("a", pods={"chat": 1})])
    await cluster.declare([cslot("chat", "m4"), cslot("other", "m4")], [model_spec("m4", 4)])
    with pytest.raises(DeviceUnavailable, match="requested by other pods"):
        await cluster.manager.load("other")
    await cluster.manager.load("chat")
    assert cluster.manager.view("chat").devices == ("a/gpu:0",)


async def test_a_sleeper_holds_its_whole_gpu_and_is_unloaded_to_clear_it(tmp_path: Path) -> None:
    """A sleeping pod still holds its GPU (one pod per GPU, no time-slicing): it counts as
    the GPU's holder, and a load that needs that GPU unloads it — nobody is put to sleep to
    clear a whole GPU (issue 22's tier on issue 28's placement). Before, the sleeper (its
    memory counted on its node's host key) was no candidate there: the GPU stayed blocked."""
    cluster = Cluster(tmp_path, [node("a")])
    slots = [cslot("low", "m4", sleep=True, priority=10), cslot("high", "m4b", priority=90)]
    models = [model_spec("m4", 4), model_spec("m4b", 4)]
    await cluster.declare(slots, models)
    await cluster.manager.load("low")
    cluster.runtime.sleeping["low"] = 1  # its server sleeps (a previous controller's doing)
    await cluster.manager.core.table.close()
    m = cluster.manager = cluster.new_manager()
    await cluster.declare(slots, models)
    await m.recover()
    view = m.view("low")
    assert view.residency == "asleep" and view.devices == ("a/cpu",)  # its weights there
    assert m.admitted_bytes("a/gpu") == 0  # no memory on the GPU, but the pod holds it
    plan = plan_json(m.explain_load("high"))
    assert [(v["slot"], v["action"]) for v in plan["evict"]] == [("low", "unload")], plan
    await m.load("high")
    assert m.view("low").state is S.OFFLINE and "low" not in cluster.runtime.sleeping
    assert m.view("high").devices == ("a/gpu:0",)


async def test_a_wake_on_a_cluster_makes_room_where_its_pod_sleeps(tmp_path: Path) -> None:
    """A sleeper wakes on the GPU its pod sleeps on: room is made there (a time-sliced
    node's memory), not judged on another node's free GPU while it wakes on its own."""
    sliced = {"gpus": 1, "gib": 16, "allocatable": 4}
    cluster = Cluster(tmp_path, [node("a", **sliced), node("b", **sliced)])
    slots = [cslot("low", "m8", sleep=True), cslot("mid", "m12")]
    models = [model_spec("m8", 8), model_spec("m12", 12)]
    await cluster.declare(slots, models)
    await cluster.manager.load("low")
    assert cluster.node_of("low") == "a"
    cluster.runtime.sleeping["low"] = 1  # its server sleeps (a previous controller's doing)
    await cluster.manager.core.table.close()
    m = cluster.manager = cluster.new_manager()
    await cluster.declare(slots, models)
    await m.recover()
    assert m.view("low").residency == "asleep"
    await m.load("mid")  # a's GPU memory is free while low sleeps: mid goes there
    assert cluster.node_of("mid") == "a"
    await m.load("low")  # the wake, on a
    assert m.view("low").residency == "awake" and m.view("low").devices == ("a/gpu:0",)
    assert m.view("mid").state is S.OFFLINE  # evicted there for the wake
    assert m.admitted_bytes("a/gpu:0") == 8 * GIB


async def test_replicas_spread_across_nodes(tmp_path: Path) -> None:
    """Issue 38: best fit and the node's name would put both replicas on node a (two
    GPUs there); spread puts the sibling on node b."""
    from controller.spec.replicas import replica_specs

    cluster = Cluster(tmp_path, [node("a", gpus=2), node("b", gpus=2)])
    base = cslot("chat", "m10", replicas=2)
    await cluster.declare([base, *replica_specs(base)], [model_spec("m10", 10)])
    await cluster.manager.load("chat")
    await cluster.manager.load("chat-r1")
    assert {cluster.node_of("chat"), cluster.node_of("chat-r1")} == {"a", "b"}
    packed = Cluster(tmp_path / "packed", [node("a", gpus=2), node("b", gpus=2)])
    shared = cslot("pack", "m10", replicas=2, replica_placement="share")
    await packed.declare([shared, *replica_specs(shared)], [model_spec("m10", 10)])
    await packed.manager.load("pack")
    await packed.manager.load("pack-r1")
    assert packed.node_of("pack") == packed.node_of("pack-r1") == "a"  # asked: best fit


class _SurgeCapable:
    """What ``cannot_surge`` asks of a runtime (the decision alone is tested here; the
    kubernetes runtime's steps: tests/k8s/test_kubernetes_surge.py)."""

    async def start_instance(self, launch: Any) -> Any: ...
    async def inspect_instance(self, slot: str) -> Any: ...
    async def stop_instance(self, slot: str, timeout: float) -> None: ...
    async def promote(self, slot: str) -> None: ...
    async def stop_retiring(self, slot: str, timeout: float) -> None: ...


async def test_a_surge_on_a_cluster_needs_another_whole_gpu_and_holds_it(tmp_path: Path) -> None:
    """Whole GPUs (not time-sliced): the slot's own GPU holds its old server, so a surge
    needs another free one (recreate when there is none, and says so); while a surge's
    second pod runs it holds its GPU against every other slot's load."""
    cluster = Cluster(tmp_path, [node("a", gpus=1)])
    cluster.runtime.surge = _SurgeCapable()  # type: ignore[attr-defined]
    auto = {"port": None}  # left to the controller (a declared port always recreates)
    slots = [cslot("chat", "m4", **auto), cslot("other", "m4")]
    await cluster.declare(slots, [model_spec("m4", 4)])
    m = cluster.manager
    await m.load("chat")
    v2 = slot_spec("chat", "m4", server={"image": "slotctl:v2"}, **auto)
    changed = desired([v2, slots[1]], [model_spec("m4", 4)])
    decision = m.rollout_for(changed.slots["chat"])
    assert decision.way == "recreate" and decision.reason.startswith("no room to surge"), decision
    cluster.probe.nodes = [node("a", gpus=2)]
    decision = m.rollout_for(changed.slots["chat"])
    assert decision.way == "surge" and "a/gpu:1" in decision.reason, decision
    m.core.table.surges["chat"] = (("a/gpu:1", 4 * GIB, True),)  # the surge's pod, starting
    with pytest.raises((DeviceUnavailable, InsufficientMemory)):
        await m.load("other", background=True)  # (a background load evicts no peer)
    del m.core.table.surges["chat"]  # its rollout over: the GPU is free again
    await m.load("other")
    assert m.view("other").devices == ("a/gpu:1",)


async def test_one_pass_cluster_holdings_agree_with_the_sums_they_replace(tmp_path: Path) -> None:
    """Issue 39: a cluster load decision reads the slots once
    (:meth:`Usage.cluster_holdings`): its bytes are :meth:`Usage.all_device_bytes`', and
    its per-GPU holders and per-node units count every other admitted slot's placement
    (the requester and the peers left out); a Model's states come from the table as
    from the views."""
    cluster = Cluster(tmp_path, [node("a", gpus=2, gib=24, allocatable=6), node("b", gpus=2)])
    slots = [cslot(f"s{i}", "m6") for i in range(5)] + [cslot("big", "m20", gpus=2)]
    await cluster.declare(slots, [model_spec("m6", 6), model_spec("m20", 20)])
    m = cluster.manager
    await asyncio.gather(*(m.start_load(s.name) for s in slots))
    await settle(m)
    table = m.core.table
    placed = [r for r in table if r.placement]
    assert len(placed) >= 4 and any(len(r.placement) == 2 for r in placed)  # "big" spans two
    for requester in table:
        leave_out = {placed[0].name} if requester is not placed[0] else set()
        figures, holders, units = table.usage.cluster_holdings(requester, leave_out)
        assert figures == table.usage.all_device_bytes(requester)
        want_holders: dict[str, int] = {}
        want_units: dict[str, dict[str, int]] = {}
        for s in table:
            if s is requester or s.name in leave_out or not s.placement:
                continue
            for g in s.placement:
                assert g.node is not None
                want_holders[g.key] = want_holders.get(g.key, 0) + 1
                want_units.setdefault(g.node, {})[s.name] = (
                    want_units.get(g.node, {}).get(s.name, 0) + 1
                )
        assert (holders, units) == (want_holders, want_units)
    for model in ("m6", "m20", "none"):
        views = {v.name: v.state for v in m.views() if v.model_id == model}
        assert m.model_states(model) == views


async def test_a_cpu_slots_surge_counts_no_gpu_on_its_node(tmp_path: Path) -> None:
    """A surge of a non-GPU slot holds its node's ``NODE/cpu`` key while both pods run:
    its bytes count there, but no GPU holder or unit on the node (review of the pod
    surge, item 4); a GPU slot's surge counts its GPU."""
    cluster = Cluster(tmp_path, [node("a", gpus=2, gib=24, allocatable=6)])
    await cluster.declare([cslot("s0", "m6")], [model_spec("m6", 6)])
    table = cluster.manager.core.table
    requester = table.get("s0")
    table.surges["cpu-chat"] = (("a/cpu", 2 * GIB, True),)
    figures, holders, units = table.usage.cluster_holdings(requester, set())
    assert figures["a/cpu"] == [2 * GIB, 2 * GIB]
    assert "a/cpu" not in holders and "a" not in units
    table.surges["gpu-chat"] = (("a/gpu:1", 4 * GIB, True),)
    _figures, holders, units = table.usage.cluster_holdings(requester, set())
    assert holders == {"a/gpu:1": 1} and units == {"a": {"gpu-chat": 1}}
