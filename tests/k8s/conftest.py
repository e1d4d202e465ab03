"""A Kubernetes API for the operator tests: KMock's emulator on 127.0.0.1, with the
discovery verbs, core ``v1/namespaces`` and ``v1/events`` and the slotctl CRDs declared,
a kubeconfig pointing at it, a ``kubectl``-like client, and a record of every request the
operator (kopf) sent (for the RBAC test).

KMock 0.8's path parser fails on ``/api/v1/namespaces[/NAME]`` (it unpacks the namespace
of ``/namespaces/NS/...`` from an empty list and answers 500); kopf lists and watches
namespaces whenever it serves given namespaces, so the fixture patches the parser rather
than switching that off in the operator. The emulator stores objects as plain JSON:
what the API server does on a write (uid, creationTimestamp, generation bump on a spec
change) the client below does, as a real API server would.

KMock decides which of its reactions serves a request by asking ``request in view`` for
each, which it answers by passing every request so far through the view's filters:
quadratic in a long test. The fixture answers it directly for a chain of filters over
the server's root (``_contains``: the same answer, ``test_kmock_harness.py`` compares).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import aiohttp.web
import jsonpatch
import kmock
import kmock._internal.dsl as kmock_dsl
import kmock._internal.parsing as kmock_parsing
import kmock._internal.rendering as kmock_rendering
import pytest
import pytest_asyncio

from controller.operator.crd import crd_documents

GROUP, VERSION = "slotctl.io", "v1alpha1"
TEST_AGENT = "slotctl-tests/kubectl"
T = TypeVar("T")

_original_parse_path = kmock_parsing.parse_path


def _parse_path(path: str) -> kmock_parsing.ParsedPath:
    parts = [p for p in path.strip("/").split("/") if p]
    # /api/v1/namespaces and /api/v1/namespaces/NAME: the namespace *objects*.
    if parts[:2] == ["api", "v1"] and parts[2:3] == ["namespaces"] and len(parts) in (3, 4):
        name = parts[3] if len(parts) == 4 else None
        return kmock_parsing.ParsedPath("", "v1", "namespaces", None, name, None)
    return _original_parse_path(path)


_original_contains = kmock_dsl.View.__contains__


def _contains(self: kmock_dsl.View, item: Any) -> bool:
    """``request in view`` without a pass over every request so far, where that is the
    same answer: for a chain of filters (and priorities) over the server's root view, a
    request is in the view when it is in the root's log and every filter's criteria
    accept it (what iterating the chain computes). KMock asks this for each of its
    built-in reactions on every request, by iterating the whole log through the filters:
    quadratic, most of the CPU of a long operator test. Any other view: KMock's own."""
    if not isinstance(item, kmock_rendering.Request):
        return bool(_original_contains(self, item))
    criteria = []
    view: Any = self
    while True:
        if type(view).__iter__ is kmock_dsl.Filter.__iter__:
            criteria.append(view.criteria)
        elif type(view).__iter__ is not kmock_dsl.Chained.__iter__:  # Priority
            break
        view = view._source
    if not isinstance(view, kmock_dsl.Root) or type(view).__iter__ is not kmock_dsl.Root.__iter__:
        return bool(_original_contains(self, item))
    return all(accepts(item) for accepts in reversed(criteria)) and any(
        request is item for request in reversed(view._requests)
    )


@pytest.fixture(autouse=True)
def _patched_kmock_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kmock_parsing, "parse_path", _parse_path)
    monkeypatch.setattr(kmock_dsl.View, "__contains__", _contains)


