"""An adapter's files reach a kubernetes slot's pod (issue 37): the operator with
``--runtime kubernetes`` against KMock, the test as the kubelet (init containers run as
processes), the model and the adapter on the hub server. The pod pulls the model
(``model-pull``), then the adapter (``adapter-pull-0``), into the node's model cache the
server mounts read-only; a request for the adapter through the router is answered by it
(the demo server's vLLM adapter API refuses a path that is not there). An adapter whose
source is a local path cannot reach a pod: the slot is refused with a typed error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.model.errors import SlotConfigError
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.runtime.base import RuntimeKind
from controller.spec.schema import AdapterSpec, ModelSpec, SlotSpec
from tests.integration.helpers import free_ports
from tests.integration.hubserver import HubServer
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.kubelet import Kubelet, gpu_node
from tests.k8s.test_kubernetes_pull import MIB, blob, cache, hub, hub_model
from tests.k8s.test_kubernetes_runtime import operator, ready, slot
from tests.k8s.test_operator import adapter, adapter_ready

__all__ = ["cache", "hub"]  # the fixtures

pytestmark = pytest.mark.timeout(180)
TOKEN = "adapters-test-token"


async def test_a_slots_pod_pulls_its_adapters_files_with_its_model(
    cluster: Cluster,
    kubelet: Kubelet,
    hub: HubServer,
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.add_repo("org/w", {"w.gguf": blob(2 * MIB)})
    hub.add_repo("org/lora", {"sql.safetensors": b"lora sql weights"})
    port, api_port = free_ports(2)
    api = f"127.0.0.1:{api_port}"
    await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
    async with operator(cluster, tmp_path / "state", monkeypatch, listen=api, token=TOKEN):
        await cluster.create(hub_model("m-w", "hf://org/w/w.gguf"))
        await cluster.create(adapter("sql", "m-w", "hf://org/lora/sql.safetensors", rank=8))
        await eventually(lambda: adapter_ready(cluster, "sql"), "the Adapter Ready")
        await cluster.create(slot("chat", "m-w", port, max_loras=2))
        await eventually(lambda: ready(cluster, "chat"), "chat Ready", timeout=90)

        dep = await kubelet.get("deployments", "slotctl-chat")
        assert dep is not None
        pod = dep["spec"]["template"]["spec"]
        names = [c["name"] for c in pod["initContainers"]]
        assert names == ["model-pull", "adapter-pull-0"]
        second = pod["initContainers"][1]
        assert second["args"][:5] == [
            "model",
            "pull",
            "sql",
            "--source",
            "hf://org/lora/sql.safetensors",
        ]
        assert second["volumeMounts"] == [
            {"name": "model-cache", "mountPath": str(cache), "readOnly": False}
        ]
        (server,) = pod["containers"]
        mount = {"name": "model-cache", "mountPath": str(cache), "readOnly": True}
        assert server["volumeMounts"].count(mount) == 1
        assert (cache / "org/lora/sql.safetensors").read_bytes() == b"lora sql weights"

        request: dict[str, Any] = {
            "model": "sql",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
        }
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://{api}/v1/chat/completions", json=request, headers=headers) as r,
        ):
            body = await r.json()
            assert r.status == 200, body
        assert body["model"] == "sql"
        assert body["choices"][0]["message"]["content"].startswith("[sql]"), body


def test_an_adapter_with_a_local_source_refuses_a_kubernetes_slot(tmp_path: Path) -> None:
    spec = SlotSpec.model_validate(
        {
            "name": "v",
            "provider": "vllm",
            "model": {"default": "base"},
            "port": 1,
            "max_loras": 2,
            "server": {"image": "vllm/vllm-openai:v0.8.0"},
        }
    )
    model = ModelSpec(id="base", source="hf://org/base/b.gguf")
    adapters = {"sql": AdapterSpec(id="sql", base="base", source="/srv/adapters/sql")}
    ctx = BuildContext(
        runtime=RuntimeKind.KUBERNETES, models_dir=tmp_path, adapters=adapters, image="x"
    )
    with pytest.raises(SlotConfigError) as refused:
        build_launch(spec, model, ctx)
    assert refused.value.code == "slot.config_error"
    assert "adapter 'sql' has a local source" in refused.value.message
    # a slot that brings its own volume (the models dir) is not refused: nothing is pulled
    own = spec.model_copy(update={"server": spec.server.model_copy(update={"volume": "pvc"})})
    assert build_launch(own, model, ctx).adapter_pulls == ()
    # an hf:// adapter is pulled into the pod's cache with the model
    adapters["sql"] = AdapterSpec(id="sql", base="base", source="hf://org/lora/sql")
    launch = build_launch(spec, model, ctx)
    assert [p.model for p in launch.adapter_pulls] == ["sql"]
    assert launch.pull is not None and launch.pull.model == "base"
