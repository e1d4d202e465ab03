"""The kubernetes runtime's informer (:mod:`controller.runtime.kubernetes.watch`) against
an HTTP server on 127.0.0.1 that answers a scripted sequence of list and watch requests,
the answers a real API server gives, including the ones that are hard to provoke from a
real one on demand: a bookmark, ``410 Gone`` (an expired ``resourceVersion``), a server
error. (The real control-plane tier runs the informers against the real API server.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Node

from controller.runtime.kubernetes import watch as kubernetes_watch
from controller.runtime.kubernetes.watch import Informer
from tests.k8s.conftest import eventually


def node(name: str, version: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "resourceVersion": str(version)},
    }


class Script:
    """The server's side: lists and watches, in order, recorded."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        self.kind = "NodeList"
        self.lists = [
            {"items": [node("n1", 1)], "version": "10"},
            {"items": [node("n2", 11), node("n3", 20)], "version": "20"},  # n1 went meanwhile
        ]
        self.watches: list[Any] = [
            [("ADDED", node("n2", 11)), ("BOOKMARK", node("", 15))],  # then the server ends it
            [("ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"})],
            500,  # a server error: backed off, watched again from the same version
            [("MODIFIED", node("n3", 21))],
        ]
        self.held = asyncio.Event()  # the last watch stays open

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        self.requests.append(dict(request.query))
        if request.query.get("watch") != "true":
            answer = self.lists.pop(0)
            body = {
                "kind": self.kind,
                "apiVersion": "v1",
                "metadata": {"resourceVersion": answer["version"]},
                "items": answer["items"],
            }
            return aiohttp.web.json_response(body)
        step = self.watches.pop(0) if self.watches else None
        if isinstance(step, int):
            return aiohttp.web.json_response({"kind": "Status", "code": step}, status=step)
        response = aiohttp.web.StreamResponse()
        await response.prepare(request)
        for kind, obj in step or []:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        if step is None:
            self.held.set()
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.05)  # held open until the client goes
        return response


@pytest.fixture
async def server() -> AsyncIterator[tuple[Script, str]]:
    script = Script()
    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/nodes", script.handle)
    app.router.add_get("/apis/apps/v1/namespaces/ml/deployments", script.handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield script, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_list_watch_bookmarks_relist_on_410_and_backoff(
    server: tuple[Script, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script, url = server
    monkeypatch.setattr(kubernetes_watch, "BACKOFF_S", (0.05, 0.2))
    client = _client(url)
    seen: list[tuple[str, str]] = []

    def on_event(kind: str, old: Node | None, new: Node | None) -> None:
        obj = new or old
        assert obj is not None and obj.metadata is not None
        seen.append((kind, str(obj.metadata.name)))

    informer: Informer[Node] = Informer(lambda: client, Node, on_event=on_event)
    informer.start()
    try:
        await eventually(lambda: _set(script.held), "the last watch held open", timeout=10)
        await eventually(lambda: _true(("MODIFIED", "n3") in seen), "the last event", timeout=5)
    finally:
        await informer.stop()
        await client.close()
    # list, watch (an add, a bookmark), watch from the bookmark's version (410), a new
    # list that tells apart what changed (n1 gone, n3 new), a watch (500: backed off),
    # the watch again from the same version
    assert seen[:2] == [("ADDED", "n1"), ("ADDED", "n2")]
    assert set(seen[2:4]) == {("DELETED", "n1"), ("ADDED", "n3")}  # the relist's difference
    assert seen[4:] == [("MODIFIED", "n3")]
    assert sorted(informer.items) == ["n2", "n3"]
    versions = [(r.get("watch"), r.get("resourceVersion")) for r in script.requests]
    assert versions == [
        (None, None),
        ("true", "10"),
        ("true", "15"),  # from the bookmark
        (None, None),  # 410 Gone: listed again
        ("true", "20"),
        ("true", "20"),  # after the 500, from the same version
        ("true", "21"),
    ]
    assert all(r.get("allowWatchBookmarks") == "true" for r in script.requests if r.get("watch"))
    stats = informer.stats
    assert (stats.lists, stats.relists, stats.bookmarks) == (2, 1, 1) and stats.errors == 1


def _client(url: str) -> AsyncClient:
    config = KubeConfig.from_dict(
        {
            "clusters": [{"name": "c", "cluster": {"server": url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
    )
    return AsyncClient(config=config)


async def test_a_bookmark_of_a_kind_with_a_required_spec_moves_the_version_on(
    server: tuple[Script, str],
) -> None:
    """The API server's bookmark is an object of the kind with only its metadata (a
    Deployment without ``spec.selector``, a Pod without ``spec.containers``): it moves
    the version on and is no error (decoded as a Deployment it failed, every minute)."""
    script, url = server
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ml", "resourceVersion": "3"},
        "spec": {"selector": {}, "template": {}},
    }
    bookmark = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "resourceVersion": "42",
            "annotations": {"k8s.io/initial-events-end": "true"},
        },
    }
    script.kind = "DeploymentList"
    script.lists = [{"items": [deployment], "version": "5"}]
    script.watches = [[("BOOKMARK", bookmark)]]
    client = _client(url)
    informer: Informer[Deployment] = Informer(lambda: client, Deployment, namespace="ml")
    informer.start()
    try:
        await eventually(lambda: _set(script.held), "the next watch held open", timeout=10)
    finally:
        await informer.stop()
        await client.close()
    versions = [(r.get("watch"), r.get("resourceVersion")) for r in script.requests]
    assert versions == [(None, None), ("true", "5"), ("true", "42")]
    assert (informer.stats.bookmarks, informer.stats.errors) == (1, 0)
    assert list(informer.items) == ["ml/d"]


async def test_cached_objects_leave_out_managed_fields(server: tuple[Script, str]) -> None:
    """What the cache keeps of a listed and a watched object: everything but
    ``metadata.managedFields`` (the bulk of a real pod's metadata, read by nothing)."""
    script, url = server
    managed = [
        {
            "manager": "kube-scheduler",
            "operation": "Update",
            "apiVersion": "v1",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {"f:conditions": {}}},
        }
    ]
    listed, watched = node("n1", 1), node("n2", 2)
    for obj in (listed, watched):
        obj["metadata"]["managedFields"] = managed
        obj["metadata"]["labels"] = {"nvidia.com/gpu.memory": "24576"}
    script.lists = [{"items": [listed], "version": "1"}]
    script.watches = [[("ADDED", watched)]]
    client = _client(url)
    seen: list[Node] = []
    informer: Informer[Node] = Informer(
        lambda: client, Node, on_event=lambda _kind, _old, new: seen.append(new)
    )
    informer.start()
    try:
        await eventually(lambda: _true(len(seen) == 2), "both nodes", timeout=10)
    finally:
        await informer.stop()
        await client.close()
    for obj in [*informer.items.values(), *seen]:
        assert obj.metadata is not None
        assert obj.metadata.managedFields is None
        assert obj.metadata.labels == {"nvidia.com/gpu.memory": "24576"}
    assert sorted(informer.items) == ["n1", "n2"]


async def _set(event: asyncio.Event) -> bool:
    return event.is_set()


async def _true(value: bool) -> bool:
    return value
