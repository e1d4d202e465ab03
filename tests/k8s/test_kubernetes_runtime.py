"""The operator with ``--runtime kubernetes`` against KMock, the test acting as the
Deployment controller, the scheduler and the kubelet (:mod:`tests.k8s.kubelet`): a
Deployment + Service per slot, readiness probed against a real demo server at its pod's
IP, a config edit updating the Deployment, delete cleaning up, adoption by labels, an
unlabelled Deployment left alone, placement and eviction per (node, device), and the
chart's RBAC for the runtime compared with every request the operator sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from controller.model.errors import SlotctlError
from controller.model.sizes import GIB
from controller.operator.run import Operator, OperatorOptions
from tests.integration.helpers import free_ports
from tests.k8s.chart import permissions, render
from tests.k8s.conftest import TEST_AGENT, Cluster, eventually
from tests.k8s.kubelet import Kubelet, answers, gpu_node
from tests.k8s.test_operator import adapter, adapter_ready, alias, alias_ready
from tests.unit.manager_fixtures import events_of

pytestmark = pytest.mark.timeout(180)
IMAGE = "slotctl:test"
_APPLIED = ("deployments", "services")  # written by server-side apply


def model(name: str, gb: float) -> dict[str, Any]:
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name},
        "spec": {"source": f"demo://{name}", "memory_gb": gb},
    }


def slot(name: str, model_id: str, port: int, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "provider": "demo",
        "model": {"default": model_id},
        "device": "gpu",
        "port": port,
        "autoload": True,
        "server": {"image": IMAGE, "extra_args": ["--load-seconds", "0.1"]},
    }
    body.update(spec)
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Slot",
        "metadata": {"name": name},
        "spec": body,
    }


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


async def ready(cluster: Cluster, name: str, generation: int = 1) -> dict[str, Any] | None:
    obj = await cluster.get("slots", name)
    cond = condition(obj, "Ready")
    if cond.get("status") == "True" and cond.get("observedGeneration") == generation:
        return obj
    return None


@contextlib.asynccontextmanager
async def operator(
    cluster: Cluster,
    state: Path,
    monkeypatch: pytest.MonkeyPatch,
    settings: str = "",
    **options: Any,
) -> AsyncIterator[Operator]:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (state / "config").mkdir(parents=True, exist_ok=True)
    (state / "config" / "controller.toml").write_text(settings)
    op = Operator(
        OperatorOptions(
            state_dir=state,
            config_dir=state / "config",
            runtime="kubernetes",
            namespaces=["default"],
            resync_s=1.0,
            status_resync_s=0.5,
            **options,
        )
    )
    task = asyncio.create_task(op.run())
    try:
        await eventually(lambda: _flag(op.kopf_ready), "kopf ready", timeout=20)
        yield op
    finally:
        op.kopf_stop.set()
        op.controller.stop.set()
        await task


async def _flag(event: asyncio.Event) -> bool:
    return event.is_set()


async def _state(op: Operator, name: str, state: str) -> bool:
    try:
        return op.manager.view(name).state.value == state
    except SlotctlError:
        return False  # not known to this operator yet


async def test_a_slot_is_a_deployment_probed_at_its_pod_ip(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, new_port = free_ports(2)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    async with operator(cluster, tmp_path / "state", monkeypatch) as op:
        await cluster.create(model("m-chat", 2))
        await cluster.create(slot("chat", "m-chat", port))

        chat = await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=60)
        (pod,) = kubelet.alive("chat")
        status = chat["status"]
        assert status["endpoint"] == f"http://{pod.ip}:{port}"
        assert status["node"] == "gpu-a"
        assert await answers(status["endpoint"])
        assert not await answers(f"http://127.0.0.1:{port}")  # only the pod IP serves it
        # an Alias and an Adapter ride along (the chart's RBAC is judged against what was used)
        await cluster.create(alias("assistant", "m-chat"))
        await eventually(lambda: alias_ready(cluster, "assistant"), "the Alias Ready")
        await cluster.create(adapter("sql", "m-chat", "hf://org/lora/sql.safetensors"))
        await eventually(lambda: adapter_ready(cluster, "sql"), "the Adapter Ready")

        dep = await kubelet.get("deployments", "slotctl-chat")
        assert dep is not None
        labels = dep["metadata"]["labels"]
        first_hash = dep["metadata"]["annotations"]["slotctl.config-hash"]
        assert labels == {
            "slotctl.managed": "true",
            "slotctl.slot": "chat",
            "slotctl.stack": "kubernetes",
            "slotctl.config-hash": first_hash,
            "slotctl.owner": "slotctl",  # metadata only: not in the selector
        }
        assert first_hash == op.manager.view("chat").config_hash
        spec = dep["spec"]
        assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
        (container,) = spec["template"]["spec"]["containers"]
        assert container["image"] == IMAGE
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        assert container["command"] == ["python3"]  # not the image's entrypoint
        assert container["args"][:2] == ["-m", "controller.demo"]
        assert "nodeSelector" not in spec["template"]["spec"]  # placed by the scheduler
        assert spec["template"]["spec"]["automountServiceAccountToken"] is False
        service = await kubelet.get("services", "slotctl-chat")
        assert service is not None
        assert service["spec"]["selector"] == {  # the serving instance's pod (0: slotctl-chat)
            "slotctl.managed": "true",
            "slotctl.slot": "chat",
            "slotctl.instance": "0",
        }
        assert service["spec"]["ports"][0]["port"] == port

        # a runtime change (the port): the Deployment is updated, a new pod replaces the
        # old one (Recreate), the Service follows, the slot serves at the new pod's IP
        await cluster.edit("slots", "chat", {"port": new_port})
        chat = await eventually(lambda: ready(cluster, "chat", 2), "Ready after the edit", 60)
        dep = await kubelet.get("deployments", "slotctl-chat")
        assert (
            dep is not None and dep["metadata"]["annotations"]["slotctl.config-hash"] != first_hash
        )
        (new_pod,) = kubelet.alive("chat")
        assert new_pod.name != pod.name and pod.process.poll() is not None
        assert chat["status"]["endpoint"] == f"http://{new_pod.ip}:{new_port}"
        assert await answers(chat["status"]["endpoint"])
        service = await kubelet.get("services", "slotctl-chat")
        assert service is not None and service["spec"]["ports"][0]["port"] == new_port
        assert await op.manager.runtime.logs("chat") is not None  # (KMock has no pod logs)

        # delete: the pod goes before the finalizer; then the Deployment and Service
        await cluster.delete("slots", "chat")
        await eventually(lambda: _gone(cluster, "slots", "chat"), "Slot removed", timeout=60)
        assert not kubelet.alive("chat")
        await eventually(lambda: _no(kubelet, "deployments", "slotctl-chat"), "Deployment gone")
        await eventually(lambda: _no(kubelet, "services", "slotctl-chat"), "Service gone")
    assert_runtime_rbac(cluster)


async def _gone(cluster: Cluster, plural: str, name: str) -> bool:
    return await cluster.get(plural, name) is None


async def _no(kubelet: Kubelet, plural: str, name: str) -> bool:
    return await kubelet.get(plural, name) is None


def test_chart_with_the_kubernetes_runtime() -> None:
    """Linted, and the operator gets the runtime and the namespace of its Deployments."""
    import helm_python as helm

    from controller.cli.main import build_parser
    from tests.k8s.chart import CHART

    values = {"runtime": "kubernetes", "gpuResource": "amd.com/gpu"}
    report = helm.lint(str(CHART), values, strict=True)
    assert not [m for m in report["messages"] if m["severity"] >= 2], report
    (deploy,) = [d for d in render(values, namespace="ml") if d["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert build_parser().parse_args(container["args"]).runtime == "kubernetes"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SLOTCTL_K8S_NAMESPACE"] == "ml" and env["SLOTCTL_K8S_GPU_RESOURCE"] == "amd.com/gpu"
    assert env["SLOTCTL_K8S_OWNER"] == "slotctl"  # the release: two in one namespace apart
    assert "SLOTCTL_K8S_NAMESPACE" not in str(render({}, namespace="ml"))


def assert_runtime_rbac(cluster: Cluster) -> None:
    """The chart rendered with ``runtime: kubernetes`` (release namespace = where the
    Deployments are) allows every request the operator sent, and nothing more.

    Two rules are needed without a request of their own here: ``create`` of Deployments
    and Services (a server-side apply that creates an object is a PATCH, which the API
    server also authorizes as ``create``), and ``delete`` of pods (a pod on a node that
    is not ready: the real-cluster tier's node test sends it, and its audit log is
    compared with the chart there)."""
    docs = render({"watchNamespaces": ["default"], "runtime": "kubernetes"}, namespace="default")
    cluster_perms, roles = permissions(docs)
    allowed = cluster_perms | {p for perms in roles.values() for p in perms}
    used = cluster.operator_requests()
    implied = {("create", g, r) for (v, g, r) in used if v == "patch" and r in _APPLIED}
    implied.add(("delete", "", "pods"))
    assert used <= allowed, f"the chart's RBAC misses {sorted(used - allowed)}"
    assert allowed <= used | implied, f"the chart's RBAC grants unused {sorted(allowed - used)}"
    for verb in ("list", "watch"):  # cluster-scoped: every node, every namespace's pods
        assert {(verb, "", "nodes"), (verb, "", "pods")} <= cluster_perms
    workloads = {p for p in roles["default"] if p[2] in ("deployments", "services", "pods")}
    assert ("delete", "", "pods") in workloads and ("list", "", "pods") not in workloads
    default = render({"watchNamespaces": ["default"]}, namespace="default")
    plain_cluster, plain_roles = permissions(default)
    plain = plain_cluster | {p for perms in plain_roles.values() for p in perms}
    assert not {p for p in plain if p[2] in ("deployments", "services", "pods", "nodes")}


async def test_adoption_by_labels_and_an_unlabelled_deployment_is_never_touched(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, foreign_port = free_ports(2)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "slotctl-foreign", "labels": {"app": "someone-else"}},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "someone-else"}},
            "template": {
                "metadata": {"labels": {"app": "someone-else"}},
                "spec": {"containers": [{"name": "x", "image": "x", "args": ["python3"]}]},
            },
        },
    }
    await kubelet.create(foreign)
    before = await kubelet.get("deployments", "slotctl-foreign")
    assert before is not None
    await cluster.create(model("m-chat", 2))
    await cluster.create(slot("chat", "m-chat", port))
    await cluster.create(slot("foreign", "m-chat", foreign_port))

    async with operator(cluster, tmp_path / "first", monkeypatch) as op:
        await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=60)

        async def refused() -> dict[str, Any] | None:
            obj = await cluster.get("slots", "foreign")
            error = ((obj or {}).get("status") or {}).get("lastError") or {}
            return obj if error.get("code") == "slot.spawn_failed" else None

        obj = await eventually(refused, "the foreign slot refused", timeout=60)
        assert "unmanaged Deployment" in obj["status"]["lastError"]["message"]
        assert (await op.manager.runtime.inspect("foreign")).managed is False
        (pod,) = kubelet.alive("chat")

    # A new operator with a fresh state dir knows nothing of the server: it finds the
    # labelled Deployment running the same config and adopts it (no second pod).
    async with operator(cluster, tmp_path / "second", monkeypatch) as op:
        await eventually(lambda: _state(op, "chat", "ready"), "adopted and ready", timeout=60)
        chat = await eventually(lambda: ready(cluster, "chat"), "Ready again", timeout=60)
        # the operator's writes to Deployments: the creation of chat's (a server-side
        # apply, a PATCH), nothing since
        writes = [
            (str(getattr(r.method, "value", r.method)), r.name)
            for r in cluster.emulator._requests
            if r.resource is not None
            and r.resource.plural == "deployments"
            and str(getattr(r.method, "value", r.method)) != "GET"
            and not r.headers.get("User-Agent", "").startswith(TEST_AGENT)
        ]
        assert writes == [("PATCH", "slotctl-chat")], writes
        assert [p.name for p in kubelet.alive("chat")] == [pod.name]
        assert kubelet.created.count(pod.name) == 1
        assert len([n for n in kubelet.created if n.startswith("slotctl-chat-")]) == 1
        assert chat["status"]["endpoint"] == f"http://{pod.ip}:{port}"
        await asyncio.sleep(1.5)  # a resync with its orphan sweep passes
        after = await kubelet.get("deployments", "slotctl-foreign")
        assert after == before  # not scaled, labelled, patched or deleted
        assert await kubelet.get("services", "slotctl-foreign") is None


async def test_a_late_first_sync_never_reaps_a_server_its_slot_declares(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new operator on a loaded machine whose handlers come later than a resync period
    after kopf's listing: the Slot is listed, so only its sync turns the orphan sweep on;
    the adopted server is not stopped meanwhile (it was, once, in a parallel test run)."""
    (port,) = free_ports(1)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    await cluster.create(model("m-chat", 2))
    await cluster.create(slot("chat", "m-chat", port))
    async with operator(cluster, tmp_path / "first", monkeypatch):
        await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=60)
        (pod,) = kubelet.alive("chat")
    real = Operator._changed_handler

    def late(self: Operator, kind: str) -> Any:
        handler = real(self, kind)

        async def changed(**kwargs: Any) -> None:
            await asyncio.sleep(3.0)  # three resync periods of the fixture
            await handler(**kwargs)

        return changed

    monkeypatch.setattr(Operator, "_changed_handler", late)
    async with operator(cluster, tmp_path / "second", monkeypatch) as op:
        await eventually(lambda: _state(op, "chat", "ready"), "adopted and ready", timeout=60)
        await asyncio.sleep(1.5)  # a resync with its orphan sweep passes
        assert [p.name for p in kubelet.alive("chat")] == [pod.name]
        assert len([n for n in kubelet.created if n.startswith("slotctl-chat-")]) == 1


