"""A ``Slot``'s ``unit`` (co-loaded units, docs/design/0013) against a real
``kube-apiserver``: kept by the structural schema (not pruned), its pattern enforced.
The envtest tier: skipped unless the binaries are built (``tools/k8s/build.sh``) or
``SLOTCTL_K8S_APISERVER=1`` asks for it."""

from __future__ import annotations

import pytest

from tests.k8s.realapi import Kube
from tests.k8s.test_operator import slot
from tests.k8s.test_real_apiserver import admin, api_server, namespace, refused

__all__ = ["admin", "api_server", "namespace"]  # the fixtures, shared with that module
pytestmark = pytest.mark.timeout(300)


async def test_the_unit_is_kept_and_its_name_checked(admin: Kube) -> None:
    chat = slot("chat", "m", 8080)
    chat["spec"]["unit"] = "rag"
    resp = await admin.create(chat)
    stored = await admin.get("slots", "chat")
    assert stored is not None and stored["spec"]["unit"] == "rag", resp
    bad = slot("embed", "m", 8081)
    bad["spec"]["unit"] = "Not A Label"
    err = await refused(admin.create(bad), 422)
    assert "spec.unit" in err.body["message"]
    assert await admin.get("slots", "embed") is None
