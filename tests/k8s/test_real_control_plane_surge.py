"""A surge rollout on the real control plane (:mod:`tests.k8s.realcluster`: the real
scheduler, Deployment/ReplicaSet controllers and garbage collector, kwok GPU nodes, real
demo servers on the pods' IPs): a spec change of a Slot with room on its time-sliced GPU
starts the new pod beside the old one, and a watch of the slot's pods sees a Ready pod
of it at every event from the first Ready to the end; the old instance's Deployment is
deleted, one pod remains, and the operator (the chart's RBAC) answered every request at
the slot's endpoint meanwhile. Skipped when the binaries are not built, unless
``SLOTCTL_K8S_APISERVER=1`` (:mod:`tests.k8s.test_real_control_plane`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.k8s.conftest import eventually
from tests.k8s.realcluster import Cluster
from tests.k8s.test_operator import answers
from tests.k8s.test_real_control_plane import Env, bin_dir, cluster, env, model, stop_operator

__all__ = ["bin_dir", "cluster", "env"]  # the fixtures, used by name
pytestmark = pytest.mark.timeout(300)


def _ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return status.get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


@dataclass
class PodWatch:
    """Every event of one slot's pods, in the API server's order (a list, then a watch
    from its resourceVersion), with the Ready pods after each."""

    cluster: Cluster
    namespace: str
    slot: str
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[str, str, frozenset[str]]] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _get(self, query: dict[str, str], timeout: float) -> Any:
        api = self.cluster.api
        path = f"/api/v1/namespaces/{self.namespace}/pods?" + urllib.parse.urlencode(
            {"labelSelector": f"slotctl.slot={self.slot}", **query}
        )
        req = urllib.request.Request(
            api.url + path, headers={"Authorization": f"Bearer {api.admin_token}"}
        )
        return urllib.request.urlopen(req, context=api.ssl_context(), timeout=timeout)

    def _record(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        with self._lock:
            self.seen.add(name)
            if kind == "DELETED":
                self.pods.pop(name, None)
            else:
                self.pods[name] = pod
            ready = frozenset(n for n, p in self.pods.items() if _ready(p))
            self.history.append((kind, name, ready))

    def start(self) -> None:
        with self._get({}, 30) as resp:
            body = json.loads(resp.read())
        for pod in body.get("items", []):
            self._record("LISTED", pod)
        version = str(body["metadata"]["resourceVersion"])
        self._thread = threading.Thread(target=self._run, args=(version,), daemon=True)
        self._thread.start()

    def _run(self, version: str) -> None:
        while not self._stop.is_set():
            query = {"watch": "true", "resourceVersion": version, "timeoutSeconds": "5"}
            with self._get(query, 30) as resp:
                for line in resp:
                    event = json.loads(line)
                    assert event["type"] != "ERROR", event  # (no 410 within one test)
                    version = event["object"]["metadata"]["resourceVersion"]
                    self._record(event["type"], event["object"])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def ready_now(self) -> frozenset[str]:
        with self._lock:
            return self.history[-1][2] if self.history else frozenset()


def auto_slot(name: str, model_id: str, *extra: str) -> dict[str, Any]:
    """A Slot that leaves its port to the operator (a declared port always recreates)."""
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Slot",
        "metadata": {"name": name},
        "spec": {
            "provider": "demo",
            "model": {"default": model_id},
            "autoload": True,
            "server": {"image": "slotctl:test", "extra_args": ["--load-seconds", "0.2", *extra]},
        },
    }


async def test_a_spec_change_with_room_surges_with_a_ready_pod_at_every_moment(
    env: Env,
) -> None:
    env.cluster.add_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4)  # time-sliced
    await env.admin.create(model("m2", 2))
    await env.admin.create(auto_slot("chat", "m2"))

    async def ready(generation: int) -> dict[str, Any] | None:
        obj = await env.admin.get("slots", "chat")
        status = (obj or {}).get("status") or {}
        ok = any(
            c["type"] == "Ready" and c["status"] == "True" and c["observedGeneration"] == generation
            for c in status.get("conditions") or []
        )
        if generation > 1:
            ok = ok and (status.get("rollout") or {}).get("phase") == "done"
        return obj if ok else None

    first = await eventually(lambda: ready(1), "chat Ready", 120)
    watch = PodWatch(env.cluster, env.namespace, "chat")
    await asyncio.to_thread(watch.start)
    await eventually(lambda: _true(len(watch.ready_now()) == 1), "its pod Ready in the watch")
    (old,) = watch.ready_now()
    answered: list[bool] = []
    stop = asyncio.Event()

    async def keep_asking() -> None:  # the Slot's endpoint, whichever it says now
        while not stop.is_set():
            obj = await env.admin.get("slots", "chat")
            endpoint = ((obj or {}).get("status") or {}).get("endpoint")
            if endpoint:
                answered.append(await answers(endpoint))

    asking = asyncio.create_task(keep_asking())
    try:
        await env.admin.patch(
            "slots", "chat", {"spec": {"server": {"extra_args": ["--load-seconds", "0.5"]}}}
        )
        done = await eventually(lambda: ready(2), "the surge done", 120)

        async def settled() -> bool:
            ready_pods = watch.ready_now()
            return len(watch.pods) == 1 and len(ready_pods) == 1 and old not in ready_pods

        await eventually(settled, "one new pod left", 60)
    finally:
        stop.set()
        await asking
        await asyncio.to_thread(watch.stop)

    rollout = done["status"]["rollout"]
    assert rollout["strategy"] == "surge", rollout
    # from the first Ready pod on, every event left a Ready pod of the slot
    after = [h for h in watch.history if h[2]]
    start = watch.history.index(after[0])
    gaps = [h for h in watch.history[start:] if not h[2]]
    assert not gaps, gaps
    assert max(len(h[2]) for h in watch.history) == 2  # the new one Ready beside the old
    assert len(watch.seen) == 2, watch.seen  # two pods of the slot ever: no duplicate
    (new,) = watch.ready_now()
    assert new.startswith("slotctl1-chat-"), new
    assert answered and all(answered), f"{answered.count(False)} of {len(answered)} failed"
    assert done["status"]["endpoint"] != first["status"]["endpoint"]
    assert await answers(done["status"]["endpoint"])

    async def old_deployment_gone() -> bool:
        status, _ = env.cluster.api.request(
            "GET", f"/apis/apps/v1/namespaces/{env.namespace}/deployments/slotctl-chat"
        )
        return status == 404

    await eventually(old_deployment_gone, "the old instance's Deployment deleted", 60)
    status, service = env.cluster.api.request(
        "GET", f"/api/v1/namespaces/{env.namespace}/services/slotctl-chat"
    )
    assert status == 200 and service["spec"]["selector"]["slotctl.instance"] == "1"
    assert env.proc is not None and await stop_operator(env.proc) == 0


async def _true(value: bool) -> bool:
    return value
