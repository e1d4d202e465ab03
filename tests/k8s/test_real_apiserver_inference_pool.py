"""The operator's InferencePools against a real ``kube-apiserver`` with the Gateway API
Inference Extension's own CRD installed (v1.6.2, vendored in ``tests/k8s/data/gie/``):
the server judges every pool the runtime writes (its schema and CEL rules, strict field
validation), and the runtime writes them, and labels a Ready slot's pod, with only the
chart's RBAC (``runtime: kubernetes``, ``inferencePool.enabled``: a ServiceAccount
token), which must equal what it sent in the audit log. The envtest tier: skipped unless
the binaries are built (``tools/k8s/build.sh``) or ``SLOTCTL_K8S_APISERVER=1`` asks for it.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller.runtime.kubernetes.poolspec import Picker, PoolWant, pool_body
from tests.k8s import chart, realapi
from tests.k8s.conftest import eventually
from tests.k8s.realapi import ApiError, ApiServer, Kube
from tests.k8s.test_real_apiserver import RBAC_KINDS, admin, api_server, namespace, refused

__all__ = ["admin", "api_server", "namespace"]  # the fixtures, shared with that module
pytestmark = pytest.mark.timeout(300)
GIE = Path(__file__).parent / "data" / "gie"
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
VALUES = {"runtime": "kubernetes", "inferencePool": {"enabled": True}}


@pytest.fixture(scope="module")
def pool_crd(api_server: ApiServer) -> ApiServer:
    assert realapi.install_crds(api_server, GIE) == ["inferencepools.inference.networking.k8s.io"]
    return api_server


def _apply_path(namespace: str, name: str, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"fieldManager": "t", **params}.items())
    return f"{POOLS.format(ns=namespace)}/{name}?{query}"


async def test_the_pools_bodies_pass_the_servers_validation(
    pool_crd: ApiServer, admin: Kube, namespace: str
) -> None:
    want = PoolWant("Qwen/Qwen3-8B", (8080, 8081), frozenset({"a"}))
    for picker in (None, Picker("epp", 9002), Picker("epp", 9002, "FailOpen")):
        body = pool_body("slotctl-qwen", want, namespace, "slotctl", picker)
        resp = await admin.call(
            "PATCH",
            _apply_path(namespace, "slotctl-qwen", force="true", fieldValidation="Strict"),
            body,
            content_type="application/apply-patch+yaml",
        )
        assert resp.status in (200, 201), resp.body  # created, then updated
        assert not resp.warnings, resp.warnings  # nothing unknown, nothing pruned
        stored = resp.body
        assert stored["spec"]["selector"] == body["spec"]["selector"]
        assert stored["spec"]["targetPorts"] == body["spec"]["targetPorts"]
        assert stored["spec"]["appProtocol"] == "http"  # the CRD's default
        assert ("endpointPickerRef" in stored["spec"]) == (picker is not None)
    # the CRD's own rules are live here: what the runtime must never write is refused
    bad = pool_body("slotctl-bad", PoolWant("m", (8080, 8080), frozenset()), namespace, "s")
    err = await refused(_apply(admin, namespace, "slotctl-bad", bad), 422)
    assert "port number must be unique" in err.body["message"]
    no_port = copy.deepcopy(pool_body("slotctl-np", want, namespace, "s", Picker("epp", 1)))
    del no_port["spec"]["endpointPickerRef"]["port"]
    err = await refused(_apply(admin, namespace, "slotctl-np", no_port), 422)
    assert "port is required" in err.body["message"]


async def _apply(admin: Kube, namespace: str, name: str, body: dict[str, Any]) -> Any:
    return await admin.checked(
        "PATCH",
        _apply_path(namespace, name, force="true"),
        body,
        content_type="application/apply-patch+yaml",
    )


@pytest_asyncio.fixture
async def runtime_client(pool_crd: ApiServer, namespace: str, tmp_path: Path) -> AsyncIterator[Any]:
    """A lightkube client holding only the chart's RBAC (a ServiceAccount token)."""
    from lightkube import AsyncClient, KubeConfig

    docs = chart.render({**VALUES, "watchNamespaces": [namespace]}, namespace=namespace)
    realapi.apply(pool_crd, [d for d in docs if d["kind"] in RBAC_KINDS])
    token = realapi.service_account_token(pool_crd, namespace, "slotctl")
    config = pool_crd.kubeconfig(tmp_path / "kubeconfig", token, namespace)
    client = AsyncClient(config=KubeConfig.from_file(str(config)))
    try:
        yield client
    finally:
        await client.close()


