"""The kubernetes runtime end to end on a real control plane (:mod:`tests.k8s.realcluster`):
kube-apiserver, kube-controller-manager, kube-scheduler and kwok's simulated GPU nodes,
with real demo servers on the pods' IPs and ``slotctl operator --runtime kubernetes``
as a subprocess holding only the chart's RBAC (a ServiceAccount token).

What KMock cannot show: the real scheduler binds the pods the controller placed (and
refuses what it cannot see: a node out of pod slots), the real Deployment and ReplicaSet
controllers make and remove them, garbage collection, server-side apply and field
managers, a node going not ready, ``kubectl get slots``' printer columns, and least
privilege from the server's audit log.

Skipped when the binaries are not built (``tools/k8s/build.sh``), unless
``SLOTCTL_K8S_APISERVER=1`` asks for the real tiers (``make test`` then builds them first):
then a missing build fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.integration.helpers import free_ports
from tests.k8s import chart, realapi, realcluster
from tests.k8s.conftest import eventually
from tests.k8s.realapi import Kube
from tests.k8s.realcluster import Cluster
from tests.k8s.test_operator import adapter, alias, answers, condition
from tests.k8s.test_real_apiserver import stop_operator

REPO = Path(__file__).resolve().parents[2]
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
NODE_LOST_S = 2  # the operator's SLOTCTL_K8S_NODE_LOST_S here
PENDING_S = 3  # its SLOTCTL_K8S_PENDING_S
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    """The built binaries (module-scoped: this module's tests run one after another on
    one worker of a parallel run, each control plane being a handful of processes)."""
    found = realcluster.binaries()
    if found is None:
        message = f"the control plane and kwok are not built in {realapi.cache_dir()}"
        if realapi.requested():
            pytest.fail(f"SLOTCTL_K8S_APISERVER=1 but {message} (run tools/k8s/build.sh)")
        pytest.skip(f"{message}: run tools/k8s/build.sh or set SLOTCTL_K8S_APISERVER=1")
    return found


@pytest.fixture
def cluster(tmp_path: Path, bin_dir: Path) -> Iterator[Cluster]:
    with realcluster.running(tmp_path / "cluster", bin_dir) as running:
        realapi.install_crds(running.api, REPO / "crds")
        yield running


@dataclass
class Env:
    cluster: Cluster
    namespace: str
    admin: Kube
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def kubectl(self, *args: str) -> str:
        return self.cluster.kubectl("-n", self.namespace, *args)

    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:slotctl"


@pytest_asyncio.fixture
async def env(cluster: Cluster, tmp_path: Path) -> AsyncIterator[Env]:
    """A namespace, the chart's RBAC for ``runtime: kubernetes`` there, and the operator
    (``slotctl operator -n NS --runtime kubernetes``) with that ServiceAccount's token."""
    namespace = f"t-{uuid.uuid4().hex[:6]}"
    realapi.create_namespace(cluster.api, namespace)
    realcluster.wait_service_account(cluster.api, namespace)
    docs = chart.render({"watchNamespaces": [namespace], "runtime": "kubernetes"}, namespace)
    realapi.apply(cluster.api, [d for d in docs if d["kind"] in RBAC_KINDS])
    token = realapi.service_account_token(cluster.api, namespace, "slotctl")
    kubeconfig = cluster.api.kubeconfig(tmp_path / "operator.kubeconfig", token=token)
    admin = Kube(cluster.api, cluster.api.admin_token, namespace)
    env = Env(cluster, namespace, admin, tmp_path / "operator.log")
    state = tmp_path / "state"
    (state / "config").mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "controller",
        "operator",
        "--namespace",
        namespace,
        "--runtime",
        "kubernetes",
        "--state-dir",
        str(state),
        "--config-dir",
        str(state / "config"),
    ]
    environ = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PYTHONPATH": str(REPO),
        "SLOTCTL_K8S_NAMESPACE": namespace,
        "SLOTCTL_K8S_NODE_LOST_S": str(NODE_LOST_S),
        "SLOTCTL_K8S_PENDING_S": str(PENDING_S),
    }
    for name in ("SLOTCTL_CONFIG_DIR", "SLOTCTL_STATE_DIR", "KUBERNETES_SERVICE_HOST"):
        environ.pop(name, None)
    with env.log.open("ab") as out:
        env.proc = subprocess.Popen(command, env=environ, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield env
    finally:
        if env.proc.poll() is None:
            env.proc.kill()
            env.proc.wait()
        await admin.close()


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
        "port": port,
        "autoload": True,
        "server": {"image": "slotctl:test", "extra_args": ["--load-seconds", "0.2"]},
        **spec,
    }
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Slot",
        "metadata": {"name": name},
        "spec": body,
    }


