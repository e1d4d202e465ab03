"""The kubernetes runtime's pure parts: quantities and node budgets, the memory probe on
NODE/DEVICE keys, the Deployment a launch becomes, the admission key of a slot, the
operator's default runtime, and the config hash (a node is config, a pod IP is not)."""

from __future__ import annotations

from typing import Any

import pytest
from lightkube.resources.core_v1 import Node, Pod

from controller.cli.k8s import operator_runtime
from controller.model.devices import GpuRef
from controller.model.errors import SlotConfigError, SlotSpawnFailed
from controller.model.sizes import GIB
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.runtime.kubernetes.nodes import NodeMemory, node_budgets, parse_quantity
from controller.runtime.kubernetes.runtime import KubernetesRuntime
from controller.runtime.kubernetes.spec import (
    MAX_SLOT_NAME,
    check_slot_name,
    deployment_body,
    service_body,
)
from controller.scheduling.breaker import Breaker
from controller.slots.records import SlotRecord
from controller.spec.schema import ModelSpec, SlotSpec
from tests.k8s.kubelet import gpu_node


def spec(**extra: Any) -> SlotSpec:
    body: dict[str, Any] = {
        "name": "chat",
        "provider": "llamacpp",
        "port": 8080,
        "model": {"default": "qwen"},
        "server": {"image": "ghcr.io/ggml-org/llama.cpp:server"},
    }
    body.update(extra)
    return SlotSpec.model_validate(body)


MODEL = ModelSpec(id="qwen", source="hf://org/repo/q.gguf", memory_gb=6)


def launch(runtime: str = "kubernetes", **extra: Any) -> Any:
    return build_launch(spec(**extra), MODEL, BuildContext(runtime=runtime, stack="s"))


@pytest.mark.parametrize(
    ("text", "value"),
    [("16Gi", 16 * 2**30), ("2", 2), ("500M", 500 * 10**6), ("1024Ki", 2**20), ("x", None)],
)
def test_parse_quantity(text: str, value: int | None) -> None:
    assert parse_quantity(text) == value


def test_node_budgets_from_allocatable_and_gpu_labels() -> None:
    labels = {"nvidia.com/gpu.memory": "24576"}  # MiB per GPU
    assert node_budgets({"nvidia.com/gpu": "2", "memory": "64Gi"}, labels) == {
        "gpu": 48 * GIB,
        "cpu": 64 * GIB,
    }
    # time-slicing: 8 allocatable replicas of 1 physical GPU (GFD's count label wins)
    sliced = {**labels, "nvidia.com/gpu.count": "1"}
    assert node_budgets({"nvidia.com/gpu": "8"}, sliced) == {"gpu": 24 * GIB}
    assert node_budgets({"amd.com/gpu": "1"}, labels) == {"gpu": 24 * GIB}
    assert node_budgets({"nvidia.com/gpu": "1"}, {}) == {}  # no memory stated: settings apply


def test_node_memory_answers_per_node_from_the_caches() -> None:
    """The admission's probe over the runtime's caches: each GPU node's GPUs (the pods
    bound there counted), ``NODE/gpu:N`` with the per-GPU memory, ``NODE/cpu`` with the
    allocatable memory, a bare ``cpu`` with the largest node's; read again once marked stale."""
    nodes = {
        "a": Node.from_dict(gpu_node("a", gpus=1, gib_per_gpu=16, replicas=4)),
        "b": Node.from_dict(gpu_node("b", gpus=2, gib_per_gpu=16)),
    }
    memory = NodeMemory()
    memory.bind(nodes, {}, lambda pod: None)
    a, b = memory.cluster()
    assert (a.name, a.allocatable, a.physical, a.sliced) == ("a", 4, 1, True)
    assert (b.name, b.allocatable, b.per_gpu, b.unusable) == ("b", 2, 16 * GIB, None)
    sample = memory.sample("b/gpu:1")
    assert sample is not None and sample.total_bytes == sample.free_bytes == 16 * GIB
    cpu = memory.sample("a/cpu")
    assert cpu is not None and cpu.total_bytes == 64 * GIB
    assert memory.sample("cpu") is not None and memory.sample("c/gpu:0") is None
    assert memory.sample("a/npu") is None and memory.gpus() == ()
    assert memory.gpu_resources == {"a": "nvidia.com/gpu", "b": "nvidia.com/gpu"}
    del nodes["a"]
    assert len(memory.cluster()) == 2  # a snapshot until told the caches changed
    memory.stale()
    assert [n.name for n in memory.cluster()] == ["b"]


