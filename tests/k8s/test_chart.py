"""The Helm chart, linted and rendered by Helm's own engine (helm-python-sdk), with the
default and with non-default values; bad values are refused by values.schema.json.
(The RBAC is checked against the operator's recorded requests in test_operator.py.)"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
import yaml

from controller.cli.main import build_parser
from controller.operator.crd import crd_documents
from tests.k8s.chart import CHART, notes, permissions, render

CUSTOM = {
    "image": {"repository": "registry.local/slotctl", "tag": "dev", "pullPolicy": "Always"},
    "runtime": "docker",
    "watchNamespaces": ["team-a", "team-b"],
    "api": {
        "enabled": True,
        "port": 9900,
        "tokenSecret": "slotctl-token",
        "allowedHosts": ["models.example.com"],
    },
    "liveness": {"port": 9090},
    "nodeSelector": {"gpu": "true"},
    "resources": {"limits": {"memory": "1Gi"}},
}


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["default", "custom"])
def test_lint_is_clean(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), values, strict=True)
    errors = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["total_charts_linted"] == 1
    assert errors == [] and not report.get("errors"), report


def test_default_render() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    (deploy,) = by_kind(docs, "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:3] == ["operator", "--runtime=process", "--all-namespaces"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]] == 8080
    (account,) = by_kind(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    assert container["image"] == "slotctl:0.1.0"
    for doc in docs:
        labels = doc["metadata"]["labels"]
        for key in ("name", "instance", "version", "managed-by", "part-of", "component"):
            assert f"app.kubernetes.io/{key}" in labels, (doc["kind"], key)
    cluster, roles = permissions(docs)
    assert roles == {} and ("watch", "slotctl.io", "slots") in cluster


def test_custom_render() -> None:
    docs = render(CUSTOM, namespace="ops")
    (deploy,) = by_kind(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.local/slotctl:dev"
    assert "--runtime=docker" in container["args"]
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]
    assert "--all-namespaces" not in container["args"]
    assert "--listen=0.0.0.0:9900" in container["args"]
    # The Service's names (and the values' own) are Host names the API answers (issue 26)
    service_name = by_kind(docs, "Service")[0]["metadata"]["name"]
    hosts = [a.removeprefix("--allowed-host=") for a in container["args"] if "allowed-host" in a]
    assert hosts == [
        service_name,
        f"{service_name}.ops",
        f"{service_name}.ops.svc",
        f"{service_name}.ops.svc.cluster.local",
        "models.example.com",
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["SLOTCTL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "slotctl-token"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["docker"] == "/var/run/docker.sock"
    assert pod["nodeSelector"] == {"gpu": "true"}
    (service,) = by_kind(docs, "Service")
    assert service["spec"]["ports"][0]["port"] == 9900
    roles = {d["metadata"]["namespace"] for d in by_kind(docs, "Role")}
    assert roles == {"team-a", "team-b"}
    assert {d["metadata"]["namespace"] for d in by_kind(docs, "RoleBinding")} == roles
    assert all(d["metadata"]["namespace"] == "ops" for d in by_kind(docs, "Deployment"))
    assert "team-a, team-b" in notes(CUSTOM)


def _models_env(container: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom"))
        for e in container["env"]
        if "MODEL" in e["name"] or "HF" in e["name"] or "IMAGE" in e["name"]
    }


def test_the_model_cache_volume_is_named_hostpath_by_default_a_pvc_on_request() -> None:
    """Issue 35: pulled model files live in a cache that outlives pods."""
    (deploy,) = by_kind(render(), "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
    assert volume["hostPath"] == {"path": "/var/lib/slotctl/models", "type": "DirectoryOrCreate"}
    assert {"name": "model-cache", "mountPath": "/models"} in container["volumeMounts"]
    assert _models_env(container) == {"SLOTCTL_MODELS_DIR": "/models"}

    # docker: the servers' containers mount the host's path, so the pod uses that path too
    (deploy,) = by_kind(render({"runtime": "docker"}), "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert _models_env(container) == {"SLOTCTL_MODELS_DIR": "/var/lib/slotctl/models"}

    pvc = {"models": {"cache": {"persistentVolumeClaim": "models"}, "hubTokenSecret": "hf"}}
    (deploy,) = by_kind(render(pvc), "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
    assert volume["persistentVolumeClaim"] == {"claimName": "models"}
    token = _models_env(pod["containers"][0])["HF_TOKEN"]
    assert token == {"secretKeyRef": {"name": "hf", "key": "token"}}

    # kubernetes: each slot's pod pulls in an init container running this image into the
    # cache; the operator's own pod mounts nothing
    values = {"runtime": "kubernetes", "image": {"repository": "registry.local/slotctl"}}
    (deploy,) = by_kind(render({**values, **pvc}), "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if v["name"] == "model-cache"]
    assert _models_env(pod["containers"][0]) == {
        "SLOTCTL_MODELS_DIR": "/models",
        "SLOTCTL_K8S_MODEL_CACHE": "pvc:models",
        "SLOTCTL_K8S_IMAGE": "registry.local/slotctl:0.1.0",
        "SLOTCTL_K8S_HF_TOKEN_SECRET": "hf",
    }
    (deploy,) = by_kind(render(values), "Deployment")
    env = _models_env(deploy["spec"]["template"]["spec"]["containers"][0])
    assert env["SLOTCTL_K8S_MODEL_CACHE"] == "hostPath:/var/lib/slotctl/models"
    report = helm.lint(str(CHART), {**values, **pvc}, strict=True)
    assert not [m for m in report["messages"] if m["severity"] >= 2], report


BAD = {
    "unknown key": {"replicas": 2},
    "unknown nested key": {"image": {"repository": "x", "digest": "sha"}},
    "runtime": {"runtime": "podman"},
    "gpu resource": {"runtime": "kubernetes", "gpuResource": "intel.com/gpu"},
    "namespace name": {"watchNamespaces": ["Team_A"]},
    "api without a token secret": {"api": {"enabled": True}},
    "port": {"liveness": {"port": 0}},
    "relative model cache": {"models": {"cache": {"hostPath": "models"}}},
    "model cache claim name": {"models": {"cache": {"persistentVolumeClaim": "My_Claim"}}},
    "unknown models key": {"models": {"size": "10Gi"}},
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_are_refused_by_the_schema(case: str) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError):
        chart.validate_schema(BAD[case])
    with pytest.raises(helm.HelmError):
        chart.render(BAD[case], name="slotctl", namespace="slotctl")
    chart.validate_schema(CUSTOM)  # and good ones pass


def test_schema_forbids_additional_properties_everywhere() -> None:
    chart = helm.Chart.load(str(CHART))
    schema = chart.schema
    assert schema is not None

    def objects(node: dict[str, Any]) -> list[dict[str, Any]]:
        out = [node] if node.get("properties") else []
        for child in node.get("properties", {}).values():
            out += objects(child)
        return out

    assert all(node.get("additionalProperties") is False for node in objects(schema))


def test_chart_ships_the_generated_crds() -> None:
    chart = helm.Chart.load(str(CHART))
    shipped = {c["name"]: yaml.safe_load(c["data"]) for c in chart.crds}
    assert len(shipped) == len(crd_documents()) == 4  # Adapter, Alias, Model, Slot
    generated = {d["metadata"]["name"]: d for d in crd_documents().values()}
    assert {d["metadata"]["name"]: d for d in shipped.values()} == generated


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["default", "custom"])
def test_the_containers_arguments_parse_as_slotctl_arguments(values: dict[str, Any]) -> None:
    (deploy,) = by_kind(render(values), "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "operator"
    assert args.runtime == values.get("runtime", "process")
    assert args.all_namespaces == (not values.get("watchNamespaces"))
    assert args.namespace == values.get("watchNamespaces", [])
    assert len(args.allowed_host) == (5 if values.get("api", {}).get("enabled") else 0)