async def ready(kube: Kube, name: str) -> dict[str, Any] | None:
    obj = await kube.get("slots", name)
    return obj if condition(obj, "Ready").get("status") == "True" else None


async def _deployment(env: Env, slot_name: str) -> dict[str, Any] | None:
    status, body = env.cluster.api.request(
        "GET", f"/apis/apps/v1/namespaces/{env.namespace}/deployments/slotctl-{slot_name}"
    )
    return body if status == 200 else None


def refusals(env: Env, code: str) -> list[str]:
    return [line for line in env.log.read_text().splitlines() if f"[{code}]" in line]


async def test_slots_are_placed_across_nodes_and_come_up_together(env: Env) -> None:
    """Three unpinned 10 GiB slots on three one-GPU nodes, one without GPU feature
    discovery's labels: the controller places each on its own node at once (no slot
    waits for another's pod to land, none waits forever for a memory label), pins it
    there, and the real scheduler binds it; each is probed at its pod's IP. A fourth fits
    nowhere: it waits, nothing is overcommitted (no pod for it), and it starts when a
    GPU frees. Deleting a Slot deletes its Deployment and Service."""
    for name, gib in (("gpu-a", 16), ("gpu-b", 16), ("gpu-c", None)):
        env.cluster.add_node(name, gpus=1, gib_per_gpu=gib)
    ports = free_ports(4)
    await env.admin.create(model("m10", 10))
    for i, name in enumerate(("s1", "s2", "s3")):
        await env.admin.create(slot(name, "m10", ports[i]))
    objs = {}
    for name in ("s1", "s2", "s3"):
        objs[name] = await eventually(lambda n=name: ready(env.admin, n), f"{name} Ready", 120)
    nodes = {obj["status"]["node"] for obj in objs.values()}
    assert nodes == {"gpu-a", "gpu-b", "gpu-c"}, nodes
    for name, obj in objs.items():
        endpoint = obj["status"]["endpoint"]
        assert endpoint.startswith("http://127.1.") and await answers(endpoint), endpoint
        dep = await _deployment(env, name)
        assert dep is not None
        affinity = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        term = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
        assert term["matchFields"][0]["values"] == [obj["status"]["node"]]
    # none of them was ever refused for memory: they were placed at once, side by side
    assert not refusals(env, "model.insufficient_memory"), env.log.read_text()[-3000:]
    assert "admitted there by GPU count" in env.log.read_text()  # gpu-c, said once
    assert env.log.read_text().count("admitted there by GPU count") == 1

    table = env.kubectl("get", "slots")
    header = table.splitlines()[0].split()
    assert header == ["NAME", "STATE", "REASON", "MODEL", "PORT", "NODE", "READY", "AGE"], table

    # a fourth fits nowhere: it waits, and nothing runs for it (no Pending pod either)
    await env.admin.create(slot("s4", "m10", ports[3]))

    async def waiting() -> dict[str, Any] | None:
        obj = await env.admin.get("slots", "s4")
        return (
            obj if ((obj or {}).get("status") or {}).get("reason") == "WaitingForMemory" else None
        )

    await eventually(waiting, "s4 waits", 60)
    assert "WaitingForMemory" in env.kubectl("get", "slots", "s4")
    dep = await _deployment(env, "s4")
    assert dep is None or dep["spec"]["replicas"] == 0
    # a GPU frees: s4 takes it
    freed = objs["s1"]["status"]["node"]
    await env.admin.delete("slots", "s1")
    s4 = await eventually(lambda: ready(env.admin, "s4"), "s4 Ready once a GPU freed", 120)
    assert s4["status"]["node"] == freed
    # s1's Deployment and Service go (the resync after its finalizer removes them)
    await eventually(lambda: _none(_deployment(env, "s1")), "s1's Deployment deleted", 60)
    status, _ = env.cluster.api.request(
        "GET", f"/api/v1/namespaces/{env.namespace}/services/slotctl-s1"
    )
    assert status == 404
    assert env.proc is not None and await stop_operator(env.proc) == 0


async def _none(value: Any) -> bool:
    return await value is None