def _gpu_pod(name: str, node: str | None, gpus: int, slot: str | None = None) -> Pod:
    labels = {"slotctl.managed": "true", "slotctl.slot": slot} if slot else {}
    return Pod.from_dict(
        {
            "metadata": {"name": name, "namespace": "ml", "labels": labels},
            "spec": {
                "nodeName": node,
                "containers": [
                    {"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}
                ],
            },
        }
    )


def test_node_memory_is_kept_per_node_from_the_watch_events() -> None:
    """The probe kept from the watches' events (issue 39): a pod's event reads again only
    the nodes it left and joined, a node's event that node; what it answers is what a
    full reading of the caches answers, at each step."""
    nodes = {n: Node.from_dict(gpu_node(n, gpus=1, gib_per_gpu=16, replicas=4)) for n in "abc"}
    pods: dict[str, Pod] = {}

    def ours(pod: Pod) -> str | None:
        return (pod.metadata.labels or {}).get("slotctl.slot") if pod.metadata else None

    memory = NodeMemory()
    memory.bind(nodes, pods, ours)
    first = memory.cluster()

    def event(key: str, new: Pod | None) -> None:
        old = pods.pop(key, None)
        if new is not None:
            pods[key] = new
        memory.pod_changed(old, new)

    def agrees() -> tuple[Any, ...]:
        full = NodeMemory()
        full.bind(nodes, pods, ours)
        kept = memory.cluster()
        assert kept == full.cluster()
        return kept

    event("ml/p1", _gpu_pod("p1", "a", 1, slot="s1"))
    event("ml/p2", _gpu_pod("p2", "b", 2))  # another's
    a, b, c = agrees()
    assert c is first[2]  # untouched: not read again
    assert (a.pods, a.others, b.others) == ({"s1": 1}, 0, 2)
    event("ml/p1", _gpu_pod("p1", "c", 1, slot="s1"))  # moved (a new pod of the name)
    a, b, c = agrees()
    assert (a.pods, c.pods) == ({}, {"s1": 1}) and b is not first[1]
    event("ml/p3", _gpu_pod("p3", None, 1, slot="s3"))  # not bound: no node changes
    assert agrees()[1] is b
    event("ml/p2", None)  # deleted
    assert agrees()[1].others == 0
    assert [p.metadata.name for p in memory.pods_on("c") if p.metadata] == ["p1"]
    nodes["b"] = Node.from_dict(gpu_node("b", gpus=2, gib_per_gpu=16))
    memory.node_changed("b")
    assert agrees()[1].allocatable == 2
    del nodes["c"]
    memory.node_changed("c")
    assert [n.name for n in agrees()] == ["a", "b"]


def test_deployment_body() -> None:
    body = deployment_body(launch(node="gpu-a", server={"image": "img", "volume": "models"}), "ml")
    assert body["metadata"]["name"] == "slotctl-chat" and body["metadata"]["namespace"] == "ml"
    assert body["metadata"]["labels"] == {
        "slotctl.managed": "true",
        "slotctl.slot": "chat",
        "slotctl.stack": "s",
        "slotctl.config-hash": body["metadata"]["annotations"]["slotctl.config-hash"],
        "slotctl.owner": "slotctl",  # the default owner; metadata only, never the selector
    }
    assert body["spec"]["selector"]["matchLabels"] == {
        "slotctl.managed": "true",
        "slotctl.slot": "chat",
    }
    spec_ = body["spec"]
    assert spec_["replicas"] == 1 and spec_["strategy"]["type"] == "Recreate"
    pod = spec_["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False  # the server needs no API token
    assert "slotctl.owner" not in spec_["template"]["metadata"]["labels"]
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "gpu-a"}
    assert pod["affinity"] is None  # not placed yet: no required affinity
    assert {t["key"] for t in pod["tolerations"]} == {
        "nvidia.com/gpu",
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    }
    placed = launch().placed_on((GpuRef(0, vendor="nvidia", node="gpu-b"),))
    affinity = deployment_body(placed, "ml")["spec"]["template"]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-b"]}]}
    ]
    assert placed.config_hash() == launch().config_hash()  # where it runs is not config
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert "--host" in container["args"] and "0.0.0.0" in container["args"]
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert container["volumeMounts"][0]["mountPath"] == "/models"
    amd = deployment_body(launch(), "ml", gpu_resource="amd.com/gpu")
    assert amd["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "amd.com/gpu": "1"
    }
    assert amd["spec"]["template"]["spec"]["nodeSelector"] is None  # a merge patch removes it
    cpu = deployment_body(launch(device="cpu"), "ml")
    assert cpu["spec"]["template"]["spec"]["containers"][0]["resources"] == {}
    with pytest.raises(SlotSpawnFailed, match="npu"):
        deployment_body(launch(device="npu"), "ml")
    service = service_body(launch(), "ml")
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": 8080}]
    assert service["metadata"]["labels"]["slotctl.owner"] == "slotctl"
    assert "slotctl.owner" not in service["spec"]["selector"]
    mine = deployment_body(launch(), "ml", owner="team-b")
    assert mine["metadata"]["labels"]["slotctl.owner"] == "team-b"
    assert service_body(launch(), "ml", "team-b")["metadata"]["labels"]["slotctl.owner"] == "team-b"


