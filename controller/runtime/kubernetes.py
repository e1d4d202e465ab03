"""The kubernetes runtime: each slot's server is a Deployment ``slotctl-<slot>`` + a Service.

Sits beside :mod:`controller.runtime.docker` under the :class:`~controller.runtime.base.Runtime`
seam (``slotctl operator --runtime kubernetes``, the default inside a pod); the slot
manager is its only caller. It talks to the API server through lightkube's typed async
client (docs/design/0005-kubernetes-runtime.md says why that one):

* **objects**: one Deployment per slot (``replicas`` 1 while loaded, 0 once unloaded,
  strategy ``Recreate``: never two servers of one slot) and one Service selecting its
  pod, in the runtime's namespace. Labels ``slotctl.managed=true``, ``slotctl.slot``,
  ``slotctl.stack``, ``slotctl.config-hash``; the config hash (again) and the port as
  annotations. An object with a slot's
  name but without those labels is reported (``Observed(managed=False)``) and never
  patched, scaled or deleted; a labelled Deployment that runs the same config is
  adopted (no second pod after an operator restart);
* **placement**: GPUs as extended resources (``nvidia.com/gpu`` or ``amd.com/gpu``, one
  per slot), the slot's ``node`` as a ``nodeSelector`` (``kubernetes.io/hostname``);
  without one the scheduler places the pod and the slot is admitted against the node it
  lands on (:attr:`Observed.node`, see :mod:`controller.slots.admission`);
* **model files**: a LaunchSpec mount whose source is a name is a PersistentVolumeClaim
  (the slot's ``server.volume``, read-only at the models dir); one whose source is a path
  is a hostPath;
* **readiness**: :meth:`start` returns once the pod runs and has an IP; the manager
  probes ``http://<pod IP>:<port>`` like any other server (:attr:`Observed.endpoint`);
* **memory**: :attr:`KubernetesRuntime.memory` is the admission's memory probe for
  ``NODE/DEVICE`` keys, from the nodes' allocatable resources (refreshed in the
  background).

``stop`` scales a running slot to 0 and waits for its pod to go — a terminating pod
(``deletionTimestamp`` set, its server still running within its grace period) counts as
still there; the kubelet sends SIGTERM and, after the pod's grace period, SIGKILL. Still
there after the stop's timeout + that grace: :class:`~controller.errors.SlotTerminateTimeout`
(nothing is force-deleted). A stop of a slot already at 0 with no pod left deletes the
Deployment and the Service (a slot nobody declares any more: the reconciler's orphan
sweep). A start that fails after it scaled the Deployment to 1 (the Service refused, a
crash-looping or unpullable container, an API error, a cancellation) scales it back to 0
before it raises. Slot names longer than :data:`MAX_SLOT_NAME` are refused (``slotctl-``
+ the name is a Service name, a DNS label of at most 63 characters).

**Ownership**: every Deployment and Service carries ``slotctl.owner`` (the operator's
identity: ``SLOTCTL_K8S_OWNER``, the chart sets the Helm release name; default
``slotctl``) in its metadata labels, not in its selector; only objects with this
runtime's owner are listed, adopted, scaled or deleted, so two releases in one namespace
leave each other's slots alone. API failures become typed
errors: :class:`~controller.errors.SlotSpawnFailed` from ``start``,
:class:`~controller.errors.DockerEngineError` (``runtime.engine_error``: the API said no)
or :class:`~controller.errors.DockerUnavailable` (``runtime.unavailable``: no API server)
from the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, TypeVar, cast

import httpx2
from lightkube import ApiError, AsyncClient, ConfigError
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Node, Pod, Service
from lightkube.types import PatchType

from controller.errors import (
    DockerEngineError,
    DockerUnavailable,
    SlotctlError,
    SlotSpawnFailed,
    SlotTerminateTimeout,
)
from controller.memory import DeviceMemory
from controller.runtime.base import (
    HASH_LABEL,
    MANAGED_LABEL,
    SLOT_LABEL,
    STACK_LABEL,
    LaunchSpec,
    Mount,
    Observed,
    ProgressCallback,
    RunStatus,
)

__all__ = [
    "GPU_RESOURCES",
    "MAX_SLOT_NAME",
    "KubernetesRuntime",
    "NodeMemory",
    "check_slot_name",
    "deployment_body",
    "node_budgets",
    "object_name",
    "parse_quantity",
    "service_body",
]

log = logging.getLogger("slotctl.runtime")

OBJECT_PREFIX: Final = "slotctl-"
PORT_ANNOTATION: Final = "slotctl.port"
HOSTNAME_LABEL: Final = "kubernetes.io/hostname"
GPU_RESOURCES: Final = ("nvidia.com/gpu", "amd.com/gpu")
# MiB per GPU, as NVIDIA's GPU feature discovery labels a node.
GPU_MEMORY_LABEL: Final = "nvidia.com/gpu.memory"
GPU_COUNT_LABEL: Final = "nvidia.com/gpu.count"
CONTAINER: Final = "server"
FIELD_MANAGER: Final = "slotctl"
OWNER_LABEL: Final = "slotctl.owner"
DEFAULT_OWNER: Final = "slotctl"
# A Service name is a DNS-1035 label (63 characters at most): "slotctl-" + the slot's name.
MAX_SLOT_NAME: Final = 63 - len(OBJECT_PREFIX)
_LABEL_VALUE_RE: Final = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# Container waiting reasons after which a start fails at once: the kubelet would only
# retry with a growing back-off (the pod phase stays Running or Pending, never Failed).
FATAL_WAITING: Final = frozenset(
    {"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName"}
)

T = TypeVar("T")


def object_name(slot: str) -> str:
    return f"{OBJECT_PREFIX}{slot}"


def check_slot_name(slot: str) -> None:
    """Refuse a slot whose object names would not be valid (SlotSpawnFailed, before any
    API call): its Service ``slotctl-<slot>`` must be a DNS label of <= 63 characters."""
    if len(slot) > MAX_SLOT_NAME:
        raise SlotSpawnFailed(
            f"slot {slot!r} has {len(slot)} characters: the kubernetes runtime names its "
            f"Service {OBJECT_PREFIX}<slot>, a DNS label of at most 63 characters, so slot "
            f"names are limited to {MAX_SLOT_NAME} characters here; rename the slot",
            slot=slot,
        )


_QUANTITY_RE: Final = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")
_SUFFIXES: Final[dict[str, int | float]] = {
    "": 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "m": 1e-3,
}


def parse_quantity(text: str) -> int | None:
    """A Kubernetes quantity (``16Gi``, ``2``, ``500M``) as an integer; None if not one."""
    match = _QUANTITY_RE.match(str(text).strip())
    if match is None or match.group(2) not in _SUFFIXES:
        return None
    return int(float(match.group(1)) * _SUFFIXES[match.group(2)])


def node_budgets(allocatable: Mapping[str, str], labels: Mapping[str, str]) -> dict[str, int]:
    """Device -> bytes a node offers (pure): ``gpu`` = its GPUs (the ``nvidia.com/gpu.count``
    label, else the allocatable ``nvidia.com/gpu`` / ``amd.com/gpu``) x the per-GPU memory
    its ``nvidia.com/gpu.memory`` label states (MiB); ``cpu`` = allocatable memory.
    A device the node says nothing about is absent (the controller settings apply)."""
    budgets: dict[str, int] = {}
    # physical GPUs (GFD's count label: time-slicing advertises more allocatable replicas)
    gpus = parse_quantity(labels.get(GPU_COUNT_LABEL, "")) or max(
        (parse_quantity(allocatable.get(r, "0")) or 0) for r in GPU_RESOURCES
    )
    per_gpu = parse_quantity(labels.get(GPU_MEMORY_LABEL, ""))
    if gpus and per_gpu:
        budgets["gpu"] = gpus * per_gpu * 2**20
    memory = parse_quantity(allocatable.get("memory", ""))
    if memory:
        budgets["cpu"] = memory
    return budgets


class NodeMemory:
    """The admission's memory probe on a cluster (a :class:`controller.memory.MemoryProbe`).

    ``NODE/DEVICE`` keys answer with that node's budget (:func:`node_budgets`); a bare
    device (a slot the scheduler has not placed yet) with the largest node's, so a slot
    that fits on no node is refused before anything is scaled. Nothing measures a remote
    GPU: free = total, and the admitted bytes per key do the accounting. A node or
    device the nodes say nothing about answers None (``memory_budget_gb`` applies).
    """

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, int]] = {}
        self.gpu_resources: dict[str, str] = {}  # node -> the GPU resource it offers

    def update(self, nodes: Sequence[Node]) -> None:
        seen: dict[str, dict[str, int]] = {}
        resources: dict[str, str] = {}
        for node in nodes:
            name = node.metadata.name if node.metadata else None
            if not name:
                continue
            allocatable = dict((node.status.allocatable if node.status else None) or {})
            labels = dict((node.metadata.labels if node.metadata else None) or {})
            seen[name] = node_budgets(allocatable, labels)
            for resource in GPU_RESOURCES:
                if parse_quantity(allocatable.get(resource, "0")):
                    resources[name] = resource
        self.nodes, self.gpu_resources = seen, resources

    def sample(self, device: str) -> DeviceMemory | None:
        node, sep, kind = device.rpartition("/")
        if sep:
            total = self.nodes.get(node, {}).get(kind)
        else:
            totals = [b[kind] for b in self.nodes.values() if kind in b]
            total = max(totals) if totals else None
        if total is None:
            return None
        return DeviceMemory(device=device, total_bytes=total, free_bytes=total, source="node")


def _labels(launch: LaunchSpec) -> dict[str, str]:
    """SPEC §3's labels (the selector uses only the first two: it is immutable)."""
    return launch.labels()


