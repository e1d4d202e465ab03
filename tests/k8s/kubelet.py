"""The test as the cluster's workload machinery, for the kubernetes runtime against KMock.

KMock stores objects; nothing acts on them. :class:`Kubelet` plays the three parts the
runtime relies on, through the API as they would:

* the Deployment controller: a Deployment with ``replicas: 1`` gets one Pod from its
  template (a changed template: the old pod goes first, ``Recreate``), ``replicas: 0``
  none; its pods are the ones its selector matches that it owns (a controllerRef), so
  two Deployments of one slot (a surge's instances) each keep their own;
* the scheduler: ``nodeSelector`` (``kubernetes.io/hostname``) or a required node
  affinity on ``metadata.name`` picks the node; without one, the node with the most free
  GPUs (extended resources requested by the pods already there) wins, ties by name; no
  room: the pod stays Pending with ``PodScheduled=False`` (``Unschedulable``);
* the kubelet: it runs the container's args as a real process (the demo server) on a
  loopback address of its own — the pod IP, ``127.0.0.N``, so a probe of 127.0.0.1
  would miss it — and writes the Pod ``Running`` with that ``podIP``; a deleted pod's
  process is stopped. Init containers run first, one after the other, each as a real
  process of its command and args (``slotctl`` is this interpreter's ``python -m
  controller``), the pod ``Pending`` with their ``initContainerStatuses`` meanwhile; one
  that exits non-zero is reported ``terminated`` with its exit code and, under
  ``terminationMessagePolicy: FallbackToLogsOnError``, the tail of its log as its message
  (not restarted: the runtime's verdict comes from the first failure). Volumes are not
  mounted: a hostPath is the host's own directory to the process.

As the real ones do, a pod the Deployment controller deletes *terminates*: it is deleted
with a finalizer of the kubelet's (KMock then sets ``deletionTimestamp`` and keeps it),
its process gets SIGTERM, and the pod goes once the process exited — or after its
``terminationGracePeriodSeconds``, with SIGKILL. A Deployment's new pod waits until its
old ones are gone (``Recreate``). A server that exits on its own is not restarted: its
container is reported ``waiting`` (``CrashLoopBackOff``) with ``restartCount`` and the
exit in ``lastState``, the pod phase stays ``Running`` (``restartPolicy: Always``). An
image named ``unpullable/...`` never starts: ``waiting`` (``ErrImagePull``).

Readiness is then probed by the controller against a real server at the pod IP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kmock

from tests.k8s.conftest import Cluster
from tests.k8s.images import container_argv

REPO = Path(__file__).resolve().parents[2]
HASH = "slotctl.config-hash"
HOLD = "kubelet.test.slotctl.io/terminating"  # the finalizer that keeps a terminating pod
UNPULLABLE = "unpullable/"
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


def declare_workloads(emulator: kmock.KubernetesEmulator) -> None:
    """Deployments, Services, Pods, Nodes and InferencePools, as the runtime uses them."""
    verbs = {"list", "watch", "get", "create", "patch", "update", "delete"}
    for key, kind, namespaced in (
        ("apps/v1/deployments", "Deployment", True),
        ("v1/services", "Service", True),
        ("v1/pods", "Pod", True),
        ("v1/nodes", "Node", False),
        # Gateway API Inference Extension's (the operator's --inference-pools)
        ("inference.networking.k8s.io/v1/inferencepools", "InferencePool", True),
    ):
        emulator.resources[key] = kmock.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced, verbs=verbs
        )


def gpu_node(
    name: str, *, gpus: int, gib_per_gpu: int, replicas: int | None = None
) -> dict[str, Any]:
    """A Node with ``gpus`` GPUs of ``gib_per_gpu`` (GPU feature discovery's labels);
    ``replicas``: time-sliced, more allocatable ``nvidia.com/gpu`` than GPUs."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": str(gib_per_gpu * 1024),
            },
        },
        "status": {
            "allocatable": {
                "nvidia.com/gpu": str(replicas or gpus),
                "memory": "64Gi",
                "cpu": "16",
            },
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


@dataclass
class RunningPod:
    name: str
    slot: str
    ip: str
    process: subprocess.Popen[bytes]


@dataclass
class Kubelet:
    cluster: Cluster
    log_dir: Path
    namespace: str = "default"
    pods: dict[str, RunningPod] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)  # every pod it ever created
    terminating: dict[str, float] = field(default_factory=dict)  # pod -> SIGKILL deadline
    crashed: set[str] = field(default_factory=set)
    start_latency_s: float = 0.3  # ContainerCreating: from the process's start to Running
    starting: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    # pods whose init containers run: pod -> (what is left to run, the server container)
    initializing: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = field(
        default_factory=dict
    )
    init_done: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # their statuses
    _ips: itertools.count[int] = field(default_factory=lambda: itertools.count(2))
    _task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ API

    def _url(self, plural: str, name: str | None = None) -> str:
        base = "/apis/apps/v1" if plural == "deployments" else "/api/v1"
        path = f"{base}/namespaces/{self.namespace}/{plural}"
        return path + (f"/{name}" if name else "")

    async def _list(self, path: str) -> list[dict[str, Any]]:
        async with self.cluster.session.get(path) as resp:
            assert resp.status == 200, await resp.text()
            return list((await resp.json()).get("items") or [])

    async def _post(self, path: str, body: dict[str, Any]) -> None:
        async with self.cluster.session.post(path, json=body) as resp:
            assert resp.status < 300, await resp.text()

    async def _patch(self, path: str, body: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.cluster.session.patch(path, json=body, headers=headers) as resp:
            assert resp.status < 300, await resp.text()

    async def _delete(self, path: str) -> None:
        async with self.cluster.session.delete(path) as resp:
            assert resp.status < 300 or resp.status == 404, await resp.text()

    async def create(self, body: dict[str, Any]) -> None:
        """``kubectl create`` of a workload object (a Node, a foreign Deployment...)."""
        kind = body["kind"]
        if kind == "Node":
            await self._post("/api/v1/nodes", body)
        else:
            body.setdefault("metadata", {}).setdefault("namespace", self.namespace)
            await self._post(self._url(kind.lower() + "s"), body)

    async def get(self, plural: str, name: str) -> dict[str, Any] | None:
        async with self.cluster.session.get(self._url(plural, name)) as resp:
            if resp.status == 404:
                return None
            assert resp.status == 200, await resp.text()
            result: dict[str, Any] = await resp.json()
            return result

    # ------------------------------------------------------------------ the loop

    async def run(self, every: float = 0.05) -> None:
        while True:
            await self.step()
            await asyncio.sleep(every)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="test-kubelet")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for pod in list(self.pods.values()):
            self._kill(pod)
        self.pods.clear()

    async def step(self) -> None:
        deployments = await self._list(self._url("deployments"))
        pods = await self._list(self._url("pods"))
        nodes = await self._list("/api/v1/nodes")
        live = {p["metadata"]["name"] for p in pods}
        for name in [n for n in self.pods if n not in live]:  # deleted through the API
            self._kill(self.pods.pop(name))
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp"):
                await self._finish_termination(pod)
        now = asyncio.get_running_loop().time()
        for name, (due, status) in list(self.starting.items()):
            running = self.pods.get(name)
            if running is None or name in self.terminating:
                del self.starting[name]
            elif running.process.poll() is not None:
                del self.starting[name]  # exited while being created: crash-looping (below)
            elif now >= due:
                del self.starting[name]
                await self._patch(self._url("pods", name), {"status": status})
        for name in list(self.initializing):
            await self._step_init(name)
        for name, running in list(self.pods.items()):
            code = running.process.poll()
            if code is None or name in self.terminating or name in self.crashed:
                continue
            if name in self.initializing:
                continue
            await self._report_crash(name, code)
        for dep in deployments:
            await self._reconcile(dep, pods, nodes)

    async def _terminate(self, pod: dict[str, Any]) -> None:
        """A graceful delete: the pod stays (terminating) until its process is gone."""
        name = pod["metadata"]["name"]
        if pod["metadata"].get("deletionTimestamp") or name in self.terminating:
            return
        grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        await self._patch(self._url("pods", name), {"metadata": {"finalizers": [HOLD]}})
        await self._delete(self._url("pods", name))
        self.terminating[name] = asyncio.get_running_loop().time() + grace
        running = self.pods.get(name)
        if running is not None and running.process.poll() is None:
            running.process.send_signal(signal.SIGTERM)

    async def _finish_termination(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if HOLD not in (pod["metadata"].get("finalizers") or []):
            return  # someone else's finalizer (a test's): not the kubelet's to release
        running = self.pods.get(name)
        deadline = self.terminating.get(name, 0.0)
        if running is not None and running.process.poll() is None:
            if asyncio.get_running_loop().time() < deadline:
                return  # still within its grace period
            running.process.kill()  # the grace period is over: SIGKILL
            running.process.wait()
        self.pods.pop(name, None)
        self.terminating.pop(name, None)
        await self._patch(self._url("pods", name), {"metadata": {"finalizers": []}})

    async def _report_crash(self, name: str, code: int) -> None:
        """A server that exited by itself: restartPolicy Always, so the kubelet would
        restart it with a growing back-off; reported as that back-off (not restarted)."""
        self.crashed.add(name)
        pod = await self.get("pods", name)
        if pod is None:
            return
        pod["status"]["phase"] = "Running"  # the container ran: restartPolicy Always
        (status,) = pod["status"]["containerStatuses"]
        status.update(
            {
                "restartCount": int(status.get("restartCount", 0)) + 1,
                "state": {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off 10s restarting failed container {status['name']}",
                    }
                },
                "lastState": {"terminated": {"exitCode": code, "reason": "Error"}},
            }
        )
        await self._patch(self._url("pods", name), {"status": pod["status"]})

    async def _reconcile(
        self, dep: dict[str, Any], pods: list[dict[str, Any]], nodes: list[dict[str, Any]]
    ) -> None:
        selector = dep["spec"]["selector"]["matchLabels"]
        owner = dep["metadata"]["name"]
        mine = [  # its own pods: matched by its selector and owned by it (a controllerRef)
            p
            for p in pods
            if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            and _owner(p) in (owner, None)
        ]
        template = dep["spec"]["template"]
        wanted = (template["metadata"].get("annotations") or {}).get(HASH)
        replicas = int(dep["spec"].get("replicas") or 0)
        stale = [p for p in mine if (p["metadata"].get("annotations") or {}).get(HASH) != wanted]
        if replicas == 0 or stale:  # scaled down, or Recreate: the old pods go first
            for pod in mine if replicas == 0 else stale:
                await self._terminate(pod)
            return
        if any(p["metadata"].get("deletionTimestamp") for p in mine):
            return  # Recreate: the new pod once the old ones are gone
        if mine:
            pod = mine[0]
            if not pod["spec"].get("nodeName") and self._schedule(
                dict(template["spec"]), pods, nodes
            ):
                # unschedulable so far, but a node has room now: placed on the next step
                await self._delete(self._url("pods", pod["metadata"]["name"]))
            return
        await self._create_pod(dep, template, pods, nodes)

    async def _create_pod(
        self,
        dep: dict[str, Any],
        template: dict[str, Any],
        pods: list[dict[str, Any]],
        nodes: list[dict[str, Any]],
    ) -> None:
        name = f"{dep['metadata']['name']}-{uuid.uuid4().hex[:5]}"
        spec = dict(template["spec"])
        node = self._schedule(spec, pods, nodes)
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": dict(template["metadata"].get("labels") or {}),
                "annotations": dict(template["metadata"].get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": dep["metadata"]["name"],
                        "uid": dep["metadata"].get("uid") or dep["metadata"]["name"],
                        "controller": True,
                    }
                ],
            },
            "spec": {**spec, **({"nodeName": node} if node else {})},
            "status": {"phase": "Pending"},
        }
        if node is None:
            pod["status"]["conditions"] = [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/2 nodes are available: insufficient nvidia.com/gpu",
                }
            ]
            await self._post(self._url("pods"), pod)
            return
        await self._post(self._url("pods"), pod)
        self.created.append(name)
        container = spec["containers"][0]
        inits = [dict(c) for c in spec.get("initContainers") or []]
        if inits:
            slot = pod["metadata"]["labels"].get("slotctl.slot", "")
            self.initializing[name] = (inits, container)
            self.init_done[name] = []
            await self._start_init(name, slot)
            return
        await self._start_main(name, pod["metadata"]["labels"].get("slotctl.slot", ""), container)

    async def _start_init(self, name: str, slot: str) -> None:
        """The next init container of pod ``name`` as a process; the pod Pending."""
        inits, _ = self.initializing[name]
        init = inits[0]
        process = self._run_init(name, init)
        self.pods[name] = RunningPod(name, slot, "", process)
        running = {
            "name": init["name"],
            "ready": False,
            "restartCount": 0,
            "image": init.get("image", ""),
            "imageID": "",
            "state": {"running": {"startedAt": "2026-12-01T00:00:00Z"}},
        }
        status = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "initContainerStatuses": [*self.init_done[name], running],
        }
        await self._patch(self._url("pods", name), {"status": status})

    async def _step_init(self, name: str) -> None:
        """An init container that exited: the next one, the server, or its failure."""
        running = self.pods.get(name)
        if running is None or name in self.terminating:
            self.initializing.pop(name, None)
            return
        code = running.process.poll()
        if code is None:
            return
        inits, container = self.initializing[name]
        init = inits.pop(0)
        terminated: dict[str, Any] = {
            "exitCode": code,
            "reason": "Completed" if not code else "Error",
        }
        if code and init.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            log = (self.log_dir / f"{name}.{init['name']}.log").read_text(errors="replace")
            terminated["message"] = "\n".join(log.splitlines()[-20:])
        self.init_done[name].append(
            {
                "name": init["name"],
                "ready": not code,
                "restartCount": 0,
                "image": init.get("image", ""),
                "imageID": "",
                "state": {"terminated": terminated},
            }
        )
        self.pods.pop(name, None)
        if code:  # not restarted here: the runtime's verdict comes from the first failure
            self.initializing.pop(name)
            status = {"phase": "Pending", "initContainerStatuses": self.init_done[name]}
            await self._patch(self._url("pods", name), {"status": status})
            return
        if inits:
            await self._start_init(name, running.slot)
            return
        self.initializing.pop(name)
        await self._start_main(name, running.slot, container)

    def _run_init(self, name: str, init: dict[str, Any]) -> subprocess.Popen[bytes]:
        """An init container's command and args as a process (``slotctl``: this package)."""
        argv = [*(init.get("command") or []), *(init.get("args") or [])]
        assert argv and argv[0] == "slotctl", argv
        argv = [sys.executable, "-m", "controller", *argv[1:]]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.update({e["name"]: e["value"] for e in init.get("env") or [] if "value" in e})
        log = (self.log_dir / f"{name}.{init['name']}.log").open("ab")
        with log:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    async def _start_main(self, name: str, slot: str, container: dict[str, Any]) -> None:
        if str(container.get("image", "")).startswith(UNPULLABLE):
            pulling = {
                "name": container["name"],
                "ready": False,
                "restartCount": 0,
                "image": container["image"],
                "imageID": "",
                "state": {
                    "waiting": {
                        "reason": "ErrImagePull",
                        "message": f"failed to pull image {container['image']!r}: not found",
                    }
                },
            }
            status = {"phase": "Pending", "containerStatuses": [pulling]}
            await self._patch(self._url("pods", name), {"status": status})
            return
        ip = f"127.0.0.{next(self._ips)}"
        process = self._run(name, container, ip)
        self.pods[name] = RunningPod(name, slot, ip, process)
        status = {
            "phase": "Running",
            "podIP": ip,
            "startTime": "2026-12-01T00:00:00Z",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": container["name"],
                    "ready": False,
                    "restartCount": 0,
                    "image": container["image"],
                    "imageID": "",
                    "state": {"running": {"startedAt": "2026-12-01T00:00:00Z"}},
                }
            ],
            **({"initContainerStatuses": self.init_done[name]} if name in self.init_done else {}),
        }
        # ContainerCreating for a moment (as a kubelet does), then Running; a server that
        # exited meanwhile is reported crash-looping instead (see step)
        creating = {
            "phase": "Pending",
            "conditions": status["conditions"],
            "containerStatuses": [
                {
                    **status["containerStatuses"][0],
                    "state": {"waiting": {"reason": "ContainerCreating"}},
                }
            ],
        }
        await self._patch(self._url("pods", name), {"status": creating})
        self.starting[name] = (asyncio.get_running_loop().time() + self.start_latency_s, status)

    @staticmethod
    def _schedule(
        spec: dict[str, Any], pods: list[dict[str, Any]], nodes: list[dict[str, Any]]
    ) -> str | None:
        wanted = (spec.get("nodeSelector") or {}).get("kubernetes.io/hostname") or _affinity(spec)
        requests = spec["containers"][0].get("resources", {}).get("requests") or {}
        need = {r: int(requests.get(r, 0)) for r in GPU_RESOURCES}
        best: tuple[int, str] | None = None
        for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
            name = node["metadata"]["name"]
            if wanted and name != wanted:
                continue
            allocatable = node.get("status", {}).get("allocatable", {})
            used = {r: 0 for r in GPU_RESOURCES}
            for pod in pods:
                if pod["spec"].get("nodeName") == name:
                    asked = pod["spec"]["containers"][0].get("resources", {}).get("requests") or {}
                    for r in GPU_RESOURCES:
                        used[r] += int(asked.get(r, 0))
            free = {r: int(allocatable.get(r, 0)) - used[r] for r in GPU_RESOURCES}
            if any(need[r] > free[r] for r in GPU_RESOURCES):
                continue
            score = sum(free.values())
            if best is None or score > best[0]:
                best = (score, name)
        return best[1] if best else None

    def _run(self, name: str, container: dict[str, Any], ip: str) -> subprocess.Popen[bytes]:
        """The container's argv as a process (:func:`container_argv`: its command, or its
        image's entrypoint, and its args): the image's ``python3`` is this interpreter,
        ``slotctl`` (slotctl's image's entrypoint) this package, and the server binds the
        pod's IP (``--host 0.0.0.0`` inside a pod)."""
        args = container_argv(container)
        assert args and args[0] in ("python3", "slotctl"), args
        python = [sys.executable]
        args[:1] = python if args[0] == "python3" else [*python, "-m", "controller"]
        args = [ip if a == "0.0.0.0" else a for a in args]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.update(
            {
                e["name"]: e.get("value", "")
                for e in container.get("env") or []
                if "valueFrom" not in e
            }
        )
        log = (self.log_dir / f"{name}.log").open("ab")
        with log:
            return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)

    @staticmethod
    def _kill(pod: RunningPod) -> None:
        if pod.process.poll() is None:
            pod.process.send_signal(signal.SIGTERM)
            try:
                pod.process.wait(5)
            except subprocess.TimeoutExpired:
                pod.process.kill()
                pod.process.wait()

    def alive(self, slot: str) -> list[RunningPod]:
        return [p for p in self.pods.values() if p.slot == slot and p.process.poll() is None]


def _owner(pod: dict[str, Any]) -> str | None:
    """The Deployment a pod's controllerRef names (None: none, a pod made by hand)."""
    refs = pod["metadata"].get("ownerReferences") or []
    return next((str(r["name"]) for r in refs if r.get("controller")), None)


def _affinity(spec: dict[str, Any]) -> str | None:
    """The node a required node affinity on ``metadata.name`` names (the one term the
    runtime writes), if any."""
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for field_ in term.get("matchFields") or []:
            if field_.get("key") == "metadata.name" and field_.get("operator") == "In":
                return str(field_["values"][0])
    return None


async def answers(endpoint: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with aiohttp.ClientSession() as session, session.get(f"{endpoint}/v1/models") as r:
            return r.status == 200
    return False
