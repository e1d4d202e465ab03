"""The KMock emulator harness itself (``tests/k8s/conftest.py``): its fast ``request in
view`` must answer exactly what KMock's own (a pass over every request) answers, for
every reaction KMock consults on a request and for views it does not shortcut."""

from __future__ import annotations

from typing import Any

import kmock

from tests.k8s.conftest import GROUP, VERSION, Cluster, _contains, _original_contains


async def test_fast_membership_answers_as_kmock_does(cluster: Cluster) -> None:
    api = f"{GROUP}/{VERSION}"
    await cluster.create({"apiVersion": api, "kind": "Model", **_body("m-chat")})
    await cluster.create({"apiVersion": api, "kind": "Slot", **_body("chat")})
    await cluster.get("slots", "chat")
    await cluster.get("slots", "missing")
    await cluster.edit("slots", "chat", {"priority": 70})
    for path in ("/api", "/apis", "/version", "/api/v1/namespaces", "/apis/slotctl.io"):
        async with cluster.session.get(path) as resp:
            await resp.read()
    await cluster.delete("slots", "chat")
    emulator: Any = cluster.emulator
    requests = list(emulator._requests)
    assert len(requests) >= 10
    views: list[Any] = [payload._source for payload in emulator._payloads]
    views += [emulator["get"], emulator["post"]["/apis"], emulator[:3], emulator.fallback]
    shortcut = answered = 0
    for view in views:
        for request in requests:
            want = _original_contains(view, request)
            assert _contains(view, request) == want, (view, request)
            shortcut += 1
            answered += bool(want)
    assert answered and answered < shortcut  # both answers occur
    assert isinstance(emulator, kmock.KubernetesEmulator)


def _body(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"priority": 50}}
