"""Surge rollouts on pods (issue 39, item 5) against KMock and the fake kubelet
(:mod:`tests.k8s.kubelet`): a changed Slot whose new server fits beside the old one on a
GPU gets a second instance (``slotctl1-<slot>``) while the old pod serves on, the Service
switches to it once it is ready, then the old instance goes; with no room it is
recreated and the Slot's ``status.rollout`` and an Event say why; an operator SIGKILLed
mid-surge converges on restart (its state dir kept or lost); and the runtime alone,
killed at each step of a surge, converges from the cluster's objects (one Deployment and
one pod of the slot left, objects of others never touched).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from controller.model.errors import SlotSpawnFailed
from controller.runtime.kubernetes.runtime import KubernetesRuntime
from controller.runtime.kubernetes.spec import service_body, switched_service
from controller.runtime.surging import cannot_surge
from controller.store.state import StateStore
from tests.integration.helpers import demo_launch, free_port
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.kubelet import Kubelet, answers, gpu_node
from tests.k8s.test_kubernetes_runtime import IMAGE, model, operator, ready

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


def auto_slot(name: str, model_id: str, *extra: str) -> dict[str, Any]:
    """A Slot that leaves its port to the controller (a declared port always recreates)."""
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Slot",
        "metadata": {"name": name},
        "spec": {
            "provider": "demo",
            "model": {"default": model_id},
            "device": "gpu",
            "autoload": True,
            "server": {"image": IMAGE, "extra_args": ["--load-seconds", "0.1", *extra]},
        },
    }


async def _rollout_done(cluster: Cluster, name: str, generation: int) -> dict[str, Any] | None:
    obj = await ready(cluster, name, generation)
    rollout = ((obj or {}).get("status") or {}).get("rollout") or {}
    return obj if rollout.get("phase") == "done" else None


async def _absent(kubelet: Kubelet, plural: str, name: str) -> bool:
    return await kubelet.get(plural, name) is None


async def test_a_changed_slot_with_room_surges_beside_its_old_pod(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A time-sliced GPU with room for both: the new pod (instance 1) starts beside the
    old one, which keeps answering until the switch; the Service then selects the new
    one, the old instance's pod and Deployment go, and the slot served all along."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    async with operator(cluster, tmp_path / "state", monkeypatch) as op:
        await cluster.create(model("m-chat", 2))
        await cluster.create(auto_slot("chat", "m-chat"))
        first = await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=60)
        (old,) = kubelet.alive("chat")
        assert first["status"]["endpoint"].startswith(f"http://{old.ip}:")

        seen_at_switch: list[tuple[int, bool]] = []
        surge = op.manager.runtime.surge  # type: ignore[attr-defined]
        promote = surge.promote

        async def watched_promote(slot: str) -> None:  # the moment of the switch
            seen_at_switch.append((len(kubelet.alive(slot)), await answers(endpoint)))
            await promote(slot)

        monkeypatch.setattr(surge, "promote", watched_promote)
        endpoint = first["status"]["endpoint"]
        answered: list[bool] = []
        stop = asyncio.Event()

        async def keep_asking() -> None:  # the slot's endpoint, whichever it is now
            while not stop.is_set():
                now = op.manager.view("chat").endpoint
                if now:
                    answered.append(await answers(now))
                await asyncio.sleep(0)

        asking = asyncio.create_task(keep_asking())
        await cluster.edit("slots", "chat", {"server": {"extra_args": ["--load-seconds", "0.3"]}})
        done = await eventually(
            lambda: _rollout_done(cluster, "chat", 2), "the surge done", timeout=90
        )
        stop.set()
        await asking

        rollout = done["status"]["rollout"]
        assert rollout["strategy"] == "surge", rollout
        assert "fits on gpu-a/gpu:0" in rollout["reason"], rollout
        assert seen_at_switch == [(2, True)]  # both pods up, the old one answering
        assert answered and all(answered), f"{answered.count(False)} of {len(answered)} failed"
        (new,) = kubelet.alive("chat")
        assert new.name != old.name and old.process.poll() is not None
        assert new.name.startswith("slotctl1-chat-")
        assert done["status"]["endpoint"].startswith(f"http://{new.ip}:")
        assert await answers(done["status"]["endpoint"])
        await eventually(lambda: _absent(kubelet, "deployments", "slotctl-chat"), "old gone")
        second = await kubelet.get("deployments", "slotctl1-chat")
        assert second is not None and second["metadata"]["annotations"]["slotctl.surge"] == "false"
        service = await kubelet.get("services", "slotctl-chat")
        assert service is not None
        assert service["spec"]["selector"]["slotctl.instance"] == "1"
        assert service["metadata"]["annotations"]["slotctl.instance"] == "1"
        events = await cluster.events()
        assert any(e.get("reason") == "RolloutSurge" for e in events), events

        # and back: the next change surges into instance 0 again
        await cluster.edit("slots", "chat", {"server": {"extra_args": ["--load-seconds", "0.2"]}})
        await eventually(lambda: _rollout_done(cluster, "chat", 3), "the second surge", 90)
        await eventually(lambda: _absent(kubelet, "deployments", "slotctl1-chat"), "1 gone")
        (third,) = kubelet.alive("chat")
        assert third.name.startswith("slotctl-chat-")
        assert len([p for p in kubelet.created if "chat" in p]) == 3  # no pod but these


async def test_no_room_recreates_and_the_status_says_why(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One whole GPU (not time-sliced), held by the slot's own pod: no room for a second
    server, so the change recreates, and ``status.rollout`` and an Event say so."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16))
    async with operator(cluster, tmp_path / "state", monkeypatch):
        await cluster.create(model("m-chat", 2))
        await cluster.create(auto_slot("chat", "m-chat"))
        await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=60)
        (old,) = kubelet.alive("chat")
        await cluster.edit("slots", "chat", {"server": {"extra_args": ["--load-seconds", "0.2"]}})
        done = await eventually(
            lambda: _rollout_done(cluster, "chat", 2), "the recreate done", timeout=90
        )
        rollout = done["status"]["rollout"]
        assert rollout["strategy"] == "recreate", rollout
        assert rollout["reason"].startswith("no room to surge"), rollout
        (new,) = kubelet.alive("chat")
        assert new.name != old.name and new.name.startswith("slotctl-chat-")
        assert await kubelet.get("deployments", "slotctl1-chat") is None  # never a second
        events = await cluster.events()
        recreate = [e for e in events if e.get("reason") == "RolloutRecreate"]
        assert recreate and "no room to surge" in recreate[0]["message"], events


# ---------------------------------------------------------------------- the runtime alone


@contextlib.asynccontextmanager
async def runtime(cluster: Cluster) -> AsyncIterator[KubernetesRuntime]:
    """A runtime (an operator's) that is dropped at the end without any cleanup: what a
    kill leaves behind stays in the cluster."""
    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    rt = KubernetesRuntime(client, namespace="default", unschedulable_s=5.0)
    try:
        yield rt
    finally:
        await rt.close()
        await client.close()


async def _one_pod(kubelet: Kubelet, slot: str, prefix: str) -> bool:
    pods = kubelet.alive(slot)
    return len(pods) == 1 and pods[0].name.startswith(prefix)


@pytest.mark.parametrize("killed", ["started", "switched", "promoted"])
async def test_a_runtime_killed_mid_surge_converges_on_restart(
    cluster: Cluster, kubelet: Kubelet, killed: str
) -> None:
    """Killed after the new instance started (it is deleted: the old one serves), after
    the Service switched but before the mark was cleared (the promotion finishes, the old
    instance goes), after the promotion (the retiring instance goes): one Deployment and
    one pod of the slot remain, and they serve."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    old = demo_launch("roll", runtime="kubernetes", image=IMAGE)
    new = demo_launch(
        "roll", ["--load-seconds", "0.2"], port=free_port(), runtime="kubernetes", image=IMAGE
    )
    async with runtime(cluster) as rt:
        assert (await rt.start(old)).running
        started = await rt.surge.start_instance(new)
        assert started.running and started.config_hash == new.config_hash()
        assert len(kubelet.alive("roll")) == 2
        assert (await rt.inspect("roll")).config_hash == old.config_hash()  # still the old
        if killed == "switched":  # the first of the promotion's two writes only
            second = rt.cache.instance("roll", "1")
            assert second is not None
            await rt.apply(switched_service(second, "default"))
        elif killed == "promoted":
            await rt.surge.promote("roll")
            assert (await rt.inspect("roll")).config_hash == new.config_hash()
    # the operator is gone; a new one starts and settles the slot from the objects
    async with runtime(cluster) as rt:
        did = await rt.surge.settle("roll")
        assert did is not None
        kept, gone, prefix = (
            (old, "slotctl1-roll", "slotctl-roll-")
            if killed == "started"
            else (new, "slotctl-roll", "slotctl1-roll-")
        )
        observed = await rt.inspect("roll")
        assert observed.running and observed.config_hash == kept.config_hash()
        assert observed.endpoint and await answers(observed.endpoint)
        await eventually(lambda: _one_pod(kubelet, "roll", prefix), "one pod of the slot")
        assert await kubelet.get("deployments", gone) is None
        service = await kubelet.get("services", "slotctl-roll")
        assert service is not None
        want = "0" if killed == "started" else "1"
        assert service["metadata"]["annotations"]["slotctl.instance"] == want
        serving = await kubelet.get("deployments", "slotctl-roll" if want == "0" else gone)
        assert serving is None or serving["metadata"]["annotations"].get("slotctl.surge") != "true"
        assert await rt.surge.settle("roll") is None  # settled: nothing more to do
        assert [o.slot for o in await rt.list_managed()] == ["roll"]


async def test_a_second_instance_name_held_by_another_is_never_touched(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """``slotctl1-<slot>`` held by a Deployment without slotctl's labels: the surge
    refuses to start (the old pod serves on), and a settle leaves it alone."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "slotctl1-mine", "labels": {"app": "theirs"}},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "theirs"}},
            "template": {
                "metadata": {"labels": {"app": "theirs"}},
                "spec": {"containers": [{"name": "c", "image": "theirs"}]},
            },
        },
    }
    await kubelet.create(foreign)
    old = demo_launch("mine", runtime="kubernetes", image=IMAGE)
    new = demo_launch("mine", ["--load-seconds", "0.2"], runtime="kubernetes", image=IMAGE)
    async with runtime(cluster) as rt:
        await rt.start(old)
        with pytest.raises(SlotSpawnFailed, match=r"slotctl1-mine.*does not manage"):
            await rt.surge.start_instance(new)
        assert await rt.surge.settle("mine") is None
        assert not await rt.surge.stop_retiring("mine", 1.0)
        await rt.surge.stop_instance("mine", 1.0)
        assert await kubelet.get("deployments", "slotctl1-mine") is not None
        assert (await rt.inspect("mine")).config_hash == old.config_hash()
        assert len(kubelet.alive("mine")) == 1


async def test_a_switch_the_manager_did_not_finish_is_undone_by_its_stop(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """The promotion failed after the Service's switch (the mark still on): the manager
    abandons the surge (``stop_instance``), so the Service goes back to the old instance,
    which it still serves from, and the new one is deleted."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    old = demo_launch("undo", runtime="kubernetes", image=IMAGE)
    new = demo_launch("undo", ["--load-seconds", "0.2"], runtime="kubernetes", image=IMAGE)
    async with runtime(cluster) as rt:
        await rt.start(old)
        await rt.surge.start_instance(new)
        second = rt.cache.instance("undo", "1")
        assert second is not None
        await rt.apply(switched_service(second, "default"))
        await eventually(lambda: _true(rt.cache.serving("undo") == "1"), "switched")
        await rt.surge.stop_instance("undo", 1.0)
        assert rt.cache.serving("undo") == "0"
        observed = await rt.inspect("undo")
        assert observed.config_hash == old.config_hash() and observed.running
        assert await kubelet.get("deployments", "slotctl1-undo") is None
        service = await kubelet.get("services", "slotctl-undo")
        assert service is not None and service["spec"]["selector"]["slotctl.instance"] == "0"
        await eventually(lambda: _one_pod(kubelet, "undo", "slotctl-undo-"), "the old pod only")


async def _alive(kubelet: Kubelet, slot: str) -> list[Any] | None:
    return kubelet.alive(slot) or None


async def _true(value: bool) -> bool:
    return value


def _operator(cluster: Cluster, state: Path, log: Path) -> subprocess.Popen[bytes]:
    """``slotctl operator --runtime kubernetes`` as a process (so it can be SIGKILLed)."""
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "PYTHONPATH": str(REPO),
        "SLOTCTL_K8S_NAMESPACE": "default",
        "SLOTCTL_K8S_PENDING_S": "5",
    }
    for name in ("SLOTCTL_CONFIG_DIR", "SLOTCTL_STATE_DIR", "KUBERNETES_SERVICE_HOST"):
        env.pop(name, None)
    (state / "config").mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "controller",
        "operator",
        "--namespace",
        "default",
        "--runtime",
        "kubernetes",
        "--state-dir",
        str(state),
        "--config-dir",
        str(state / "config"),
    ]
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