def _selector(slot: str) -> dict[str, str]:
    return {MANAGED_LABEL: "true", SLOT_LABEL: slot}


def _volumes(mounts: Sequence[Mount]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes, volume_mounts = [], []
    for index, mount in enumerate(mounts):
        name = f"m{index}"
        if mount.source.startswith("/"):
            volumes.append({"name": name, "hostPath": {"path": mount.source}})
        else:
            claim = {"claimName": mount.source, "readOnly": mount.read_only}
            volumes.append({"name": name, "persistentVolumeClaim": claim})
        volume_mounts.append({"name": name, "mountPath": mount.target, "readOnly": mount.read_only})
    return volumes, volume_mounts


def deployment_body(
    launch: LaunchSpec,
    namespace: str,
    *,
    replicas: int = 1,
    gpu_resource: str = GPU_RESOURCES[0],
    termination_grace_s: int = 30,
    owner: str = DEFAULT_OWNER,
) -> dict[str, Any]:
    """The Deployment that runs ``launch`` (pure; a merge patch of it updates one)."""
    if launch.device == "npu":
        raise SlotSpawnFailed(
            f"slot {launch.slot!r}: the kubernetes runtime has no extended resource for an "
            "npu; run npu slots with the process or docker runtime",
            slot=launch.slot,
            device=launch.device,
        )
    annotations = {HASH_LABEL: launch.config_hash(), PORT_ANNOTATION: str(launch.port)}
    volumes, volume_mounts = _volumes(launch.mounts)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": launch.image,
        "args": list(launch.argv),
        "env": [{"name": k, "value": v} for k, v in sorted(launch.env.items())],
        "ports": [{"name": "http", "containerPort": launch.port}],
        "volumeMounts": volume_mounts,
        "resources": (
            {"limits": {gpu_resource: "1"}, "requests": {gpu_resource: "1"}}
            if launch.device == "gpu"
            else {}
        ),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "enableServiceLinks": False,
        # the server needs no API access: no service-account token in the pod
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_s,
        # a merge patch: None removes a node a previous config had
        "nodeSelector": {HOSTNAME_LABEL: launch.node} if launch.node else None,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": object_name(launch.slot),
            "namespace": namespace,
            "labels": {**_labels(launch), OWNER_LABEL: owner},
            "annotations": annotations,
        },
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "Recreate", "rollingUpdate": None},
            "selector": {"matchLabels": _selector(launch.slot)},
            "template": {
                "metadata": {"labels": _labels(launch), "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def service_body(launch: LaunchSpec, namespace: str, owner: str = DEFAULT_OWNER) -> dict[str, Any]:
    """The Service in front of the slot's pod: a stable in-cluster name for its port."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": object_name(launch.slot),
            "namespace": namespace,
            "labels": {**_labels(launch), OWNER_LABEL: owner},
            "annotations": {PORT_ANNOTATION: str(launch.port)},
        },
        "spec": {
            "selector": _selector(launch.slot),
            "ports": [{"name": "http", "port": launch.port, "targetPort": launch.port}],
        },
    }


def _owned(labels: Mapping[str, str] | None, slot: str, owner: str) -> bool:
    """Ours: slotctl's labels for this slot, and this runtime's owner."""
    labels = labels or {}
    return (
        labels.get(MANAGED_LABEL) == "true"
        and labels.get(SLOT_LABEL) == slot
        and labels.get(OWNER_LABEL) == owner
    )


def _terminating(pod: Pod) -> bool:
    return bool(pod.metadata and pod.metadata.deletionTimestamp)


def _timestamp(value: Any) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    return None


def _pod_state(pod: Pod) -> tuple[bool, int | None, str]:
    """(running, exit code, words) of a pod's server container."""
    status = pod.status
    phase = (status.phase if status else None) or "Pending"
    if phase in ("Succeeded", "Failed"):
        return False, None, f"pod {phase.lower()}: {(status.message if status else '') or ''}"
    for cs in (status.containerStatuses if status else None) or []:
        if cs.name != CONTAINER:
            continue
        state = cs.state
        if state and state.running:
            break
        if state and state.terminated:
            code = state.terminated.exitCode
            return False, code, f"exited with code {code} ({state.terminated.reason or ''})"
        if state and state.waiting:
            last = cs.lastState.terminated if cs.lastState else None
            return (
                False,
                last.exitCode if last else None,
                f"waiting: {state.waiting.reason or ''} {state.waiting.message or ''}",
            )
    running = phase == "Running" and bool(status and status.podIP)
    return running, None, "running" if running else f"pod {phase.lower()}"


def _start_failure(pod: Pod) -> tuple[str, int | None] | None:
    """(words, last exit code) when the server container will not come up without help: it
    waits for a reason in :data:`FATAL_WAITING`, or it was restarted after it exited."""
    for cs in (pod.status.containerStatuses if pod.status else None) or []:
        if cs.name != CONTAINER or (cs.state and cs.state.running):
            continue
        last = cs.lastState.terminated if cs.lastState else None
        code = last.exitCode if last else None
        waiting = cs.state.waiting if cs.state else None
        reason = (waiting.reason if waiting else None) or ""
        if reason in FATAL_WAITING or (cs.restartCount and last is not None):
            exited = f"; last exit code {code} ({last.reason or ''})" if last else ""
            detail = f": {waiting.message}" if waiting and waiting.message else ""
            return f"container {reason or 'restarted'}{detail}{exited}", code
    return None


def _unschedulable(pod: Pod) -> str | None:
    for cond in (pod.status.conditions if pod.status else None) or []:
        if cond.type == "PodScheduled" and cond.status == "False":
            return cond.message or cond.reason or "unschedulable"
    return None


class KubernetesRuntime:
    """Runtime for servers run as pods of per-slot Deployments (see module docstring)."""

    kind = "kubernetes"

    def __init__(
        self,
        client: AsyncClient | None = None,
        *,
        namespace: str | None = None,
        gpu_resource: str | None = None,
        owner: str | None = None,
        start_timeout_s: float = 900.0,
        unschedulable_s: float = 120.0,
        stop_grace_s: float = 10.0,
        termination_grace_s: float = 30.0,
        poll_s: float = 0.2,
        node_refresh_s: float = 15.0,
    ) -> None:
        """``client``: a lightkube ``AsyncClient`` (default: the in-cluster service account,
        else ``KUBECONFIG`` / ``~/.kube/config``, created on first use). ``namespace``: where
        the Deployments live (default ``SLOTCTL_K8S_NAMESPACE``, else the client's).
        ``gpu_resource``: the extended resource of a gpu slot whose node does not say
        (default ``SLOTCTL_K8S_GPU_RESOURCE`` or ``nvidia.com/gpu``). ``owner``: the
        ``slotctl.owner`` label value of this operator's objects (default
        ``SLOTCTL_K8S_OWNER``, else ``slotctl``). ``start_timeout_s``:
        how long a pod may take to run (image pull included); ``unschedulable_s``: how
        long it may stay unschedulable; ``termination_grace_s``: the pods' grace period
        between SIGTERM and SIGKILL; ``node_refresh_s``: how often node budgets are read.
        """
        self._api = client
        self._owns_client = client is None
        self._namespace = namespace or os.environ.get("SLOTCTL_K8S_NAMESPACE") or None
        resource = gpu_resource or os.environ.get("SLOTCTL_K8S_GPU_RESOURCE") or GPU_RESOURCES[0]
        if resource not in GPU_RESOURCES:
            raise ValueError(f"gpu resource {resource!r}: choose one of {', '.join(GPU_RESOURCES)}")
        self.gpu_resource = resource
        self.owner = owner or os.environ.get("SLOTCTL_K8S_OWNER") or DEFAULT_OWNER
        if not _LABEL_VALUE_RE.fullmatch(self.owner):
            raise ValueError(
                f"owner {self.owner!r}: a label value (63 characters at most: letters, "
                "digits, '-', '_', '.'; alphanumeric at both ends)"
            )
        self.start_timeout_s = start_timeout_s
        self.unschedulable_s = unschedulable_s
        self.stop_grace_s = stop_grace_s
        self.termination_grace_s = termination_grace_s
        self.poll_s = poll_s
        self.node_refresh_s = node_refresh_s
        self.memory = NodeMemory()
        self._locks: dict[str, asyncio.Lock] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._first_read = asyncio.Event()

    # ------------------------------------------------------------------ API access

    @property
    def namespace(self) -> str:
        if self._namespace is None:
            self._namespace = str(self._client().namespace or "default")
        return self._namespace

    def _client(self) -> AsyncClient:
        if self._api is None:
            try:
                self._api = AsyncClient(field_manager=FIELD_MANAGER)
            except ConfigError as exc:
                raise DockerUnavailable(
                    f"no Kubernetes API configured (in-cluster service account, KUBECONFIG "
                    f"or ~/.kube/config): {exc}"
                ) from exc
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(
                self._refresh_loop(), name="slotctl-k8s-nodes"
            )
        return self._api

    async def _call(self, op: str, slot: str | None, fn: Callable[[], Awaitable[T]]) -> T:
        """One API call; failures become typed errors (SlotSpawnFailed when starting)."""
        where = f" slot {slot!r}" if slot else ""
        try:
            await self._nodes_read()
            return await fn()
        except SlotctlError:
            raise
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError among them
            cls: type[SlotctlError] = SlotSpawnFailed if op == "start" else DockerEngineError
            raise cls(f"cannot {op}{where}: Kubernetes API: {_reason(exc)}", slot=slot) from exc
        except (httpx2.HTTPError, OSError) as exc:
            cls = SlotSpawnFailed if op == "start" else DockerUnavailable
            raise cls(f"cannot {op}{where}: the Kubernetes API is unreachable ({exc})") from exc

    async def _get_deployment(self, slot: str) -> Deployment | None:
        try:
            return await self._client().get(Deployment, object_name(slot), namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError among them
            if exc.response.status_code == 404:
                return None
            raise

    async def _get_service(self, slot: str) -> Service | None:
        try:
            return await self._client().get(Service, object_name(slot), namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError among them
            if exc.response.status_code == 404:
                return None
            raise

    async def _pods(self, slot: str | None = None) -> list[Pod]:
        """Our pods (of ``slot``), terminating ones included (their server may still run:
        they count until they are gone); labels checked here as well (a server that
        filters by label selector, or one that does not)."""
        selector: dict[str, Any] = {MANAGED_LABEL: "true", **({SLOT_LABEL: slot} if slot else {})}
        pods = []
        async for pod in self._client().list(Pod, namespace=self.namespace, labels=selector):
            labels = (pod.metadata.labels if pod.metadata else None) or {}
            if labels.get(MANAGED_LABEL) != "true" or (slot and labels.get(SLOT_LABEL) != slot):
                continue
            pods.append(pod)
        return pods

    async def refresh_nodes(self) -> None:
        """Read every node's allocatable resources into :attr:`memory`."""
        nodes = [node async for node in self._client().list(Node)]
        self.memory.update(nodes)

    async def warm_up(self) -> None:
        """Read the nodes once before the first admission (the composition root's
        ``recover`` calls it); an unreachable API is logged and read again later."""
        try:
            await self._nodes_read()
        except SlotctlError as exc:
            log.warning("kubernetes runtime: %s", exc.message)

    async def _nodes_read(self) -> None:
        """The first reading of the nodes is done (admission needs their budgets)."""
        self._client()
        if not self._first_read.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._first_read.wait(), 10.0)

    async def _refresh_loop(self) -> None:
        """Supervised: a failed reading is logged and the next one comes; whatever
        happens, the first reading counts as done (API calls wait for it)."""
        while True:
            try:
                await self.refresh_nodes()
            except (httpx2.HTTPError, OSError) as exc:
                log.warning("reading the nodes' allocatable resources failed: %s", exc)
            except Exception:  # a bug or a malformed Node: logged, the loop lives on
                log.exception("reading the nodes' allocatable resources failed")
            finally:
                self._first_read.set()
            await asyncio.sleep(self.node_refresh_s)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        if self._owns_client and self._api is not None:
            api, self._api = self._api, None
            await api.close()

    def _lock(self, slot: str) -> asyncio.Lock:
        return self._locks.setdefault(slot, asyncio.Lock())

    # ------------------------------------------------------------------ observing

    def _observe(self, slot: str, deployment: Deployment, pods: Sequence[Pod]) -> Observed:
        meta = deployment.metadata
        labels = (meta.labels if meta else None) or {}
        annotations = (meta.annotations if meta else None) or {}
        replicas = (deployment.spec.replicas if deployment.spec else None) or 0
        ident = f"deployment/{object_name(slot)}"
        if not _owned(labels, slot, self.owner):
            return Observed(
                slot=slot,
                status=RunStatus.RUNNING if replicas else RunStatus.EXITED,
                ident=ident,
                managed=False,
                message=(
                    f"Deployment {object_name(slot)} in {self.namespace} is not managed by "
                    f"this controller (no {MANAGED_LABEL}=true / {SLOT_LABEL}={slot} / "
                    f"{OWNER_LABEL}={self.owner} labels): "
                    "it is left untouched; remove or rename it to free the slot's name"
                ),
            )
        wanted = annotations.get(HASH_LABEL)
        port = annotations.get(PORT_ANNOTATION, "")
        best: tuple[Pod, bool, int | None, str] | None = None
        for pod in (p for p in pods if not _terminating(p)):  # the server to talk to
            running, code, words = _pod_state(pod)
            pod_hash = ((pod.metadata.annotations if pod.metadata else None) or {}).get(HASH_LABEL)
            if best is None or (running and not best[1]) or (running and pod_hash == wanted):
                best = (pod, running, code, words)
        if best is None or not replicas:
            words = "scaled to 0" if not replicas else "no pod yet"
            if any(map(_terminating, pods)):
                words += "; a pod is terminating"
            return Observed(
                slot=slot,
                status=RunStatus.EXITED,
                ident=ident,
                config_hash=wanted,
                stack=labels.get(STACK_LABEL),
                message=words if best is None else f"{words}; {best[3]}",
            )
        pod, running, code, words = best
        pod_ip = pod.status.podIP if pod.status else None
        pod_meta = pod.metadata
        started = _timestamp(pod.status.startTime if pod.status else None)
        return Observed(
            slot=slot,
            status=RunStatus.RUNNING if running else RunStatus.EXITED,
            ident=f"pod/{pod_meta.name if pod_meta else '?'}",
            exit_code=code,
            started_at=started,
            config_hash=((pod_meta.annotations if pod_meta else None) or {}).get(HASH_LABEL),
            endpoint=f"http://{pod_ip}:{port}" if pod_ip and port.isdigit() else None,
            stack=labels.get(STACK_LABEL),
            message=words,
            node=pod.spec.nodeName if pod.spec else None,
        )

    async def inspect(self, slot: str) -> Observed:
        async def look() -> Observed:
            deployment = await self._get_deployment(slot)
            if deployment is None:
                return Observed(slot=slot, status=RunStatus.MISSING)
            return self._observe(slot, deployment, await self._pods(slot))

        return await self._call("inspect", slot, look)

    async def list_managed(self) -> list[Observed]:
        async def look() -> list[Observed]:
            pods: dict[str, list[Pod]] = {}
            for pod in await self._pods():
                slot = ((pod.metadata.labels if pod.metadata else None) or {}).get(SLOT_LABEL, "")
                pods.setdefault(slot, []).append(pod)
            found = []
            selector: dict[str, Any] = {MANAGED_LABEL: "true", OWNER_LABEL: self.owner}
            async for dep in self._client().list(
                Deployment, namespace=self.namespace, labels=selector
            ):
                labels = (dep.metadata.labels if dep.metadata else None) or {}
                slot = labels.get(SLOT_LABEL, "")
                name = dep.metadata.name if dep.metadata else None
                if slot and name == object_name(slot) and _owned(labels, slot, self.owner):
                    found.append(self._observe(slot, dep, pods.get(slot, [])))
            return sorted(found, key=lambda o: o.slot)

        return await self._call("list", None, look)

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        async def read() -> list[str]:
            pods = sorted(await self._pods(slot), key=_terminating)  # the live one first
            if not pods or pods[0].metadata is None or not pods[0].metadata.name:
                return []
            lines = []
            stream = self._client().log(
                pods[0].metadata.name,
                namespace=self.namespace,
                container=CONTAINER,
                tail_lines=tail if tail > 0 else None,
                newlines=False,
            )
            async for line in stream:
                lines.append(line)
            return lines

        try:
            return await self._call("read logs of", slot, read)
        except SlotctlError as exc:  # a pod not started yet has no log: nothing to show
            log.debug("logs of slot %s: %s", slot, exc.message)
            return []

    # ------------------------------------------------------------------ starting

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        return False  # the kubelet pulls the image while the pod starts

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        return None

    async def start(self, launch: LaunchSpec) -> Observed:
        if not launch.image:
            raise SlotSpawnFailed(
                f"slot {launch.slot!r} (provider {launch.provider}) has no container image: "
                "the kubernetes runtime needs server.image",
                slot=launch.slot,
            )
        check_slot_name(launch.slot)
        async with self._lock(launch.slot):
            return await self._call("start", launch.slot, lambda: self._start(launch))

    async def _start(self, launch: LaunchSpec) -> Observed:
        slot, name = launch.slot, object_name(launch.slot)
        deployment = await self._get_deployment(slot)
        service = await self._get_service(slot)
        for kind, obj in (("Deployment", deployment), ("Service", service)):
            labels = (obj.metadata.labels if obj is not None and obj.metadata else None) or {}
            if obj is not None and not _owned(labels, slot, self.owner):
                raise SlotSpawnFailed(
                    f"cannot start slot {slot!r}: an unmanaged {kind} holds the name {name} in "
                    f"{self.namespace}; slotctl never touches objects without its labels: "
                    "remove or rename it",
                    slot=slot,
                )
        exists = deployment is not None
        try:
            if deployment is not None:
                current = self._observe(slot, deployment, await self._pods(slot))
                if current.running and current.config_hash == launch.config_hash():
                    await self._ensure_service(launch, service)
                    return current  # adopted: the same config already runs
            body = deployment_body(
                launch,
                self.namespace,
                gpu_resource=self._gpu_resource(launch.node),
                termination_grace_s=math.ceil(self.termination_grace_s),
                owner=self.owner,
            )
            api = self._client()
            if deployment is None:
                await api.create(cast(Deployment, Deployment.from_dict(_without_nulls(body))))
                exists = True
            else:
                await api.patch(
                    Deployment, name, body, namespace=self.namespace, patch_type=PatchType.MERGE
                )
            await self._ensure_service(launch, service)
            return await self._wait_running(launch)
        except BaseException:  # an API error, a refused start, a cancellation: re-raised
            if exists:
                await self._scale_down_after_failure(slot)
            raise

    async def _scale_down_after_failure(self, slot: str) -> None:
        """A failed start leaves no pod running (best effort: the start's error is what
        the caller hears; a failure to scale down is logged)."""
        try:
            await self._scale(slot, 0)
        except (httpx2.HTTPError, OSError) as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status != 404:  # 404: the Deployment is gone, nothing runs
                log.warning("slot %s: scaling back to 0 after a failed start failed: %s", slot, exc)

    def _gpu_resource(self, node: str | None) -> str:
        if node is not None and node in self.memory.gpu_resources:
            return self.memory.gpu_resources[node]
        return self.gpu_resource

    async def _ensure_service(self, launch: LaunchSpec, service: Service | None) -> None:
        body = service_body(launch, self.namespace, self.owner)
        api = self._client()
        if service is None:
            await api.create(cast(Service, Service.from_dict(body)))
            return
        ports = [
            (p.port, p.targetPort) for p in (service.spec.ports if service.spec else None) or []
        ]
        if ports != [(launch.port, launch.port)]:
            await api.patch(
                Service,
                object_name(launch.slot),
                body,
                namespace=self.namespace,
                patch_type=PatchType.MERGE,
            )

    async def _wait_running(self, launch: LaunchSpec) -> Observed:
        """Until the pod of this config runs with an IP; the scheduler's or the kubelet's
        verdict when it cannot (unschedulable for too long, failed, a container in
        CrashLoopBackOff or unable to pull its image, timed out). The caller scales the
        Deployment back to 0 when this raises."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        unschedulable_since: float | None = None
        wanted = launch.config_hash()
        while True:
            deployment = await self._get_deployment(launch.slot)
            if deployment is None:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: its Deployment was deleted meanwhile",
                    slot=launch.slot,
                )
            pods = [
                p
                for p in await self._pods(launch.slot)
                if not _terminating(p)
                and ((p.metadata.annotations if p.metadata else None) or {}).get(HASH_LABEL)
                == wanted
            ]
            observed = self._observe(launch.slot, deployment, pods)
            if observed.running and observed.endpoint:
                return observed
            now = loop.time()
            reason = next((r for r in map(_unschedulable, pods) if r), None)
            if reason is None:
                unschedulable_since = None
            elif unschedulable_since is None:
                unschedulable_since = now
            elif now - unschedulable_since >= self.unschedulable_s:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: its pod stayed unschedulable for "
                    f"{self.unschedulable_s:g}s: {reason}",
                    slot=launch.slot,
                )
            failed = [p for p in pods if p.status and p.status.phase == "Failed"]
            if failed:
                _, code, words = _pod_state(failed[0])
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: {words}",
                    slot=launch.slot,
                    exit_code=code,
                )
            stuck = next((f for f in map(_start_failure, pods) if f), None)
            if stuck is not None:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: {stuck[0]}",
                    slot=launch.slot,
                    exit_code=stuck[1],
                )
            if now - began >= self.start_timeout_s:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: no running pod within "
                    f"{self.start_timeout_s:g}s ({observed.message})",
                    slot=launch.slot,
                )
            await asyncio.sleep(self.poll_s)

    async def _scale(self, slot: str, replicas: int) -> None:
        await self._client().patch(
            Deployment,
            object_name(slot),
            {"spec": {"replicas": replicas}},
            namespace=self.namespace,
            patch_type=PatchType.MERGE,
        )

    # ------------------------------------------------------------------ stopping

    async def stop(self, slot: str, timeout: float) -> Observed:
        async with self._lock(slot):
            return await self._call("stop", slot, lambda: self._stop(slot, timeout))

    async def _stop(self, slot: str, timeout: float) -> Observed:
        deployment = await self._get_deployment(slot)
        if deployment is None:
            await self._delete_service(slot)
            return Observed(slot=slot, status=RunStatus.MISSING)
        pods = await self._pods(slot)
        observed = self._observe(slot, deployment, pods)
        if not observed.managed:
            return observed  # reported, never touched
        replicas = (deployment.spec.replicas if deployment.spec else None) or 0
        if not replicas and not pods:
            # Already unloaded: a stop now is the cleanup of a slot nobody declares.
            api = self._client()
            with contextlib.suppress(httpx2.HTTPStatusError):
                await api.delete(Deployment, object_name(slot), namespace=self.namespace)
            await self._delete_service(slot)
            return Observed(slot=slot, status=RunStatus.EXITED, message="Deployment removed")
        if replicas:
            await self._scale(slot, 0)
        # The kubelet sends SIGTERM, then SIGKILL after the pod's grace period.
        wait = max(timeout, self.termination_grace_s) + self.stop_grace_s
        if not await self._pods_gone(slot, wait):
            raise SlotTerminateTimeout(
                f"slot {slot!r}: the pod of {object_name(slot)} is still there {wait:g}s "
                "after the Deployment was scaled to 0",
                slot=slot,
            )
        return Observed(
            slot=slot,
            status=RunStatus.EXITED,
            ident=observed.ident,
            config_hash=observed.config_hash,
            stack=observed.stack,
            node=observed.node,
            message="scaled to 0",
        )

    async def _pods_gone(self, slot: str, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while await self._pods(slot):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self.poll_s)
        return True

    async def _delete_service(self, slot: str) -> None:
        service = await self._get_service(slot)
        labels = service.metadata.labels if service is not None and service.metadata else None
        if service is not None and _owned(labels, slot, self.owner):
            with contextlib.suppress(httpx2.HTTPStatusError):
                await self._client().delete(Service, object_name(slot), namespace=self.namespace)


def _reason(exc: httpx2.HTTPStatusError) -> str:
    """The API server's message (its Status), else the HTTP status line."""
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.message:
        return str(exc.status.message)
    try:
        body = exc.response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return f"{exc.response.status_code}: {body['message']}"
    return f"{exc.response.status_code} {exc.response.reason_phrase}"


def _without_nulls(value: Any) -> Any:
    """A merge-patch body as a whole object (its None values mean "absent")."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