async def test_the_runtime_writes_pools_and_labels_with_the_charts_rbac(
    pool_crd: ApiServer, admin: Kube, namespace: str, runtime_client: Any
) -> None:
    from controller.runtime.kubernetes.pools import InferencePools
    from controller.runtime.kubernetes.runtime import KubernetesRuntime
    from controller.runtime.kubernetes.spec import deployment_body, without_nulls
    from tests.integration.helpers import demo_launch

    # a slot's objects as the runtime makes them, its pod Running (no kubelet here)
    launch = demo_launch("chat", runtime="kubernetes", image="slotctl:test", port=8080)
    await admin.checked(
        "PATCH",
        f"/apis/apps/v1/namespaces/{namespace}/deployments/slotctl-chat?fieldManager=t",
        without_nulls(deployment_body(launch, namespace, replicas=0)),
        content_type="application/apply-patch+yaml",
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "slotctl-chat-x",
            "namespace": namespace,
            "labels": {"slotctl.managed": "true", "slotctl.slot": "chat"},
        },
        "spec": {
            # no controller-manager here makes a namespace's "default" ServiceAccount
            "serviceAccountName": "slotctl",
            "automountServiceAccountToken": False,
            "containers": [{"name": "server", "image": "slotctl:test"}],
        },
    }
    await admin.create(pod)
    running = {"status": {"phase": "Running", "podIP": "10.1.2.3"}}
    await admin.patch("pods", "slotctl-chat-x", running, sub="status")

    runtime = KubernetesRuntime(runtime_client, namespace=namespace)
    try:
        await runtime.warm_up()
        pools = InferencePools(runtime, Picker("epp", 9002))
        want = PoolWant("demo-chat", (8080,), frozenset({"chat"}))

        async def labelled(value: str | None) -> bool:
            found = await admin.get("pods", "slotctl-chat-x")
            return (
                bool(found) and (found["metadata"].get("labels") or {}).get("slotctl.pool") == value
            )

        async def cached() -> bool:
            return bool(runtime.cache.slot_pods("chat"))

        await eventually(cached, "the pod in the runtime's cache")
        await pools.keep({"slotctl-demo-chat": want})
        stored = await admin.checked("GET", f"{POOLS.format(ns=namespace)}/slotctl-demo-chat")
        assert stored["spec"]["targetPorts"] == [{"number": 8080}]
        assert stored["spec"]["endpointPickerRef"]["name"] == "epp"
        assert await labelled("slotctl-demo-chat")
        await pools.keep({"slotctl-demo-chat": PoolWant("demo-chat", (8080,), frozenset())})
        assert await labelled(None)
        await pools.keep({})
        with pytest.raises(ApiError):
            await admin.checked("GET", f"{POOLS.format(ns=namespace)}/slotctl-demo-chat")
    finally:
        await runtime.close()

    # the chart's rules for pools and pods' labels are exactly what was sent
    sent = pool_crd.requests_of(f"system:serviceaccount:{namespace}:slotctl")
    group = "inference.networking.k8s.io"
    used = {p for p in sent if p[2] == "inferencepools" or p == ("patch", "", "pods")}
    assert used == {
        ("list", group, "inferencepools"),
        ("patch", group, "inferencepools"),
        ("delete", group, "inferencepools"),
        ("patch", "", "pods"),
    }
    docs = chart.render({**VALUES, "watchNamespaces": [namespace]}, namespace=namespace)
    _, roles = chart.permissions(docs)
    granted = {p for p in roles[namespace] if p[2] == "inferencepools"}
    # create: a server-side apply that creates an object is authorized as create too
    assert granted == {(v, g, r) for (v, g, r) in used if r == "inferencepools"} | {
        ("create", group, "inferencepools")
    }