async def _deployments(kubelet: Kubelet, slot: str) -> list[str]:
    found = []
    for name in (f"slotctl-{slot}", f"slotctl1-{slot}"):
        if await kubelet.get("deployments", name) is not None:
            found.append(name)
    return found


@pytest.mark.parametrize("state_kept", [True, False])
async def test_an_operator_killed_mid_surge_converges_on_restart(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, state_kept: bool
) -> None:
    """SIGKILL while the new pod warms beside the old one; a new operator (with the same
    state dir, or a fresh one: a state dir left on another node) finds both: the old one
    is adopted, the interrupted new instance deleted or taken up, the change rolled out
    again; in the end one Deployment and one pod of the slot, serving the new spec."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    log = tmp_path / "operator.log"
    proc = _operator(cluster, tmp_path / "state", log)
    try:
        await cluster.create(model("m-chat", 2))
        await cluster.create(auto_slot("chat", "m-chat"))
        await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=60)
        (old,) = kubelet.alive("chat")
        await cluster.edit("slots", "chat", {"server": {"extra_args": ["--load-seconds", "4"]}})

        async def warming_beside() -> bool:  # the new pod up, its server still loading
            second = await kubelet.get("deployments", "slotctl1-chat")
            return second is not None and len(kubelet.alive("chat")) == 2

        await eventually(warming_beside, "the new pod beside the old one", timeout=60)
        proc.kill()  # SIGKILL: no cleanup of any kind
        proc.wait()
        assert len(kubelet.alive("chat")) == 2  # both left behind
        state = tmp_path / ("state" if state_kept else "state-elsewhere")
        proc = _operator(cluster, state, log)
        done = await eventually(
            lambda: _rollout_done(cluster, "chat", 2), "rolled out after the restart", 120
        )
        assert done["status"]["rollout"]["strategy"] == "surge"

        async def converged() -> bool:
            alive = kubelet.alive("chat")
            return len(alive) == 1 and len(await _deployments(kubelet, "chat")) == 1

        await eventually(converged, "one Deployment and one pod of the slot", timeout=60)
        (pod,) = kubelet.alive("chat")
        assert pod.name != old.name and old.process.poll() is not None
        assert done["status"]["endpoint"].startswith(f"http://{pod.ip}:")
        assert await answers(done["status"]["endpoint"])
        (left,) = await _deployments(kubelet, "chat")
        dep = await kubelet.get("deployments", left)
        assert dep is not None and dep["metadata"]["annotations"].get("slotctl.surge") != "true"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_restart_between_switched_and_the_promotion_keeps_the_old_port(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path
) -> None:
    """The manager writes ``switched`` before it promotes; an operator killed in that gap
    finds the new instance still marked and the Service on the old one: the settle keeps
    the old pod, and recovery keeps the slot's old port with it (the new one recorded,
    the slot would look drifted and roll again). Review of the pod surge, item 3."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    log, state = tmp_path / "operator.log", tmp_path / "state"
    proc = _operator(cluster, state, log)
    try:
        await cluster.create(model("m-chat", 2))
        await cluster.create(auto_slot("chat", "m-chat"))
        await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=60)
        service = await kubelet.get("services", "slotctl-chat")
        assert service is not None
        old_port = int(service["metadata"]["annotations"]["slotctl.port"])
        proc.kill()
        proc.wait()
        new = demo_launch("chat", port=free_port(), runtime="kubernetes", image=IMAGE)
        async with runtime(cluster) as rt:  # the surge's new instance, started and marked
            assert (await rt.surge.start_instance(new)).running
        record = {
            "phase": "switched",
            "port": new.port,
            "old_port": old_port,
            "from": "old",
            "to": new.config_hash(),
            "gpus": [0],
        }
        StateStore(state).write_aux("chat", "rollout.json", record)
        proc = _operator(cluster, state, log)

        async def settled() -> bool:
            return await _deployments(kubelet, "chat") == ["slotctl-chat"] and bool(
                await ready(cluster, "chat")
            )

        await eventually(settled, "the interrupted instance deleted, chat Ready", timeout=60)
        assert StateStore(state).read_port("chat") == old_port
        assert StateStore(state).read_aux("chat", "rollout.json") is None
        service = await kubelet.get("services", "slotctl-chat")
        assert service is not None
        assert service["metadata"]["annotations"]["slotctl.port"] == str(old_port)
        obj = await ready(cluster, "chat")
        assert obj is not None and not (obj.get("status") or {}).get("rollout")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_the_switch_moves_the_pool_label_off_the_retiring_pod(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """The old pod carries ``slotctl.pool`` (the pools' pass put it there): at the switch
    the new pod gets it and the old one loses it, so a gateway sends the draining pod no
    new request before it is scaled to 0. Review of the pod surge, item 2."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    old = demo_launch("pool", runtime="kubernetes", image=IMAGE)
    new = demo_launch("pool", ["--load-seconds", "0.2"], runtime="kubernetes", image=IMAGE)
    async with runtime(cluster) as rt:
        await rt.start(old)
        (first,) = kubelet.alive("pool")
        patch = {"metadata": {"labels": {"slotctl.pool": "slotctl-demo"}}}
        await rt.client().patch(
            Pod, first.name, patch, namespace="default", patch_type=PatchType.MERGE
        )

        async def pool_of(name: str) -> str | None:
            pod = await kubelet.get("pods", name)
            return None if pod is None else pod["metadata"].get("labels", {}).get("slotctl.pool")

        async def in_cache() -> bool:
            pods = rt.cache.slot_pods("pool", "0")
            return any((p.metadata.labels or {}).get("slotctl.pool") for p in pods if p.metadata)

        await eventually(in_cache, "the old pod's pool label in the cache")
        await rt.surge.start_instance(new)
        (second,) = [p for p in kubelet.alive("pool") if p.name != first.name]
        assert await pool_of(second.name) is None  # not in the pool while it warms
        await rt.surge.promote("pool")
        assert first.process.poll() is None  # the old pod still runs (it drains) ...
        assert await pool_of(first.name) is None  # ... outside the pool
        assert await pool_of(second.name) == "slotctl-demo"
        assert await rt.surge.stop_retiring("pool", 5.0)


async def test_a_service_selecting_by_slot_is_made_to_select_the_serving_instance_first(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """A Service that selects by slot alone (written before instance labels) in front of
    labelled pods: before the second pod starts it selects the serving instance by label,
    so the warming pod is never one of its endpoints. Review of the pod surge, item 1."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    old = demo_launch("sel", runtime="kubernetes", image=IMAGE)
    new = demo_launch("sel", ["--load-seconds", "0.2"], runtime="kubernetes", image=IMAGE)
    async with runtime(cluster) as rt:
        await rt.start(old)
        await rt.apply(service_body(old, "default", by_instance=False))

        async def by_slot() -> bool:
            service = rt.cache.service("sel")
            spec = service.spec if service is not None else None
            return "slotctl.instance" not in ((spec.selector if spec else None) or {})

        await eventually(by_slot, "the Service selecting by slot alone in the cache")
        assert cannot_surge(rt, "sel") is None  # its pods are labelled: it can surge
        assert (await rt.surge.start_instance(new)).running
        assert len(kubelet.alive("sel")) == 2  # both pods run; the Service names the old
        service = await kubelet.get("services", "slotctl-sel")
        assert service is not None
        assert service["spec"]["selector"]["slotctl.instance"] == "0"
        assert service["spec"]["ports"][0]["targetPort"] == old.port
        await rt.surge.promote("sel")
        service = await kubelet.get("services", "slotctl-sel")
        assert service is not None and service["spec"]["selector"]["slotctl.instance"] == "1"


async def test_a_slot_from_before_instance_labels_is_recreated_not_surged(
    cluster: Cluster, kubelet: Kubelet
) -> None:
    """A Deployment and Service written before instance labels (its pod has no
    ``slotctl.instance``; the Service selects by slot alone), adopted: no selector names
    the old pod alone, so the slot cannot surge (the manager recreates it once, with the
    reason) and a start of a second instance is refused before it is made. Review of the
    pod surge, item 1."""
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    old = demo_launch("legacy", runtime="kubernetes", image=IMAGE)
    new = demo_launch("legacy", ["--load-seconds", "0.2"], runtime="kubernetes", image=IMAGE)
    async with runtime(cluster) as rt:
        body = rt.deployment_for(old)
        del body["spec"]["template"]["metadata"]["labels"]["slotctl.instance"]
        await kubelet.create(body)
        await kubelet.create(service_body(old, "default", by_instance=False))
        (pod,) = await eventually(lambda: _alive(kubelet, "legacy"), "the old pod running")

        async def seen() -> bool:
            return (await rt.inspect("legacy")).running and rt.cache.service("legacy") is not None

        await eventually(seen, "the old slot in the caches")
        assert (await rt.start(old)).running  # adopted as it is
        assert kubelet.alive("legacy") == [pod]  # (not restarted)
        service = await kubelet.get("services", "slotctl-legacy")
        assert service is not None and "slotctl.instance" not in service["spec"]["selector"]
        why = cannot_surge(rt, "legacy") or ""
        assert "predate instance labels" in why
        with pytest.raises(SlotSpawnFailed, match="predate instance labels"):
            await rt.surge.start_instance(new)
        assert await kubelet.get("deployments", "slotctl1-legacy") is None
        assert len(kubelet.alive("legacy")) == 1
