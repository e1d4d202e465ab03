"""InferencePools (``slotctl operator --inference-pools``, the chart's
``inferencePool.enabled``): one per model, selecting the pods of its Ready slots.

Against KMock with the test as the kubelet (:mod:`tests.k8s.kubelet`): the operator keeps
a pool per model, with the model's slots' ports, and the ``slotctl.pool`` label on the
pods of its Ready slots; a deleted slot leaves its model's pool, the model's last one
takes the pool with it. The runtime's pool keeper alone: a label taken off a pod whose
slot is no longer Ready, another owner's pods untouched, an earlier run's stale pool
deleted, nothing sent at rest. Every pool written is checked against the extension's own
CRD (v1.6.2, vendored in ``tests/k8s/data/gie/``: schema and CEL rules, as
:mod:`tests.k8s.crdcheck` runs them); the real API server judges them in
``test_real_apiserver_inference_pool.py``. The chart's RBAC equals what was sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.runtime.kubernetes.poolspec import (
    Picker,
    PoolWant,
    SlotFacts,
    pool_body,
    pool_name,
    wanted_pools,
)
from tests.k8s.chart import permissions, render
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.crdcheck import admission_errors
from tests.k8s.kubelet import Kubelet, gpu_node
from tests.k8s.test_kubernetes_runtime import model, operator, ready, slot

__all__ = ["POOL_CRD"]

pytestmark = pytest.mark.timeout(180)
POOL_CRD_FILE = (
    Path(__file__).parent / "data" / "gie" / "inference.networking.k8s.io_inferencepools.yaml"
)
POOL_CRD: dict[str, Any] = yaml.safe_load(POOL_CRD_FILE.read_text())


def test_the_vendored_crd_is_the_extensions_v1() -> None:
    annotations = POOL_CRD["metadata"]["annotations"]
    assert annotations["inference.networking.k8s.io/bundle-version"] == "v1.6.2"
    (version,) = POOL_CRD["spec"]["versions"]
    assert version["name"] == "v1" and version["served"] and version["storage"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["selector", "targetPorts"]  # endpointPickerRef: optional


def test_pool_names_wants_and_bodies() -> None:
    assert pool_name("demo-chat") == "slotctl-demo-chat"
    odd = pool_name("Qwen/Qwen3-8B:q4@main")
    assert odd.startswith("slotctl-qwen-qwen3-8b-q4-main-") and len(odd) <= 63
    assert pool_name("a/b") != pool_name("a-b")  # a changed id gets its hash: no sharing
    long = pool_name("m" * 80)
    assert len(long) <= 63 and long != pool_name("m" * 81)
    wants = wanted_pools(
        [
            SlotFacts("a", "m", 8081, True),
            SlotFacts("b", "m", 8080, False),
            SlotFacts("c", "n", None, False),  # no port yet: no pool
            SlotFacts("d", "", 9000, True),  # no model
            *(SlotFacts(f"x{i}", "many", 9000 + i, True) for i in range(10)),
        ]
    )
    assert set(wants) == {"slotctl-m", "slotctl-many"}
    assert wants["slotctl-m"] == PoolWant("m", (8080, 8081), frozenset({"a"}))
    assert len(wants["slotctl-many"].ports) == 8  # the CRD's maxItems
    for picker in (None, Picker("epp", 9002), Picker.parse("epp:9002:FailOpen")):
        for name, want in wants.items():
            body = pool_body(name, want, "ml", "slotctl", picker)
            assert admission_errors(POOL_CRD, body) == []
    bad = pool_body("slotctl-m", PoolWant("m", (8080, 8080), frozenset()), "ml", "slotctl")
    assert admission_errors(POOL_CRD, bad)  # the CRD's own rule: unique ports
    assert Picker.parse("") is None
    for text in ("epp", "epp:x", "epp:9002:Sometimes", "epp:0"):
        with pytest.raises(ValueError, match="endpoint picker"):
            Picker.parse(text)


async def _pool(cluster: Cluster, name: str) -> dict[str, Any] | None:
    return await cluster.get("inferencepools", name)


async def _labels(kubelet: Kubelet, slot_name: str) -> dict[str, str] | None:
    pods = [p for p in await kubelet._list(kubelet._url("pods")) if _slot_of(p) == slot_name]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return dict(live[0]["metadata"].get("labels") or {}) if live else None


def _slot_of(pod: dict[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get("slotctl.slot")


async def test_the_operator_keeps_a_pool_per_model_of_its_ready_slots_pods(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.helpers import free_ports

    p1, p2, p3 = free_ports(3)
    await kubelet.create(gpu_node("gpu-a", gpus=2, gib_per_gpu=16, replicas=4))
    async with operator(cluster, tmp_path / "state", monkeypatch, inference_pools=True) as op:
        await cluster.create(model("m-chat", 2))
        await cluster.create(model("m-embed", 1))
        await cluster.create(slot("chat-a", "m-chat", p1))
        await cluster.create(slot("chat-b", "m-chat", p2))
        await cluster.create(slot("embed", "m-embed", p3, autoload=False))
        for name in ("chat-a", "chat-b"):
            await eventually(lambda n=name: ready(cluster, n), f"{name} Ready", 90)

        async def labelled(name: str) -> bool:
            return (await _labels(kubelet, name) or {}).get("slotctl.pool") == "slotctl-m-chat"

        for name in ("chat-a", "chat-b"):
            await eventually(lambda n=name: labelled(n), f"{name}'s pod in the pool", 30)
        pool = await _pool(cluster, "slotctl-m-chat")
        assert pool is not None and admission_errors(POOL_CRD, pool) == []
        assert pool["spec"]["selector"] == {
            "matchLabels": {"slotctl.managed": "true", "slotctl.pool": "slotctl-m-chat"}
        }
        assert pool["spec"]["targetPorts"] == [{"number": p} for p in sorted((p1, p2))]
        assert "endpointPickerRef" not in pool["spec"]
        assert pool["metadata"]["annotations"]["slotctl.model"] == "m-chat"
        # a model whose one slot is not loaded: a pool, and no pod in it
        embed = await eventually(lambda: _pool(cluster, "slotctl-m-embed"), "embed's pool")
        assert embed["spec"]["targetPorts"] == [{"number": p3}]
        assert await _labels(kubelet, "embed") is None  # no pod at all

        # a deleted slot leaves its model's pool; the model's last takes the pool along
        await cluster.delete("slots", "chat-b")

        async def one_port() -> bool:
            found = await _pool(cluster, "slotctl-m-chat")
            return bool(found) and found["spec"]["targetPorts"] == [{"number": p1}]

        await eventually(one_port, "the pool without chat-b's port", 60)
        await cluster.delete("slots", "embed")

        async def embed_gone() -> bool:
            return await _pool(cluster, "slotctl-m-embed") is None

        await eventually(embed_gone, "the pool of a model without slots deleted", 30)
        assert op.pools is not None and op.pools.passes > 0
    assert_pool_rbac(cluster)


def assert_pool_rbac(cluster: Cluster) -> None:
    """The chart with ``inferencePool.enabled`` grants what the operator sent on pools
    and pods, and nothing more (``create`` of pools is a server-side apply's, and
    ``delete`` of pods the node-lost case's, as without pools)."""
    values = {"watchNamespaces": ["default"], "runtime": "kubernetes"}
    docs = render({**values, "inferencePool": {"enabled": True}}, namespace="default")
    cluster_wide, roles = permissions(docs)
    granted = {p for p in cluster_wide | roles["default"] if p[2] in ("inferencepools", "pods")}
    used = {p for p in cluster.operator_requests() if p[2] in ("inferencepools", "pods")}
    group = "inference.networking.k8s.io"
    implied = {("create", group, "inferencepools"), ("delete", "", "pods")}
    assert used <= granted, f"the chart's RBAC misses {sorted(used - granted)}"
    assert granted <= used | implied, f"unused grants {sorted(granted - used - implied)}"
    assert {("list", group, "inferencepools"), ("patch", "", "pods")} <= used
    _, plain = permissions(render(values, namespace="default"))
    assert not {p for p in plain["default"] if p[2] == "inferencepools"}
    assert ("patch", "", "pods") not in plain["default"]


async def test_the_pool_keeper_alone_labels_only_what_changed(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """A pod's label follows its slot's readiness (on, then off while the pod runs); a
    pod of another owner's slot is never touched; an earlier run's pool of this owner is
    deleted at the first pass; a pass with nothing changed sends nothing."""
    import dataclasses

    from lightkube import AsyncClient, KubeConfig

    from controller.runtime.kubernetes.pools import InferencePools
    from controller.runtime.kubernetes.runtime import KubernetesRuntime
    from tests.integration.helpers import demo_launch, free_ports
    from tests.k8s.test_kubernetes_runtime import IMAGE

    (port,) = free_ports(1)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16))
    stale = pool_body("slotctl-old", PoolWant("old", (1,), frozenset()), "default", "slotctl")
    theirs = pool_body("slotctl-theirs", PoolWant("t", (1,), frozenset()), "default", "other")
    for body in (stale, theirs):
        await cluster.create(body)
    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    runtime = KubernetesRuntime(client, namespace="default")
    other = KubernetesRuntime(client, namespace="default", owner="other")
    try:
        launch = dataclasses.replace(
            demo_launch("chat", runtime="kubernetes", image=IMAGE, port=port), device="cpu"
        )
        await runtime.start(launch)
        (their_port,) = free_ports(1)
        await other.start(
            dataclasses.replace(
                demo_launch("their", runtime="kubernetes", image=IMAGE, port=their_port),
                device="cpu",
            )
        )
        pools = InferencePools(runtime)
        want = PoolWant("m", (port,), frozenset({"chat"}))
        await pools.keep({"slotctl-m": want})
        assert await _pool(cluster, "slotctl-old") is None  # an earlier run's: gone
        assert await _pool(cluster, "slotctl-theirs") is not None  # another owner's
        assert (await _labels(kubelet, "chat") or {}).get("slotctl.pool") == "slotctl-m"
        assert "slotctl.pool" not in (await _labels(kubelet, "their") or {})

        async def cached(value: str | None) -> bool:
            (pod,) = runtime.cache.slot_pods("chat")
            return ((pod.metadata.labels if pod.metadata else None) or {}).get(
                "slotctl.pool"
            ) == value

        await eventually(lambda: cached("slotctl-m"), "the label in the pod cache")
        sent = pools.requests
        await pools.keep({"slotctl-m": want})  # nothing changed: nothing sent
        assert pools.requests == sent
        await pools.keep({"slotctl-m": dataclasses.replace(want, ready=frozenset())})
        assert "slotctl.pool" not in (await _labels(kubelet, "chat") or {})
        await eventually(lambda: cached(None), "the label off in the pod cache")
        await pools.keep({})
        assert await _pool(cluster, "slotctl-m") is None
        assert pools.requests == sent + 2  # the label off, the pool deleted
    finally:
        await runtime.close()
        await other.close()
        await client.close()


def test_the_chart_passes_the_pools_flags_and_refuses_them_without_the_runtime() -> None:
    values: dict[str, Any] = {
        "runtime": "kubernetes",
        "inferencePool": {"enabled": True, "endpointPicker": {"name": "epp", "port": 9002}},
    }
    deploy = next(d for d in render(values) if d["kind"] == "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--inference-pools" in args and "--endpoint-picker=epp:9002:FailClose" in args
    plain = next(d for d in render({"runtime": "kubernetes"}) if d["kind"] == "Deployment")
    assert "--inference-pools" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]
    with pytest.raises(Exception, match=r"inferencePool\.enabled needs runtime: kubernetes"):
        render({"inferencePool": {"enabled": True}})
