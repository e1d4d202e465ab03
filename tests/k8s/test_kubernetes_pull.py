"""A Slot whose model is not on the node is pulled before its server starts (issue 35):
the operator with ``--runtime kubernetes`` against KMock, the test as the kubelet
(:mod:`tests.k8s.kubelet`, which runs init containers as processes), the model on the hub
server of ``tests/integration/hubserver.py``. The Deployment's pod gets a ``model-pull``
init container — the operator's image running ``slotctl model pull ID --source …`` into
the node's model cache, a hostPath the server mounts read-only — and the Slot shows
``pulling`` while it runs, then ``ready``; a second slot of the same model finds it there;
a pull that fails (a gated repository, no token) is the slot's error with the pull's own
typed code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import free_ports
from tests.integration.hubserver import HubServer
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.kubelet import Kubelet, gpu_node
from tests.k8s.test_kubernetes_runtime import IMAGE, _state, operator, ready, slot

pytestmark = pytest.mark.timeout(180)
MIB = 1024 * 1024
PULL_IMAGE = "registry.local/slotctl:test"


def blob(size: int) -> bytes:
    block = hashlib.sha256(b"node-cache").digest() * 2048
    return (block * (size // len(block) + 1))[:size]


def hub_model(name: str, source: str) -> dict[str, Any]:
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name},
        "spec": {"source": source, "memory_gb": 1},
    }


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server
        server.release()


@pytest.fixture
def cache(tmp_path: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's model cache (a hostPath: to the test kubelet's processes, the host's own
    directory), the pods' models dir, and the hub the operator and its pods use."""
    where = tmp_path / "node-cache"
    monkeypatch.setenv("SLOTCTL_MODELS_DIR", str(where))
    monkeypatch.setenv("SLOTCTL_K8S_MODEL_CACHE", f"hostPath:{where}")
    monkeypatch.setenv("SLOTCTL_K8S_IMAGE", PULL_IMAGE)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # passed on to the pods' pulls
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "60")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return where


async def test_a_slots_pod_pulls_its_model_in_an_init_container_the_slot_pulling(
    cluster: Cluster,
    kubelet: Kubelet,
    hub: HubServer,
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = blob(24 * MIB)
    hub.add_repo("org/w", {"w.gguf": data})
    hub.fault("w.gguf", hold_at=12 * MIB)
    port, second_port = free_ports(2)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    async with operator(cluster, tmp_path / "state", monkeypatch) as op:
        await cluster.create(hub_model("m-w", "hf://org/w/w.gguf"))
        await cluster.create(slot("chat", "m-w", port))

        await eventually(lambda: _state(op, "chat", "pulling"), "chat pulling", timeout=60)

        async def held() -> bool:
            return hub.held.is_set()

        await eventually(held, "the pod's pull at the hold", timeout=60)

        async def cr_pulling() -> bool:
            obj = await cluster.get("slots", "chat")
            return ((obj or {}).get("status") or {}).get("state") == "pulling"

        await eventually(cr_pulling, "the Slot's status: pulling", timeout=30)
        assert not [p for p in kubelet.alive("chat") if p.ip]  # no server yet
        dep = await kubelet.get("deployments", "slotctl-chat")
        assert dep is not None
        pod = dep["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["name"] == "model-pull" and init["image"] == PULL_IMAGE
        assert init["command"] == ["slotctl"]
        assert init["args"][:5] == ["model", "pull", "m-w", "--source", "hf://org/w/w.gguf"]
        assert init["args"][5:7] == ["--models-dir", str(cache)]
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert init["volumeMounts"] == [
            {"name": "model-cache", "mountPath": str(cache), "readOnly": False}
        ]
        env = {e["name"]: e.get("value") for e in init["env"]}
        assert env["HF_ENDPOINT"] == hub.endpoint and "HF_TOKEN" not in env
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
        assert volume["hostPath"] == {"path": str(cache), "type": "DirectoryOrCreate"}
        (server,) = pod["containers"]
        mount = {"name": "model-cache", "mountPath": str(cache), "readOnly": True}
        assert mount in server["volumeMounts"]

        hub.release()
        await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=90)
        assert (cache / "org/w/w.gguf").read_bytes() == data
        first_gets = [r for r in hub.requests if r.route == "lfs" and r.method == "GET"]
        assert len(first_gets) == 1

        # A second slot of the model on the node: its pod's pull finds the file there.
        await cluster.create(slot("second", "m-w", second_port))
        await eventually(lambda: ready(cluster, "second"), "second Ready", timeout=90)
        gets = [r for r in hub.requests if r.route == "lfs" and r.method == "GET"]
        assert len(gets) == 1  # no second download
        transitions = [t for t in op.manager.transitions if t[0] == "second"]
        assert [t[2] for t in transitions][:2] == ["pulling", "starting"]


async def test_a_pull_that_fails_in_the_pod_is_the_slots_error_with_its_code(
    cluster: Cluster,
    kubelet: Kubelet,
    hub: HubServer,
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add_repo("org/gated", {"g.gguf": blob(MIB)}, gated=True)
    (port,) = free_ports(1)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    async with operator(cluster, tmp_path / "state", monkeypatch) as op:
        await cluster.create(hub_model("m-g", "hf://org/gated/g.gguf"))
        await cluster.create(slot("locked", "m-g", port))
        await eventually(lambda: _state(op, "locked", "error"), "locked in error", timeout=90)
        view = op.manager.view("locked")
        assert "[model.access_denied]" in view.message, view.message
        assert view.failures >= 1

        async def scaled_down() -> bool:
            dep = await kubelet.get("deployments", "slotctl-locked")
            return dep is not None and dep["spec"]["replicas"] == 0

        await eventually(scaled_down, "its Deployment back to 0", timeout=30)
        assert not kubelet.alive("locked")
        assert not (cache / "org/gated/g.gguf").exists()
        dep = await kubelet.get("deployments", "slotctl-locked")
        assert dep is not None
        (server,) = dep["spec"]["template"]["spec"]["containers"]
        assert server["image"] == IMAGE


async def test_deleting_a_slot_whose_pod_pulls_stops_the_pull_and_scales_it_down(
    cluster: Cluster,
    kubelet: Kubelet,
    hub: HubServer,
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add_repo("org/w", {"w.gguf": blob(24 * MIB)})
    hub.fault("w.gguf", hold_at=12 * MIB)
    (port,) = free_ports(1)
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    async with operator(cluster, tmp_path / "state", monkeypatch) as op:
        await cluster.create(hub_model("m-w", "hf://org/w/w.gguf"))
        await cluster.create(slot("doomed", "m-w", port))
        await eventually(lambda: _state(op, "doomed", "pulling"), "doomed pulling", timeout=60)

        async def held() -> bool:
            return hub.held.is_set()

        await eventually(held, "the pod's pull at the hold", timeout=60)
        await cluster.delete("slots", "doomed")

        async def gone() -> bool:
            return await cluster.get("slots", "doomed") is None

        # not held until the pull would end: the load is stopped, its pod goes
        await eventually(gone, "the Slot deleted while its pod still pulled", timeout=60)
        assert hub.held.is_set()  # the hub never let the pull finish
        assert not kubelet.alive("doomed")
        assert not (cache / "org/w/w.gguf").exists()
