"""docs/kubernetes.md's reference tables list exactly the CRDs' spec keys."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from controller.operator.crd import crd_documents

DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


def _paths(node: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for name, child in node.get("properties", {}).items():
        out.add(prefix + name)
        if child.get("type") == "object" and "properties" in child:
            out |= _paths(child, f"{prefix}{name}.")
    return out


def _documented(kind: str) -> set[str]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split(f"### `{kind}` spec", 1)[1].split("\n\n", 2)[1]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


@pytest.mark.parametrize("kind", ["Adapter", "Alias", "Model", "Slot"])
def test_reference_matches_the_crd(kind: str) -> None:
    (crd,) = [d for d in crd_documents().values() if d["spec"]["names"]["kind"] == kind]
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert _documented(kind) == _paths(spec)