async def test_placement_and_eviction_per_node(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 16 GiB GPU nodes (time-sliced: 4 pods each), slots of 10 + 10 + 5 GiB that
    cannot all fit on one node: each lands where it fits; a load that needs room on one
    node evicts there only (not the lower-priority slot on the other node); deleting a
    slot frees its node's memory (the evicted slot comes back)."""
    ports = free_ports(4)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    await kubelet.create(gpu_node("gpu-b", gpus=1, gib_per_gpu=16, replicas=4))
    for name, gb in (("m10", 10), ("m5", 5), ("m8", 8)):
        await cluster.create(model(name, gb))
    settings = "min_resident_s = 0\n"
    async with operator(cluster, tmp_path / "state", monkeypatch, settings) as op:
        await cluster.create(slot("big-a", "m10", ports[0], node="gpu-a", priority=60))
        await cluster.create(slot("big-b", "m10", ports[1], node="gpu-b", priority=50))
        for name in ("big-a", "big-b"):
            await eventually(lambda n=name: ready(cluster, n), f"{name} Ready", timeout=60)
        # the unpinned slot: the scheduler puts it on gpu-a (its tie-break), where
        # 10 + 5 GiB fit in 16 GiB minus the safety margin
        await cluster.create(slot("small", "m5", ports[2], priority=10))
        small = await eventually(lambda: ready(cluster, "small"), "small Ready", timeout=60)
        assert small["status"]["node"] == "gpu-a"
        nodes = {n: (await cluster.get("slots", n))["status"]["node"] for n in ("big-a", "big-b")}
        assert nodes == {"big-a": "gpu-a", "big-b": "gpu-b"}
        assert op.manager.admitted_bytes("gpu-a/gpu") == 15 * GIB
        assert op.manager.admitted_bytes("gpu-b/gpu") == 10 * GIB
        dep = await kubelet.get("deployments", "slotctl-big-b")
        assert dep is not None
        assert dep["spec"]["template"]["spec"]["nodeSelector"] == {
            "kubernetes.io/hostname": "gpu-b"
        }

        # 8 GiB more on gpu-b: big-b (priority 50) is evicted there; small (priority 10,
        # the lowest anywhere) stays, because it is on the other node
        await cluster.create(slot("mid-b", "m8", ports[3], node="gpu-b", priority=90))
        await eventually(lambda: ready(cluster, "mid-b"), "mid-b Ready", timeout=60)
        assert op.manager.view("big-b").state.value in ("offline", "unloading")
        assert op.manager.view("small").state.value == "ready"
        assert op.manager.view("big-a").state.value == "ready"
        assert not kubelet.alive("big-b")
        dep = await kubelet.get("deployments", "slotctl-big-b")
        assert dep is not None and dep["spec"]["replicas"] == 0  # unloaded: scaled to 0

        async def big_b_waits() -> bool:
            return op.manager.view("big-b").waiting == "waiting_for_memory"

        # its next try is refused: it cannot evict mid-b (higher priority)
        await eventually(big_b_waits, "big-b waiting for memory", timeout=60)

        # deleting mid-b frees gpu-b: big-b comes back there
        await cluster.delete("slots", "mid-b")
        await eventually(lambda: _gone(cluster, "slots", "mid-b"), "mid-b removed", timeout=60)
        await eventually(lambda: ready(cluster, "big-b"), "big-b back", timeout=60)
        assert op.manager.admitted_bytes("gpu-b/gpu") == 10 * GIB
        assert op.manager.admitted_bytes("gpu-a/gpu") == 15 * GIB
        assert {p.slot for p in kubelet.pods.values()} == {"big-a", "big-b", "small"}


async def test_the_runtime_alone_unschedulable_pods_and_foreign_objects(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """The runtime without the operator: a pod the scheduler cannot place fails the start
    with the scheduler's reason and scales the Deployment back to 0; a stop of a slot
    whose Service (or Deployment) someone else owns touches nothing."""
    from lightkube import AsyncClient, KubeConfig

    from controller.model.errors import SlotSpawnFailed
    from controller.runtime.kubernetes.runtime import KubernetesRuntime
    from tests.integration.helpers import demo_launch

    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16))
    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    runtime = KubernetesRuntime(client, namespace="default", unschedulable_s=0.5)
    try:
        launch = demo_launch("lost", runtime="kubernetes", image=IMAGE)
        launch = dataclasses.replace(launch, node="no-such-node", device="gpu")
        with pytest.raises(SlotSpawnFailed, match=r"unschedulable.*insufficient nvidia\.com/gpu"):
            await runtime.start(launch)
        dep = await kubelet.get("deployments", "slotctl-lost")
        assert dep is not None and dep["spec"]["replicas"] == 0
        assert (await runtime.inspect("lost")).running is False

        foreign = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "slotctl-taken"},
            "spec": {"ports": [{"port": 1, "targetPort": 1}]},
        }
        await kubelet.create(foreign)
        taken = demo_launch("taken", runtime="kubernetes", image=IMAGE)
        with pytest.raises(SlotSpawnFailed, match="unmanaged Service"):
            await runtime.start(taken)
        assert await kubelet.get("deployments", "slotctl-taken") is None  # nothing created
        assert (await runtime.stop("taken", 1.0)).status.value == "missing"
        assert await kubelet.get("services", "slotctl-taken") is not None  # still theirs

        # a stop of the unloaded slot removes its Deployment and Service once no pod is
        # left (the failed start's pod may still be terminating: that stop waits for it)
        if (await runtime.stop("lost", 1.0)).message != "Deployment removed":
            assert (await runtime.stop("lost", 1.0)).message == "Deployment removed"
        assert await kubelet.get("deployments", "slotctl-lost") is None
        assert await kubelet.get("services", "slotctl-lost") is None
    finally:
        await runtime.close()
        await client.close()