def test_the_owner_is_a_label_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLOTCTL_K8S_OWNER", raising=False)
    assert KubernetesRuntime(namespace="ml").owner == "slotctl"
    monkeypatch.setenv("SLOTCTL_K8S_OWNER", "release-a")
    assert KubernetesRuntime(namespace="ml").owner == "release-a"
    assert KubernetesRuntime(namespace="ml", owner="b").owner == "b"
    for bad in ("/var/lib/slotctl", "x" * 64, "-a", "a b"):
        with pytest.raises(ValueError, match="label value"):
            KubernetesRuntime(namespace="ml", owner=bad)


async def test_a_slot_name_too_long_for_a_service_is_refused_before_any_api_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """``slotctl-`` + the slot is the Service's name, a DNS label (63 characters): a slot
    of 56-63 characters (valid elsewhere) is refused with a typed error, nothing sent."""
    assert MAX_SLOT_NAME == 55
    check_slot_name("a" * 55)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))  # no API server at all
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    runtime = KubernetesRuntime(namespace="ml")
    name = "a" * 56
    long = build_launch(spec(name=name), MODEL, BuildContext(runtime="kubernetes", stack="s"))
    with pytest.raises(SlotSpawnFailed, match=r"56 characters.*at most 55|limited to 55") as err:
        await runtime.start(long)
    assert err.value.details["slot"] == name
    assert runtime._api is None  # refused before a client was even made
    await runtime.close()


def test_the_kubernetes_runtime_needs_an_image_and_reads_models_in_the_pod() -> None:
    with pytest.raises(SlotConfigError, match=r"kubernetes runtime needs server\.image"):
        build_launch(
            spec(provider="llama-cpp-python", server={}),
            MODEL,
            BuildContext(runtime="kubernetes"),
        )
    k8s = launch()
    assert k8s.model_path is None and not k8s.model_missing()  # in the pod, not here
    assert launch(runtime="process", node="gpu-a").node is None  # only the kubernetes runtime


def test_a_node_is_config_and_a_pod_ip_is_not() -> None:
    plain = launch()
    pinned = launch(node="gpu-a")
    assert plain.config_hash() != pinned.config_hash()
    assert "node" not in plain.hash_input()  # launches without a node hash as before
    reached = plain.reached_at("http://10.1.2.3:8080")
    assert reached.endpoint == "http://10.1.2.3:8080"
    assert reached.config_hash() == plain.config_hash() and reached == plain
    assert plain.reached_at(None) is plain


