"""The kubernetes runtime alone against KMock and the fake kubelet (:mod:`tests.k8s.kubelet`),
for what a real cluster does between "scaled" and "gone": a pod that terminates for a while,
a container that crash-loops or cannot pull its image, a start cancelled or refused after
the Deployment was scaled up, two operators (owners) in one namespace, a node reading
that fails in an unexpected way, and a watch that lags behind the runtime's own write.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient, KubeConfig

from controller.model.errors import SlotSpawnFailed
from controller.runtime.kubernetes.runtime import KubernetesRuntime
from tests.integration.helpers import demo_launch
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.kubelet import Kubelet, declare_workloads, gpu_node

pytestmark = pytest.mark.timeout(90)
IMAGE = "slotctl:test"


@pytest.fixture
async def kubelet(cluster: Cluster, tmp_path: Path) -> AsyncIterator[Kubelet]:
    declare_workloads(cluster.emulator)
    kube = Kubelet(cluster, tmp_path)
    await kube.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=8))
    kube.start()
    try:
        yield kube
    finally:
        await kube.stop()


@contextlib.asynccontextmanager
async def runtime(cluster: Cluster, **options: object) -> AsyncIterator[KubernetesRuntime]:
    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    options.setdefault("unschedulable_s", 5.0)
    rt = KubernetesRuntime(client, namespace="default", **options)  # type: ignore[arg-type]
    try:
        yield rt
    finally:
        await rt.close()
        await client.close()


async def replicas(kubelet: Kubelet, slot: str) -> int | None:
    dep = await kubelet.get("deployments", f"slotctl-{slot}")
    return None if dep is None else int(dep["spec"].get("replicas") or 0)


async def test_stop_returns_once_the_terminating_pod_is_gone(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """The server keeps serving 1.5 s after SIGTERM: its pod terminates (deletionTimestamp
    set) that long; stop returns only then, with the process gone, and a second stop
    (now at 0 with no pod) removes the Deployment."""
    async with runtime(cluster, termination_grace_s=60) as rt:
        launch = demo_launch("slow", ["--slow-stop", "1.5"], runtime="kubernetes", image=IMAGE)
        started = await rt.start(launch)
        assert started.running and kubelet.alive("slow")
        loop = asyncio.get_running_loop()
        began = loop.time()
        # a generous bound: a loaded machine must not turn the wait into a timeout
        stopped = await rt.stop("slow", 45.0)
        assert stopped.status.value == "exited"
        assert loop.time() - began >= 1.4  # it waited for the terminating pod
        assert not kubelet.alive("slow")
        assert await kubelet.get("deployments", "slotctl-slow") is not None  # only scaled
        assert (await rt.stop("slow", 1.0)).message == "Deployment removed"
        assert await kubelet.get("deployments", "slotctl-slow") is None


async def test_inspect_of_a_terminating_pod_says_so(cluster: Cluster, kubelet: Kubelet) -> None:
    # The server lingers 12 s after SIGTERM: the window in which inspect must see the
    # terminating pod, wide enough for a loaded machine (the check itself is a poll).
    async with runtime(cluster, termination_grace_s=60) as rt:
        launch = demo_launch("linger", ["--slow-stop", "12"], runtime="kubernetes", image=IMAGE)
        await rt.start(launch)
        stopping = asyncio.create_task(rt.stop("linger", 60.0))

        async def terminating() -> bool:
            return "terminating" in (await rt.inspect("linger")).message

        await eventually(terminating, "the pod reported terminating", timeout=30)
        assert kubelet.alive("linger") and not stopping.done()
        await stopping
        assert not kubelet.alive("linger")


async def test_a_crash_looping_server_fails_the_start_with_its_exit_code(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """The server exits at once (a bad flag: argparse's status 2); the pod stays Running
    with its container in CrashLoopBackOff: the start fails promptly with the exit code,
    and the Deployment is scaled back to 0."""
    kubelet.start_latency_s = 10.0  # it exits before its container is reported running
    async with runtime(cluster, start_timeout_s=60) as rt:
        launch = demo_launch("crashy", ["--crash-after", "-1"], runtime="kubernetes", image=IMAGE)
        async with asyncio.timeout(15):  # well before start_timeout_s
            with pytest.raises(SlotSpawnFailed, match=r"CrashLoopBackOff.*exit code 2") as err:
                await rt.start(launch)
        assert err.value.details["exit_code"] == 2
        assert await replicas(kubelet, "crashy") == 0
        await eventually(lambda: _no_pod(kubelet, "crashy"), "the pod gone", timeout=10)


async def test_an_image_that_cannot_be_pulled_fails_the_start(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    async with runtime(cluster, start_timeout_s=60) as rt:
        launch = demo_launch("nopull", runtime="kubernetes", image="unpullable/server:1")
        async with asyncio.timeout(15):
            with pytest.raises(SlotSpawnFailed, match=r"ErrImagePull.*unpullable/server:1"):
                await rt.start(launch)
        assert await replicas(kubelet, "nopull") == 0


async def test_a_cancelled_start_scales_back_to_0(cluster: Cluster, kubelet: Kubelet) -> None:
    """Cancelled while its pod waits for a node (an unload, a shutdown): no pod is left to
    start later behind the controller's back."""
    async with runtime(cluster, unschedulable_s=60) as rt:
        launch = demo_launch("parked", runtime="kubernetes", image=IMAGE)
        launch = dataclasses.replace(launch, node="no-such-node", device="gpu")
        start = asyncio.create_task(rt.start(launch))
        await eventually(lambda: _scaled(kubelet, "parked", 1), "scaled to 1", timeout=10)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert await replicas(kubelet, "parked") == 0


async def test_two_owners_in_one_namespace_leave_each_other_alone(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """Two releases (owners) in one namespace: each lists, adopts and cleans up only its
    own slots; the other's Deployment of a name it wants is reported and left alone."""
    async with runtime(cluster, owner="rel-a") as a, runtime(cluster, owner="rel-b") as b:
        x = demo_launch("x", runtime="kubernetes", image=IMAGE)
        y = demo_launch("y", runtime="kubernetes", image=IMAGE)
        assert (await a.start(x)).running
        assert (await b.start(y)).running
        assert [o.slot for o in await a.list_managed()] == ["x"]
        assert [o.slot for o in await b.list_managed()] == ["y"]

        # b's orphan sweep would stop "x" if it listed it; asked directly, it touches nothing
        observed = await b.stop("x", 1.0)
        assert observed.managed is False and "slotctl.owner=rel-b" in observed.message
        assert await replicas(kubelet, "x") == 1 and kubelet.alive("x")
        with pytest.raises(SlotSpawnFailed, match="unmanaged Deployment"):
            await b.start(dataclasses.replace(x, port=y.port))
        dep = await kubelet.get("deployments", "slotctl-x")
        assert dep is not None and dep["metadata"]["labels"]["slotctl.owner"] == "rel-a"
        assert "slotctl.owner" not in dep["spec"]["selector"]["matchLabels"]
        svc = await kubelet.get("services", "slotctl-x")
        assert svc is not None and svc["metadata"]["labels"]["slotctl.owner"] == "rel-a"

        # a restarted operator of release a adopts its running slot (no second pod)
        async with runtime(cluster, owner="rel-a") as again:
            pods = len(kubelet.created)
            assert (await again.start(x)).running
            assert len(kubelet.created) == pods


async def test_a_failing_cache_handler_is_logged_and_the_watch_goes_on(
    cluster: Cluster, kubelet: Kubelet, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure in handling a change (a bug, a malformed Node) is logged; the cache keeps
    the object and the watch goes on: a later change still arrives (the 0.2 s polls of
    the nodes this replaces had the same guarantee)."""

    class Flaky(KubernetesRuntime):
        calls = 0

    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    rt = Flaky(client, namespace="default")
    real = rt.cache._node_event

    def flaky(kind: str, old: Any, new: Any) -> None:
        Flaky.calls += 1
        if Flaky.calls == 1:
            raise KeyError("allocatable")
        real(kind, old, new)

    rt.cache.nodes.on_event = flaky
    try:
        with caplog.at_level(logging.ERROR, logger="slotctl.runtime"):
            async with asyncio.timeout(5):  # not the 10 s wait for a first listing
                assert (await rt.inspect("none")).status.value == "missing"
            assert "default/gpu-a" in rt.cache.nodes.items or "gpu-a" in rt.cache.nodes.items
            await kubelet.create(gpu_node("gpu-b", gpus=1, gib_per_gpu=16))
            found = lambda: _true("gpu-b" in {n.name for n in rt.memory.cluster()})  # noqa: E731
            await eventually(found, "a later node seen", 5)
        assert Flaky.calls >= 2
        assert any("allocatable" in str(r.exc_info) for r in caplog.records if r.exc_info)
    finally:
        await rt.close()
        await client.close()


async def _no_pod(kubelet: Kubelet, slot: str) -> bool:
    return not [n for n in kubelet.pods if n.startswith(f"slotctl-{slot}-")]


async def _scaled(kubelet: Kubelet, slot: str, wanted: int) -> bool:
    return await replicas(kubelet, slot) == wanted


async def _true(value: bool) -> bool:
    return value


async def test_a_start_waits_for_a_watch_that_lags_behind_its_apply(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """A watch delivers an event a moment after the write it follows (on a loaded API
    server, longer): a start whose Deployment the cache has not seen yet waits for it; it
    does not take the missing Deployment for one deleted meanwhile."""
    async with runtime(cluster) as rt:
        await rt.cache.synced(10)
        informer = rt.cache.deployments
        deliver = informer._on_line
        loop = asyncio.get_running_loop()
        lagged: list[str] = []

        def late(line: str) -> None:  # every event of the Deployments, 0.5 s late, in order
            lagged.append(line)
            loop.call_later(0.5, deliver, line)

        informer._on_line = late  # type: ignore[method-assign]
        started = await rt.start(demo_launch("lag", runtime="kubernetes", image=IMAGE))
        assert started.running and kubelet.alive("lag")
        assert lagged  # the Deployment did reach the cache through the lagging watch
