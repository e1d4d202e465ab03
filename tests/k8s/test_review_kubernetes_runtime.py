"""Reviewer's regression tests of the kubernetes runtime (all three fail on main today).

Scaling a Deployment to 0 makes the ReplicaSet controller *delete* the pod: the API server
sets ``metadata.deletionTimestamp`` and keeps the pod (its server still running, GPU
memory still held) for up to ``terminationGracePeriodSeconds``. ``KubernetesRuntime._pods``
drops pods with a deletionTimestamp, so ``_pods_gone`` reports the pod gone at once and
``stop`` returns EXITED while the server still runs (the fake kubelet deletes pods
instantly, which is why the KMock tier never sees this).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.model.errors import SlotTerminateTimeout
from tests.k8s.conftest import Cluster
from tests.k8s.kubelet import Kubelet, declare_workloads

pytestmark = pytest.mark.timeout(60)

# slotctl.owner: the runtime's default owner (objects of another owner are not its own)
LABELS = {
    "slotctl.managed": "true",
    "slotctl.slot": "slow",
    "slotctl.stack": "s",
    "slotctl.owner": "slotctl",
}


async def test_stop_waits_for_a_terminating_pod(cluster: Cluster, tmp_path: Path) -> None:
    from lightkube import AsyncClient, KubeConfig

    from controller.runtime.kubernetes.runtime import KubernetesRuntime

    declare_workloads(cluster.emulator)
    kube = Kubelet(cluster, tmp_path)  # not started: nothing acts on the objects
    await kube.create(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "slotctl-slow", "labels": LABELS},
            "spec": {
                "replicas": 0,  # already scaled down by a previous stop ...
                "selector": {"matchLabels": {"slotctl.managed": "true", "slotctl.slot": "slow"}},
                "template": {"metadata": {"labels": LABELS}, "spec": {"containers": []}},
            },
        }
    )
    await kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "slotctl-slow-abc",
                "labels": LABELS,
                # ... and its pod is being deleted, still running within its grace period
                "deletionTimestamp": "2026-12-01T00:00:00Z",
                "finalizers": ["test.slotctl.io/hold"],  # KMock: kept while terminating
            },
            "spec": {"containers": [{"name": "server", "image": "x"}], "nodeName": "gpu-a"},
            "status": {"phase": "Running", "podIP": "127.0.0.9"},
        }
    )
    assert await kube.get("pods", "slotctl-slow-abc") is not None
    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    runtime = KubernetesRuntime(
        client, namespace="default", termination_grace_s=0.2, stop_grace_s=0.2
    )
    try:
        # The pod still exists (terminating): the stop must not report the slot stopped,
        # and must not delete the Deployment as if the slot were long unloaded.
        with pytest.raises(SlotTerminateTimeout):
            await runtime.stop("slow", 0.2)
        assert await kube.get("deployments", "slotctl-slow") is not None
    finally:
        await runtime.close()
        await client.close()


async def test_a_crash_looping_pod_fails_the_start_promptly(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A Deployment's pod has ``restartPolicy: Always``: a server that exits at once (or an
    image that cannot be pulled) never makes the pod phase ``Failed``; the kubelet reports
    the container ``waiting`` (``CrashLoopBackOff``, ``ErrImagePull``) with the last exit in
    ``lastState``. ``_wait_running`` only gives up on ``Failed``, unschedulable or
    ``start_timeout_s`` (900 s by default), so such a load hangs for the whole timeout
    where the process and docker runtimes fail it at once."""
    import asyncio

    from lightkube import AsyncClient, KubeConfig

    from controller.model.errors import SlotSpawnFailed
    from controller.runtime.kubernetes.runtime import KubernetesRuntime
    from tests.integration.helpers import demo_launch

    declare_workloads(cluster.emulator)
    kube = Kubelet(cluster, tmp_path)  # not started: this test writes the pod itself
    launch = demo_launch("crashy", runtime="kubernetes", image="slotctl:test")
    wanted = launch.config_hash()

    async def crash_looping_pod() -> None:
        while await kube.get("deployments", "slotctl-crashy") is None:
            await asyncio.sleep(0.05)
        labels = {"slotctl.managed": "true", "slotctl.slot": "crashy"}
        await kube.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "slotctl-crashy-x1",
                    "labels": labels,
                    "annotations": {"slotctl.config-hash": wanted},
                },
                "spec": {"containers": [{"name": "server", "image": "x"}], "nodeName": "n"},
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.9",
                    "containerStatuses": [
                        {
                            "name": "server",
                            "ready": False,
                            "restartCount": 3,
                            "image": "x",
                            "imageID": "",
                            "state": {
                                "waiting": {
                                    "reason": "CrashLoopBackOff",
                                    "message": "back-off 40s restarting failed container",
                                }
                            },
                            "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                        }
                    ],
                },
            }
        )

    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    runtime = KubernetesRuntime(client, namespace="default", start_timeout_s=20)
    writer = asyncio.create_task(crash_looping_pod())
    try:
        async with asyncio.timeout(5):  # well before start_timeout_s
            with pytest.raises(SlotSpawnFailed, match=r"CrashLoopBackOff|exit"):
                await runtime.start(launch)
    finally:
        writer.cancel()
        await runtime.close()
        await client.close()


async def test_a_start_that_fails_after_scaling_up_leaves_no_pod_running(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``_start`` creates (or patches) the Deployment with ``replicas: 1`` before it creates
    the Service and before it waits for the pod. When a later step fails — the API server
    refuses the Service (a real one rejects a Service name over 63 characters, i.e. any
    slot name of 56-63 characters: ``slotctl-`` + name), or a transient API error while
    waiting — ``start`` raises SlotSpawnFailed but leaves the Deployment at 1, and the
    manager's load failure path does not stop (``fail(stop=False)``): a pod keeps running
    and holding its GPU while the slot is in ``error`` and its memory counts nowhere.
    The API's refusal is injected here (KMock checks no names)."""
    import httpx2
    from lightkube import AsyncClient, KubeConfig
    from lightkube.resources.core_v1 import Service

    from controller.model.errors import SlotSpawnFailed
    from controller.runtime.kubernetes.runtime import KubernetesRuntime
    from tests.integration.helpers import demo_launch

    declare_workloads(cluster.emulator)
    kube = Kubelet(cluster, tmp_path)  # not started: nothing runs a pod
    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    real_patch = client.patch

    async def patch(res, *args, **kwargs):  # type: ignore[no-untyped-def]
        if res is Service:  # the Service's server-side apply is refused
            request = httpx2.Request("PATCH", "https://api/api/v1/namespaces/default/services")
            response = httpx2.Response(422, request=request, json={"message": "name too long"})
            raise httpx2.HTTPStatusError("422", request=request, response=response)
        return await real_patch(res, *args, **kwargs)

    client.patch = patch  # type: ignore[method-assign]
    runtime = KubernetesRuntime(client, namespace="default", start_timeout_s=5)
    try:
        launch = demo_launch("svcfail", runtime="kubernetes", image="slotctl:test")
        with pytest.raises(SlotSpawnFailed, match="name too long"):
            await runtime.start(launch)
        dep = await kube.get("deployments", "slotctl-svcfail")
        # a failed start leaves nothing running: the Deployment is back at 0 (or gone)
        assert dep is None or dep["spec"]["replicas"] == 0, dep["spec"]["replicas"]
    finally:
        await runtime.close()
        await client.close()