def test_the_admission_keys_are_per_node_and_gpu_on_a_cluster_only() -> None:
    record = SlotRecord(spec=spec(node="gpu-a"), stack="s", model=MODEL, breaker=Breaker())
    assert record.where == "gpu"  # process/docker: `node` means nothing
    record.on_nodes = True
    assert record.where == "gpu-a/gpu"
    unplaced = SlotRecord(spec=spec(), stack="s", model=MODEL, breaker=Breaker(), on_nodes=True)
    assert unplaced.where == "gpu" and unplaced.lock_key == "gpu"  # before it is placed
    unplaced.placement = (GpuRef(1, vendor="nvidia", node="gpu-b"),)
    assert unplaced.node == "gpu-b" and unplaced.devices == ("gpu-b/gpu:1",)
    assert unplaced.lock_key == "gpu"  # one lock for every GPU placement of the cluster


def test_operator_runtime_defaults_to_kubernetes_inside_a_pod() -> None:
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert operator_runtime("process", given=False, env=pod) == "kubernetes"
    assert operator_runtime("process", given=True, env=pod) == "process"
    assert operator_runtime("process", given=False, env={}) == "process"
    assert operator_runtime("docker", given=True, env={}) == "docker"


def test_the_runtime_flag_remembers_that_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.cli.main import build_parser

    monkeypatch.delenv("SLOTCTL_RUNTIME", raising=False)
    parser = build_parser()
    assert parser.parse_args(["operator"]).runtime_given is False
    assert parser.parse_args(["operator", "--runtime", "process"]).runtime_given is True
    assert parser.parse_args(["--runtime", "kubernetes", "operator"]).runtime == "kubernetes"


def test_drift_is_measured_on_slotctl_s_fields_only() -> None:
    """What the runtime puts back: the replica count, its labels and annotations, the pod
    template's config hash; another manager's label is not drift."""
    from lightkube.resources.apps_v1 import Deployment

    from controller.runtime.kubernetes.drift import drifted

    body = deployment_body(launch(), "ml")
    live = Deployment.from_dict(body)
    assert drifted(body, live) == []
    scaled = Deployment.from_dict({**body, "spec": {**body["spec"], "replicas": 0}})
    assert drifted(body, scaled) == ["replicas 0 (want 1)"]
    labels = {**body["metadata"]["labels"], "slotctl.stack": "other", "team": "ml"}
    relabelled = Deployment.from_dict({**body, "metadata": {**body["metadata"], "labels": labels}})
    assert drifted(body, relabelled) == ["label slotctl.stack='other' (want 's')"]


def test_a_demo_slot_runs_slotctls_own_image_on_the_kubernetes_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No ``server.image``: the operator's own (``SLOTCTL_K8S_IMAGE``, else the tag the
    README builds), its interpreter as the container's command (the image's entrypoint is
    ``slotctl``); an image the slot names is kept. The other runtimes are unchanged."""
    from controller import __version__
    from controller.providers.launch import launch_context

    demo = SlotSpec.model_validate(
        {"name": "chat", "provider": "demo", "port": 8080, "model": {"default": "d"}}
    )
    model = ModelSpec(id="d", source="demo://d")
    monkeypatch.delenv("SLOTCTL_K8S_IMAGE", raising=False)
    plain = build_launch(demo, model, launch_context("kubernetes", "s"))
    assert plain.image == f"slotctl:{__version__}"
    monkeypatch.setenv("SLOTCTL_K8S_IMAGE", "registry.local/slotctl:1.2")
    own = build_launch(demo, model, launch_context("kubernetes", "s"))
    assert own.image == "registry.local/slotctl:1.2" and own.command == ("python3",)
    assert own.argv[:2] == ("-m", "controller.demo") and "--port" in own.argv
    assert own.config_hash() != plain.config_hash()  # the image is the server's config
    container = deployment_body(own, "ml")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python3"] and container["args"] == list(own.argv)
    named = demo.model_copy(update={"server": demo.server.model_copy(update={"image": "x/y:1"})})
    assert build_launch(named, model, launch_context("kubernetes", "s")).image == "x/y:1"
    process = build_launch(demo, model, launch_context("process", "s"))
    assert process.image is None and process.command == ()
    with pytest.raises(SlotConfigError, match=r"docker runtime needs server\.image"):
        build_launch(demo, model, launch_context("docker", "s"))
    # a launch without a command hashes as before (no key for it)
    assert "command" not in launch().hash_input()
    body = deployment_body(launch(), "ml")["spec"]["template"]["spec"]["containers"][0]
    assert body["command"] is None  # the image's entrypoint (llama.cpp's llama-server)