async def test_an_unpinned_slot_goes_where_its_memory_fits(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler counts GPUs, not GPU memory: on its own it put the 6 GiB slot on the
    node with the most free GPUs, a 4 GiB one, where it was then refused. The controller
    places it: on the 16 GiB node, pinned there with a required node affinity."""
    (port,) = free_ports(1)
    await kubelet.create(gpu_node("big", gpus=1, gib_per_gpu=16, replicas=2))
    await kubelet.create(gpu_node("small", gpus=1, gib_per_gpu=4, replicas=8))
    await cluster.create(model("m6", 6))
    async with operator(cluster, tmp_path / "state", monkeypatch) as op:
        await cluster.create(slot("chat", "m6", port))
        obj = await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=60)
        assert obj["status"]["node"] == "big"
        assert op.manager.admitted_bytes("big/gpu") == 6 * GIB
        assert op.manager.admitted_bytes("small/gpu") == 0
        assert len(kubelet.created) == 1  # no pod was tried on the small node first
        dep = await kubelet.get("deployments", "slotctl-chat")
        assert dep is not None
        affinity = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term == {
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["big"]}]
        }


async def test_unpinned_slots_come_up_together_without_gfd_labels_too(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three unpinned 10 GiB slots, three one-GPU nodes, the third without GPU feature
    discovery's memory label (the device plugin alone): one slot per node, admitted side
    by side. They were admitted one after another against one budget the size of the
    largest node (the second refused until the first landed), and the node without the
    label refused every slot forever ("no memory probe answers")."""
    ports = free_ports(3)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16))
    await kubelet.create(gpu_node("gpu-b", gpus=1, gib_per_gpu=16))
    plain = gpu_node("gpu-c", gpus=1, gib_per_gpu=16)
    for label in ("nvidia.com/gpu.memory", "nvidia.com/gpu.count"):
        del plain["metadata"]["labels"][label]
    await kubelet.create(plain)
    await cluster.create(model("m10", 10))
    async with operator(cluster, tmp_path / "state", monkeypatch) as op:
        with op.manager.events.subscribe() as sub:
            for i, name in enumerate(("s1", "s2", "s3")):
                await cluster.create(slot(name, "m10", ports[i]))
            nodes = set()
            for name in ("s1", "s2", "s3"):
                obj = await eventually(lambda n=name: ready(cluster, n), f"{name} Ready", 60)
                nodes.add(obj["status"]["node"])
            refused = [e for e in events_of(sub) if e.error == "model.insufficient_memory"]
        assert nodes == {"gpu-a", "gpu-b", "gpu-c"}
        assert not refused, [e.message for e in refused]
        assert {p.slot for p in kubelet.pods.values()} == {"s1", "s2", "s3"}


async def _true(value: bool) -> bool:
    return value