async def test_a_user_scaling_a_slot_down_is_undone(env: Env) -> None:
    """``kubectl scale --replicas=0`` and ``kubectl label`` on a slot's Deployment are
    drift: the runtime's server-side apply puts its fields back (another field manager's
    label stays), and the slot serves again."""
    env.cluster.add_node("gpu-a", gpus=1, gib_per_gpu=16)
    (port,) = free_ports(1)
    await env.admin.create(model("m2", 2))
    await env.admin.create(slot("chat", "m2", port))
    await eventually(lambda: ready(env.admin, "chat"), "chat Ready", 120)
    env.kubectl("scale", "deployment/slotctl-chat", "--replicas=0")
    env.kubectl("label", "deployment/slotctl-chat", "slotctl.stack=other", "team=ml", "--overwrite")

    async def put_back() -> dict[str, Any] | None:
        dep = await _deployment(env, "chat")
        labels = (dep or {}).get("metadata", {}).get("labels") or {}
        if dep and dep["spec"]["replicas"] == 1 and labels.get("slotctl.stack") == "kubernetes":
            return dep
        return None

    dep = await eventually(put_back, "the Deployment put back", 60)
    assert dep["metadata"]["labels"]["team"] == "ml"  # not slotctl's field: left alone
    managers = {m["manager"] for m in dep["metadata"]["managedFields"]}
    assert "slotctl" in managers
    obj = await eventually(lambda: ready(env.admin, "chat"), "chat Ready again", 120)
    assert await answers(obj["status"]["endpoint"])
    assert "changed outside slotctl" in env.log.read_text()
    assert env.proc is not None and await stop_operator(env.proc) == 0


async def test_a_node_going_not_ready_moves_its_slot(env: Env) -> None:
    """The node of a running slot stops answering (its kubelet gone): within the
    runtime's node_lost_s the slot fails, its pod there is deleted with grace 0 (no
    kubelet there to stop it), and it is placed on the other node and serves there.
    The operator's requests, from the audit log, are exactly what the chart grants
    (this test sends the one rule the others do not: ``delete`` of a pod)."""
    env.cluster.add_node("gpu-a", gpus=1, gib_per_gpu=16)
    env.cluster.add_node("gpu-b", gpus=1, gib_per_gpu=16)
    (port,) = free_ports(1)
    await env.admin.create(model("m2", 2))
    await env.admin.create(slot("chat", "m2", port))
    first = await eventually(lambda: ready(env.admin, "chat"), "chat Ready", 120)
    lost = first["status"]["node"]
    # an Alias rides along: the audit below judges the chart's grants on aliases too
    await env.admin.create(alias("assistant", "m2", namespace=env.namespace))

    async def alias_ready() -> dict[str, Any] | None:
        found = await env.admin.get("aliases", "assistant")
        return found if condition(found, "Ready").get("status") == "True" else None

    await eventually(alias_ready, "the Alias Ready", 60)
    # and an Adapter: the chart's grants on adapters too
    await env.admin.create(adapter("sql", "m2", "hf://org/lora/sql", namespace=env.namespace))

    async def adapter_ready() -> dict[str, Any] | None:
        found = await env.admin.get("adapters", "sql")
        return found if condition(found, "Ready").get("status") == "True" else None

    await eventually(adapter_ready, "the Adapter Ready", 60)
    began = time.monotonic()
    env.cluster.lose_node(lost)

    async def moved() -> dict[str, Any] | None:
        obj = await ready(env.admin, "chat")
        return obj if obj is not None and obj["status"]["node"] != lost else None

    obj = await eventually(moved, "chat moved to the other node", 90)
    took = time.monotonic() - began
    assert await answers(obj["status"]["endpoint"])
    # stated in docs/kubernetes.md: node_lost_s, then a load (a few seconds here)
    assert took < NODE_LOST_S + 30, took
    assert "deleted with grace 0" in env.log.read_text()
    print(f"moved in {took:.1f}s")
    # and the rest of a slot's life, for the audit below: delete (Deployment, Service)
    await env.admin.delete("slots", "chat")
    await eventually(lambda: _none(_deployment(env, "chat")), "chat's Deployment deleted", 90)
    assert env.proc is not None and await stop_operator(env.proc) == 0
    used = env.cluster.api.requests_of(env.user())
    docs = chart.render({"watchNamespaces": [env.namespace], "runtime": "kubernetes"})
    cluster_perms, roles = chart.permissions(docs)
    allowed = cluster_perms | {p for perms in roles.values() for p in perms}
    # a server-side apply that creates an object is a PATCH (the API server authorizes
    # it as create as well): the audit log records the PATCH
    implied = {("create", g, r) for (v, g, r) in used if v == "patch" and r in _APPLIED}
    assert used <= allowed, f"the chart's RBAC misses {sorted(used - allowed)}"
    assert allowed <= used | implied, f"the chart grants unused {sorted(allowed - used)}"
    assert ("delete", "", "pods") in used


