"""The README's quickstart on the real control plane (``tests/k8s/realcluster.py``: etcd,
kube-apiserver, controller-manager, scheduler, kwok nodes), with InferencePools.

``slotctl stack export --format crd`` of ``examples/quickstart`` (``demo`` slots without
``server.image``) applied as it is; ``slotctl operator --runtime kubernetes
--inference-pools`` with the chart's RBAC for ``runtime: kubernetes`` and
``inferencePool.enabled`` (a ServiceAccount token), the operator's image named by
``SLOTCTL_K8S_IMAGE`` (a ``slotctl`` image: the tier's container runtime gives it
slotctl's entrypoint, :mod:`tests.k8s.images`), the Gateway API Inference Extension's
CRD (v1.6.2, ``tests/k8s/data/gie/``) installed. The autoload slots come up on the
operator's image, their pods carry their model's pool label, the pools pass the real API
server's validation, and the chart's RBAC equals what the operator sent (audit log).
Skipped when the binaries are not built, unless ``SLOTCTL_K8S_APISERVER=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.k8s import chart, realapi, realcluster
from tests.k8s.chart import permissions
from tests.k8s.conftest import eventually
from tests.k8s.realapi import Kube
from tests.k8s.realcluster import Cluster
from tests.k8s.test_kubernetes_quickstart import OWN_IMAGE, exported_quickstart
from tests.k8s.test_operator import answers
from tests.k8s.test_real_control_plane import RBAC_KINDS, bin_dir, cluster, ready

__all__ = ["bin_dir", "cluster"]  # the fixtures, used by name
pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
GROUP = "inference.networking.k8s.io"


async def test_the_quickstart_with_inference_pools_on_the_real_control_plane(
    cluster: Cluster, tmp_path: Path
) -> None:
    realapi.install_crds(cluster.api, REPO / "tests" / "k8s" / "data" / "gie")
    cluster.add_node("node-a", gpus=1, gib_per_gpu=16)
    namespace = f"t-{uuid.uuid4().hex[:6]}"
    realapi.create_namespace(cluster.api, namespace)
    realcluster.wait_service_account(cluster.api, namespace)
    values = {
        "watchNamespaces": [namespace],
        "runtime": "kubernetes",
        "inferencePool": {"enabled": True},
    }
    docs = chart.render(values, namespace)
    realapi.apply(cluster.api, [d for d in docs if d["kind"] in RBAC_KINDS])
    token = realapi.service_account_token(cluster.api, namespace, "slotctl")
    kubeconfig = cluster.api.kubeconfig(tmp_path / "operator.kubeconfig", token=token)
    state = tmp_path / "state"
    (state / "config").mkdir(parents=True)
    environ = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PYTHONPATH": str(REPO),
        "SLOTCTL_K8S_NAMESPACE": namespace,
        "SLOTCTL_K8S_IMAGE": OWN_IMAGE,
    }
    for name in ("SLOTCTL_CONFIG_DIR", "SLOTCTL_STATE_DIR", "KUBERNETES_SERVICE_HOST"):
        environ.pop(name, None)
    command = [sys.executable, "-m", "controller", "operator", "-n", namespace]
    command += ["--runtime", "kubernetes", "--inference-pools"]
    command += ["--state-dir", str(state), "--config-dir", str(state / "config")]
    log = tmp_path / "operator.log"
    admin = Kube(cluster.api, cluster.api.admin_token, namespace)
    with log.open("ab") as out:
        proc = subprocess.Popen(command, env=environ, stdout=out, stderr=subprocess.STDOUT)
    try:
        for obj in exported_quickstart():
            obj["metadata"]["namespace"] = namespace
            await admin.create(obj)
        pools = f"/apis/{GROUP}/v1/namespaces/{namespace}/inferencepools"

        async def pod_labels(slot: str) -> dict[str, str]:
            found = await admin.checked(
                "GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector=slotctl.slot%3D{slot}"
            )
            live = [p for p in found["items"] if not p["metadata"].get("deletionTimestamp")]
            return dict(live[0]["metadata"].get("labels") or {}) if live else {}

        for name, model in (("chat", "demo-chat"), ("embed", "demo-embed")):
            obj = await eventually(lambda n=name: ready(admin, n), f"{name} Ready", 120)
            assert await answers(obj["status"]["endpoint"])

            async def labelled(n: str = name, m: str = model) -> bool:
                return (await pod_labels(n)).get("slotctl.pool") == f"slotctl-{m}"

            await eventually(labelled, f"{name}'s pod in its model's pool", 30)
            pool: dict[str, Any] = await admin.checked("GET", f"{pools}/slotctl-{model}")
            port = int(obj["status"]["endpoint"].rsplit(":", 1)[1])
            assert pool["spec"]["targetPorts"] == [{"number": port}]
            deployment = await admin.checked(
                "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/slotctl-{name}"
            )
            (container,) = deployment["spec"]["template"]["spec"]["containers"]
            assert container["image"] == OWN_IMAGE and container["command"] == ["python3"]
        assert "Forbidden" not in log.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        await admin.close()
    # the chart's grants on pools and pods equal what the operator sent
    sent = cluster.api.requests_of(f"system:serviceaccount:{namespace}:slotctl")
    cluster_wide, roles = permissions(docs)
    granted = {p for p in cluster_wide | roles[namespace] if p[2] in ("inferencepools", "pods")}
    used = {p for p in sent if p[2] in ("inferencepools", "pods")}
    # create: a server-side apply's; deletes (a pool, a lost node's pod): the other tiers'
    implied = {
        ("create", GROUP, "inferencepools"),
        ("delete", GROUP, "inferencepools"),
        ("delete", "", "pods"),
    }
    assert used <= granted, f"the chart's RBAC misses {sorted(used - granted)}"
    assert granted <= used | implied, f"unused grants {sorted(granted - used - implied)}"