def _merge_patch(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns ``old`` into ``new`` (None deletes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif old[key] != value:
            patch[key] = _merge_patch(old[key], value)
    return patch


class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """KMock's emulator plus what kopf and the kubernetes runtime rely on and KMock 0.8
    leaves out: a ``resourceVersion`` on every write (kopf waits for its patches to come
    back through the watch), ``generateName`` (kopf's Events use it), JSON-patch requests
    (kopf adds and removes finalizers with them, with a ``test`` of the resourceVersion):
    applied here and handed on as the equivalent merge patch, or refused with 409/422
    as the API server would; and server-side apply (the runtime's writes), see
    :meth:`_server_side_apply`."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = 0

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _server_side_apply(self, request: Any) -> None:
        """A server-side apply (``application/apply-patch+yaml``, JSON is YAML): creates
        the object when it is missing; else the applied ``spec`` replaces the object's
        (what the applier no longer sets goes: KMock knows no field managers, and the
        kubernetes runtime is the one applier of its objects' specs) and the metadata's
        labels and annotations are merged in."""
        key = (request.resource, request.namespace, request.name)
        current = self.objects._objects.get(key)
        data = copy.deepcopy(request.data)
        meta = data.setdefault("metadata", {})
        if current is None or current.deleted:
            meta.setdefault("namespace", request.namespace)
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("generation", 1)
            object.__setattr__(request, "action", kmock.action.CREATE)
            object.__setattr__(request, "data", data)
            return
        old = copy.deepcopy(current.raw)
        patch: dict[str, Any] = {"metadata": {}}
        for part in ("labels", "annotations"):
            if part in meta:
                patch["metadata"][part] = meta[part]
        if "spec" in data:
            patch["spec"] = _merge_patch(old.get("spec") or {}, data["spec"])
            if patch["spec"]:
                generation = int((old.get("metadata") or {}).get("generation") or 1)
                patch["metadata"]["generation"] = generation + 1
        object.__setattr__(request, "data", patch)

    async def _handle(self, request: Any) -> Any:
        apply = "apply-patch" in str(request.headers.get("Content-Type", ""))
        if request.resource is not None and request.action == kmock.action.UPDATE and apply:
            self._server_side_apply(request)
        if request.resource is not None and request.action == kmock.action.CREATE:
            if isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                meta["resourceVersion"] = self._next_rv()
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
        elif request.resource is not None and request.action == kmock.action.UPDATE:
            key = (request.resource, request.namespace, request.name)
            current = self.objects._objects.get(key)
            data = request.data
            if isinstance(data, list) and current is not None and not current.deleted:
                old = copy.deepcopy(current.raw)
                try:
                    new = jsonpatch.apply_patch(old, data)
                except jsonpatch.JsonPatchTestFailed:
                    return aiohttp.web.json_response(
                        {"kind": "Status", "code": 409, "reason": "Conflict"}, status=409
                    )
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException):
                    return aiohttp.web.json_response(
                        {"kind": "Status", "code": 422, "reason": "Invalid"}, status=422
                    )
                data = _merge_patch(old, new)
            if isinstance(data, dict):
                data.setdefault("metadata", {})
                if data["metadata"] is None:
                    data["metadata"] = {}
                data["metadata"]["resourceVersion"] = self._next_rv()
                object.__setattr__(request, "data", data)  # frozen; the same request goes on
        return await super()._handle(request)


def _verbs(*extra: str) -> set[str]:
    return {"list", "watch", "get", "create", "patch", "update", "delete", *extra}


def declare(emulator: kmock.KubernetesEmulator) -> None:
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs=_verbs()
    )
    emulator.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs=_verbs()
    )
    emulator.resources["events.k8s.io/v1/events"] = kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs=_verbs()
    )
    for kind, plural, short in (
        ("Model", "models", "mdl"),
        ("Slot", "slots", "sl"),
        ("Alias", "aliases", "mal"),
        ("Adapter", "adapters", "mla"),
    ):
        emulator.resources[f"{GROUP}/{VERSION}/{plural}"] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=True,
            verbs=_verbs(),
            shortnames={short},
            categories={"slotctl"},
            subresources={"status"},
        )
    emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition",
        singular="customresourcedefinition",
        namespaced=False,
        verbs=_verbs(),
    )
    for crd in crd_documents().values():
        emulator.objects[
            "apiextensions.k8s.io/v1/customresourcedefinitions", None, crd["metadata"]["name"]
        ] = crd
    for namespace in ("default", "team-a", "team-b"):
        emulator.objects["v1/namespaces", None, namespace] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace},
        }


@dataclass
class Cluster:
    """The emulator, its URL, a kubeconfig and a kubectl-like client."""

    emulator: kmock.KubernetesEmulator
    url: str
    kubeconfig: Path
    session: aiohttp.ClientSession
    uids: dict[tuple[str, str, str], str] = field(default_factory=dict)

    def _path(self, plural: str, namespace: str, name: str | None = None, sub: str = "") -> str:
        core = plural in ("events", "namespaces")
        base = "/api/v1" if core else f"/apis/{GROUP}/{VERSION}"
        if plural == "inferencepools":  # Gateway API Inference Extension's
            base = "/apis/inference.networking.k8s.io/v1"
        path = f"{base}/namespaces/{namespace}/{plural}"
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        namespace = meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        plural = {"Alias": "aliases"}.get(obj["kind"], obj["kind"].lower() + "s")
        async with self.session.post(self._path(plural, namespace), json=obj) as resp:
            assert resp.status < 300, await resp.text()
            result: dict[str, Any] = await resp.json()
            return result

    async def get(
        self, plural: str, name: str, namespace: str = "default"
    ) -> dict[str, Any] | None:
        async with self.session.get(self._path(plural, namespace, name)) as resp:
            if resp.status == 404:
                return None
            assert resp.status == 200, await resp.text()
            result: dict[str, Any] = await resp.json()
            return result

    async def edit(
        self, plural: str, name: str, spec: dict[str, Any], namespace: str = "default"
    ) -> None:
        """``kubectl edit``: a merge patch of the spec; the API server bumps generation."""
        current = await self.get(plural, name, namespace)
        assert current is not None
        generation = int(current["metadata"].get("generation") or 1) + 1
        body = {"spec": spec, "metadata": {"generation": generation}}
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.session.patch(
            self._path(plural, namespace, name), data=json.dumps(body), headers=headers
        ) as resp:
            assert resp.status < 300, await resp.text()

    async def delete(self, plural: str, name: str, namespace: str = "default") -> None:
        async with self.session.delete(self._path(plural, namespace, name)) as resp:
            assert resp.status < 300, await resp.text()

    async def events(self, namespace: str = "default") -> list[dict[str, Any]]:
        async with self.session.get(self._path("events", namespace)) as resp:
            assert resp.status == 200, await resp.text()
            data: dict[str, Any] = await resp.json()
            return list(data.get("items", []))

    def operator_requests(self) -> set[tuple[str, str, str]]:
        """Every (verb, group, resource[/subresource]) kopf sent, as RBAC names them."""
        out = set()
        for request in self.emulator._requests:
            agent = request.headers.get("User-Agent", "")
            if agent.startswith(TEST_AGENT) or request.resource is None:
                continue
            resource = request.resource
            if not resource.plural:
                continue  # discovery (/api, /apis/GROUP/VERSION): no RBAC resource
            method = str(getattr(request.method, "value", request.method)).upper()
            if method == "GET":
                verb = (
                    "watch"
                    if request.params.get("watch") == "true"
                    else ("get" if request.name else "list")
                )
            else:
                verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[
                    method
                ]
            name = resource.plural + (f"/{request.subresource}" if request.subresource else "")
            out.add((verb, resource.group or "", name))
        return out


@pytest_asyncio.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        declare(emulator)
        url = str(server.url).rstrip("/")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                    "users": [{"name": "tester", "user": {"token": "test-token"}}],
                    "contexts": [
                        {"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}
                    ],
                    "current-context": "kmock",
                }
            )
        )
        async with aiohttp.ClientSession(
            base_url=url, headers={"User-Agent": TEST_AGENT}
        ) as session:
            yield Cluster(emulator=emulator, url=url, kubeconfig=kubeconfig, session=session)


@pytest_asyncio.fixture
async def kubelet(cluster: Cluster, tmp_path: Path) -> AsyncIterator[Any]:
    """The fake kubelet over ``cluster`` (tests/k8s/kubelet.py: a pod's container runs as a
    real process), its pods' logs under ``tmp_path/pods``; a module needing another node
    set defines its own."""
    from tests.k8s.kubelet import Kubelet, declare_workloads  # (kubelet imports this module)

    declare_workloads(cluster.emulator)
    logs = tmp_path / "pods"
    logs.mkdir()
    kube = Kubelet(cluster, logs)
    kube.start()
    try:
        yield kube
    finally:
        await kube.stop()


async def eventually(
    check: Callable[[], Awaitable[T]], what: str, timeout: float = 30.0, every: float = 0.05
) -> T:
    """Await ``check`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(every)