_APPLIED = ("deployments", "services")


async def test_a_pod_the_scheduler_leaves_pending_is_reported_and_placed_elsewhere(
    env: Env,
) -> None:
    """What the controller cannot see, the scheduler still checks: a node with a free
    GPU but no room for another pod (its pod count is full). The scheduler leaves the
    slot's pod Pending there; the Slot's status says why (its reason, in its words), and
    after the runtime's unschedulable_s the slot is placed on another node."""
    env.cluster.add_node("gpu-a", gpus=1, gib_per_gpu=16, pods=1)
    other = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "someone-else", "namespace": env.namespace},
        "spec": {"nodeName": "gpu-a", "containers": [{"name": "x", "image": "x"}]},
    }
    assert (
        env.cluster.api.request("POST", f"/api/v1/namespaces/{env.namespace}/pods", other)[0] == 201
    )
    (port,) = free_ports(1)
    await env.admin.create(model("m2", 2))
    await env.admin.create(slot("chat", "m2", port))

    async def pending() -> dict[str, Any] | None:
        obj = await env.admin.get("slots", "chat")
        status = (obj or {}).get("status") or {}
        return obj if status.get("reason") == "Unschedulable" else None

    obj = await eventually(pending, "the scheduler's reason in the status", 60)
    message = condition(obj, "Progressing")["message"]
    assert "Too many pods" in message, obj["status"]
    env.cluster.add_node("gpu-b", gpus=1, gib_per_gpu=16)
    placed = await eventually(lambda: ready(env.admin, "chat"), "chat Ready elsewhere", 120)
    assert placed["status"]["node"] == "gpu-b"
    assert env.proc is not None and await stop_operator(env.proc) == 0


async def test_the_kubectl_columns_match_the_docs(cluster: Cluster) -> None:
    """``kubectl get slots`` prints the columns the README, the chart's NOTES and
    docs/kubernetes.md describe (the CRD's printer columns, as the real server serves
    them)."""
    text = cluster.kubectl("get", "slots", "-A")
    assert text == "" or text.split()[:9] == [
        "NAMESPACE",
        "NAME",
        "STATE",
        "REASON",
        "MODEL",
        "PORT",
        "NODE",
        "READY",
        "AGE",
    ]
    wide = cluster.kubectl(
        "get",
        "crd",
        "slots.slotctl.io",
        "-o",
        "jsonpath={.spec.versions[0].additionalPrinterColumns[*].name}",
    )
    assert wide.split() == ["State", "Reason", "Model", "Port", "Node", "Ready", "Age", "Endpoint"]
    for doc in (REPO / "README.md", REPO / "docs/kubernetes.md"):
        assert "NAME    STATE   REASON" in doc.read_text(), doc
    assert "NAME STATE REASON MODEL PORT NODE READY AGE" in chart.notes({})


def test_the_build_script_builds_the_whole_tier() -> None:
    text = realapi.BUILD.read_text()
    for name in realcluster.NAMES:
        assert name in text
    assert "KWOK_VERSION=v0.8.0" in text and "sigs.k8s.io/kwok/cmd/kwok" in text
    gomod = (REPO / "tools/k8s/cluster/go.mod").read_text()
    assert f"k8s.io/kubernetes {realapi.K8S_VERSION}" in gomod
    staging = realapi.K8S_VERSION.replace("v1.", "v0.")
    replaced = [line for line in gomod.splitlines() if "=>" in line]
    assert replaced and all(line.rstrip().endswith(staging) for line in replaced)


def test_kwok_nodes_stay_ready_past_the_node_monitor_grace_period(
    bin_dir: Path, tmp_path: Path
) -> None:
    """The fixture's nodes renew their leases as kubelets do: a node stays Ready through
    three grace periods of the node lifecycle controller (without leases, kwok's heartbeat
    comes every 10 minutes and the nodes flap NotReady: a slot there is taken for lost)."""
    with realcluster.running(tmp_path / "cluster", bin_dir, node_monitor_grace_s=4) as cluster:
        cluster.add_node("gpu-a", gpus=1, gib_per_gpu=16)
        seen = cluster.ready_seen("gpu-a", 14)
        assert seen and set(seen) == {"True"}, seen
