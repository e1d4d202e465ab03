"""The Helm chart rendered by the real Helm engine (``helm-python-sdk``: Helm's Go SDK
through its C ABI, no ``helm`` binary), and what its RBAC allows."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "slotctl"

Permission = tuple[str, str, str]  # (verb, apiGroup, resource[/subresource])


def render(
    values: dict[str, Any] | None = None, namespace: str = "slotctl"
) -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    manifests = chart.render(values or {}, name="slotctl", namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    chart = helm.Chart.load(str(CHART))
    manifests = chart.render(values or {}, name="slotctl", namespace="slotctl", is_install=True)
    return next(t for p, t in manifests.items() if p.endswith("NOTES.txt"))


def _expand(rules: Iterable[dict[str, Any]]) -> set[Permission]:
    return {
        (verb, group, resource)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def permissions(docs: list[dict[str, Any]]) -> tuple[set[Permission], dict[str, set[Permission]]]:
    """(what the ClusterRole allows, namespace -> what its Role allows)."""
    cluster: set[Permission] = set()
    roles: dict[str, set[Permission]] = {}
    for doc in docs:
        if doc["kind"] == "ClusterRole":
            cluster |= _expand(doc["rules"])
        elif doc["kind"] == "Role":
            roles.setdefault(doc["metadata"]["namespace"], set()).update(_expand(doc["rules"]))
    return cluster, roles


def assert_rbac_allows(used: set[Permission], *, namespaces: list[str]) -> None:
    """The chart rendered for this namespace scope allows every request the operator
    made (a scenario that uses part of what it grants)."""
    docs = render({"watchNamespaces": namespaces})
    cluster, roles = permissions(docs)
    allowed = cluster | {p for perms in roles.values() for p in perms}
    assert used, "no requests were recorded"
    assert used <= allowed, f"the chart's RBAC misses {sorted(used - allowed)}"


def assert_rbac_allows_exactly(used: set[Permission], *, namespaces: list[str]) -> None:
    """The chart rendered for this namespace scope allows every request the operator
    made, and nothing it did not make."""
    docs = render({"watchNamespaces": namespaces})
    cluster, roles = permissions(docs)
    allowed = cluster | {p for perms in roles.values() for p in perms}
    assert used, "no requests were recorded"
    assert used <= allowed, f"the chart's RBAC misses {sorted(used - allowed)}"
    assert allowed <= used, f"the chart's RBAC grants unused {sorted(allowed - used)}"
    if namespaces:
        assert set(roles) == set(namespaces)
        assert not {p for p in cluster if p[1] == "slotctl.io"}, "CRs must be namespaced grants"
