"""What the kubernetes runtime's objects are, as pure functions over lightkube's models:
names and labels, the Deployment and Service bodies, and the
:class:`~controller.runtime.base.Observed` read back from a Deployment and its pods
(the nodes' memory budgets are :mod:`controller.runtime.kubernetes.nodes`).

* **objects**: one Deployment per slot (``replicas`` 1 while loaded, 0 once unloaded,
  strategy ``Recreate``: its own pod is replaced, never doubled) and one Service selecting
  its pod, in the runtime's namespace. A surge rollout runs a second *instance* of the
  slot beside the first (:mod:`controller.runtime.kubernetes.surge`): instance ``0`` is
  the Deployment ``slotctl-<slot>``, instance ``1`` the Deployment ``slotctl1-<slot>``
  (a name no slot's own objects can take); each pod carries its instance in the label
  ``slotctl.instance``, and the Service names the instance that serves (its selector and
  its ``slotctl.instance`` annotation: the switch is one write). Labels
  ``slotctl.managed=true``, ``slotctl.slot``, ``slotctl.stack``, ``slotctl.config-hash``;
  the config hash (again) and the port as annotations. An object with a slot's name but
  without those labels is reported (``Observed(managed=False)``) and never patched,
  scaled or deleted; a labelled Deployment that runs the same config is
  adopted (no second pod after an operator restart);
* **placement**: GPUs as extended resources (``nvidia.com/gpu`` or ``amd.com/gpu``, the
  slot's ``gpus`` of them), the slot's ``node`` as a ``nodeSelector``
  (``kubernetes.io/hostname``), and the node the controller's placement chose as a
  *required* node affinity on its name (:attr:`LaunchSpec.visible` carries it: not config,
  so not hashed); the pod tolerates the GPU resource's ``NoSchedule`` taint, and a node
  that is not ready or unreachable for :data:`LOST_TOLERATION_S`;
* **model files**: a LaunchSpec mount whose source is a name is a PersistentVolumeClaim
  (the slot's ``server.volume``, read-only at the models dir); one whose source is a path
  is a hostPath. A launch whose model can be pulled (:attr:`LaunchSpec.pull`) gets an
  *init container*, ``model-pull``: the operator's own image running ``slotctl model pull
  ID --source …`` into the node's model cache (:class:`ModelCache`: a hostPath by default,
  or a PersistentVolumeClaim; the slot's own volume when it names one), which the server
  then mounts read-only at the models dir — as KServe's storage initializer does (a slot
  that names its own volume brings its files: nothing is pulled). A file
  already there costs no download (the pull finds it); a failed pull's typed error is the
  tail of its log (``FallbackToLogsOnError``), read back by :func:`pull_seen`.

Sits under :mod:`controller.runtime.kubernetes.runtime` (the runtime, which makes the API calls);
nothing here talks to an API server, so the rules are unit-testable alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import httpx2
from lightkube import ApiError
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Pod, Service

from controller.model.errors import SlotSpawnFailed
from controller.runtime.base import (
    HASH_LABEL,
    MANAGED_LABEL,
    SLOT_LABEL,
    STACK_LABEL,
    LaunchSpec,
    ModelPull,
    Mount,
    Observed,
    RunStatus,
)
from controller.runtime.kubernetes.nodes import GPU_RESOURCES

OBJECT_PREFIX: Final = "slotctl-"
# The second instance of a slot (a surge's new server, or the old one a surge replaced):
# "slotctl1-" + the slot, never "slotctl-" + another slot's name.
SECOND_PREFIX: Final = "slotctl1-"
INSTANCE_LABEL: Final = "slotctl.instance"  # a pod's instance: "0" or "1"
INSTANCES: Final = ("0", "1")
# On a Deployment: the instance a surge started and the Service does not serve yet.
SURGE_ANNOTATION: Final = "slotctl.surge"
PORT_ANNOTATION: Final = "slotctl.port"
HOSTNAME_LABEL: Final = "kubernetes.io/hostname"
CONTAINER: Final = "server"
PULL_CONTAINER: Final = "model-pull"  # the init container that pulls the model first
ADAPTER_PULL: Final = "adapter-pull"  # adapter-pull-N: the adapters' files, after it
CACHE_VOLUME: Final = "model-cache"
DEFAULT_MODEL_CACHE: Final = "/var/lib/slotctl/models"  # a node's cache (hostPath)
# The hub's settings of the operator that its pods' pulls take too (a mirror, offline);
# a token comes from a Secret (ModelCache.token_secret), never through here.
PULL_ENV: Final = (
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_DOWNLOAD_TIMEOUT",
    "HF_HUB_DISABLE_TELEMETRY",
)
FIELD_MANAGER: Final = "slotctl"
OWNER_LABEL: Final = "slotctl.owner"
DEFAULT_OWNER: Final = "slotctl"
# A Service name is a DNS-1035 label (63 characters at most): "slotctl-" + the slot's name.
MAX_SLOT_NAME: Final = 63 - len(OBJECT_PREFIX)
LABEL_VALUE_RE: Final = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# Container waiting reasons after which a start fails at once: the kubelet would only
# retry with a growing back-off (the pod phase stays Running or Pending, never Failed).
FATAL_WAITING: Final = frozenset(
    {"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName"}
)
# How long a pod stays on a node that is not ready or unreachable before the node
# controller evicts it (the default toleration is 300 s); the controller moves the slot
# itself (the runtime's node_lost_s), this bounds how long its pod lingers there.
LOST_TOLERATION_S: Final = 30


def object_name(slot: str) -> str:
    return f"{OBJECT_PREFIX}{slot}"


def instance_name(slot: str, instance: str = "0") -> str:
    """The Deployment of ``slot``'s instance ``0`` (``slotctl-<slot>``) or ``1``."""
    return object_name(slot) if instance == "0" else f"{SECOND_PREFIX}{slot}"


def other(instance: str) -> str:
    return "1" if instance == "0" else "0"


def instance_of(obj: Deployment | Pod) -> str:
    """A Deployment's instance (by its name), a pod's (its label; none: ``0``, a pod of
    a Deployment made before instances were labelled)."""
    meta = obj.metadata
    if isinstance(obj, Deployment):
        name = (meta.name if meta else None) or ""
        return "1" if name.startswith(SECOND_PREFIX) else "0"
    labels = (meta.labels if meta else None) or {}
    return "1" if labels.get(INSTANCE_LABEL) == "1" else "0"


def surging(deployment: Deployment | None) -> bool:
    """A Deployment a surge started and no promotion took up yet."""
    meta = deployment.metadata if deployment is not None else None
    return bool(meta and (meta.annotations or {}).get(SURGE_ANNOTATION) == "true")


def labelled(deployment: Deployment | None) -> bool:
    """Its pods carry their instance label (a Deployment made before instances, adopted
    and never re-applied since, has pods without it: its Service selects by slot)."""
    spec = deployment.spec if deployment is not None else None
    template = spec.template.metadata if spec and spec.template else None
    return bool(template and INSTANCE_LABEL in (template.labels or {}))


def check_launch(launch: LaunchSpec) -> None:
    """Refuse, before any API call, a launch this runtime cannot run (SlotSpawnFailed):
    no container image, or a slot name too long for its objects."""
    if not launch.image:
        raise SlotSpawnFailed(
            f"slot {launch.slot!r} (provider {launch.provider}) has no container image: "
            "the kubernetes runtime needs server.image",
            slot=launch.slot,
        )
    check_slot_name(launch.slot)


def check_gpu_resource(resource: str) -> str:
    """The extended resource a gpu slot asks for (ValueError for one this runtime does
    not know)."""
    if resource not in GPU_RESOURCES:
        raise ValueError(f"gpu resource {resource!r}: choose one of {', '.join(GPU_RESOURCES)}")
    return resource


def check_owner(owner: str) -> str:
    """The ``slotctl.owner`` label value (ValueError when it is not a valid one)."""
    if not LABEL_VALUE_RE.fullmatch(owner):
        raise ValueError(
            f"owner {owner!r}: a label value (63 characters at most: letters, "
            "digits, '-', '_', '.'; alphanumeric at both ends)"
        )
    return owner


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


def _labels(launch: LaunchSpec) -> dict[str, str]:
    """SPEC §3's labels (the selector uses only the first two: it is immutable)."""
    return launch.labels()


def _selector(slot: str, instance: str | None = None) -> dict[str, str]:
    """A Deployment's selector (immutable: instance ``0``'s is the slot's alone, as it
    was before instances) or a Service's (the serving instance's pods only)."""
    base = {MANAGED_LABEL: "true", SLOT_LABEL: slot}
    return base if instance is None else {**base, INSTANCE_LABEL: instance}


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


@dataclass(frozen=True, slots=True)
class ModelCache:
    """Where pods pull model files to and servers read them from: a node's directory
    (``hostPath``, the default: ``/var/lib/slotctl/models``, kept across pods on that node)
    or a PersistentVolumeClaim (``pvc:NAME``: shared by the pods that mount it). The image
    that pulls is the operator's own (its ``slotctl``); a gated or private repository's
    token comes from ``token_secret`` (a Secret's ``token`` key), never a stack file."""

    host_path: str | None = DEFAULT_MODEL_CACHE
    claim: str | None = None
    image: str = "slotctl:latest"
    token_secret: str | None = None

    @classmethod
    def parse(cls, text: str | None, image: str, token_secret: str | None = None) -> ModelCache:
        """``SLOTCTL_K8S_MODEL_CACHE``: ``pvc:NAME``, ``hostPath:/dir`` or ``/dir``
        (empty: the default hostPath). ValueError for anything else."""
        value = (text or "").strip()
        if value.startswith("pvc:") and value[4:]:
            return cls(host_path=None, claim=value[4:], image=image, token_secret=token_secret)
        path = value.removeprefix("hostPath:") or DEFAULT_MODEL_CACHE
        if not path.startswith("/"):
            raise ValueError(f"model cache {text!r}: pvc:NAME, hostPath:/dir or /dir")
        return cls(host_path=path, image=image, token_secret=token_secret)

    def volume(self) -> dict[str, Any]:
        if self.claim is not None:
            return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": self.claim}}
        return {
            "name": CACHE_VOLUME,
            "hostPath": {"path": self.host_path, "type": "DirectoryOrCreate"},
        }


def _pull_containers(
    pulls: Sequence[tuple[str, ModelPull]],
    cache: ModelCache,
    volumes: list[dict[str, Any]],
    volume_mounts: list[dict[str, Any]],
    env: Mapping[str, str],
) -> list[dict[str, Any]]:
    """The init containers (``model-pull``, then ``adapter-pull-N``), and the cache volume
    they share with the server (read-write for a pull, read-only for the server, at the
    models dir)."""
    if not pulls:
        return []
    volumes.append(cache.volume())
    models_dir = pulls[0][1].models_dir
    volume_mounts.append({"name": CACHE_VOLUME, "mountPath": models_dir, "readOnly": True})
    return [_pull_container(name, pull, cache, env) for name, pull in pulls]


def _pull_container(
    name: str, pull: ModelPull, cache: ModelCache, env: Mapping[str, str]
) -> dict[str, Any]:
    mount = {"name": CACHE_VOLUME, "mountPath": pull.models_dir, "readOnly": False}
    variables: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(env.items())]
    if cache.token_secret:
        secret = {"name": cache.token_secret, "key": "token", "optional": True}
        variables.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret}})
    return {
        "name": name,
        "image": cache.image,
        "command": ["slotctl"],
        "args": pull.argv(),
        "env": variables,
        "volumeMounts": [mount],
        # a failure's last log line (``slotctl: error [code]: message``) is its message
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def deployment_body(
    launch: LaunchSpec,
    namespace: str,
    *,
    replicas: int = 1,
    gpu_resource: str = GPU_RESOURCES[0],
    termination_grace_s: int = 30,
    owner: str = DEFAULT_OWNER,
    cache: ModelCache | None = None,
    pull_env: Mapping[str, str] | None = None,
    instance: str = "0",
    surge: bool = False,
) -> dict[str, Any]:
    """The Deployment that runs ``launch`` as the slot's ``instance`` (pure; a merge patch
    of it updates one); ``surge``: a surge's new instance, not serving yet."""
    if launch.device == "npu":
        raise SlotSpawnFailed(
            f"slot {launch.slot!r}: the kubernetes runtime has no extended resource for an "
            "npu; run npu slots with the process or docker runtime",
            slot=launch.slot,
            device=launch.device,
        )
    annotations = {HASH_LABEL: launch.config_hash(), PORT_ANNOTATION: str(launch.port)}
    volumes, volume_mounts = _volumes(launch.mounts)
    gpu = launch.device_kind == "gpu"
    count = str(max(1, launch.gpus))  # the device plugin picks which of the node's GPUs
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": launch.image,
        "command": list(launch.command) or None,  # None: the image's entrypoint
        "args": list(launch.argv),
        "env": [{"name": k, "value": v} for k, v in sorted(launch.env.items())],
        "ports": [{"name": "http", "containerPort": launch.port}],
        "volumeMounts": volume_mounts,
        "resources": (
            {"limits": {gpu_resource: count}, "requests": {gpu_resource: count}} if gpu else {}
        ),
    }
    pulls = [(PULL_CONTAINER, launch.pull)] if launch.pull is not None else []
    pulls += [(f"{ADAPTER_PULL}-{i}", p) for i, p in enumerate(launch.adapter_pulls)]
    init = _pull_containers(pulls, cache or ModelCache(), volumes, volume_mounts, pull_env or {})
    pod_spec: dict[str, Any] = {
        "initContainers": init or None,
        "containers": [container],
        "volumes": volumes,
        "enableServiceLinks": False,
        # the server needs no API access: no service-account token in the pod
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_s,
        "nodeSelector": {HOSTNAME_LABEL: launch.node} if launch.node else None,
        "affinity": _affinity(placed_node(launch)),
        "tolerations": _tolerations(gpu_resource if gpu else None),
    }
    meta_annotations = {**annotations, **({SURGE_ANNOTATION: "true"} if surge else {})}
    selector = _selector(launch.slot, None if instance == "0" else instance)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": instance_name(launch.slot, instance),
            "namespace": namespace,
            "labels": {**_labels(launch), OWNER_LABEL: owner},
            "annotations": meta_annotations,
        },
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "Recreate", "rollingUpdate": None},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": {**_labels(launch), INSTANCE_LABEL: instance},
                    "annotations": annotations,
                },
                "spec": pod_spec,
            },
        },
    }


def placed_node(launch: LaunchSpec) -> str | None:
    """The node the controller placed the launch on (its GPUs'), if any."""
    return next((g.node for g in launch.visible if g.node), None)


def _affinity(node: str | None) -> dict[str, Any] | None:
    """A required node affinity on the node's name (not its hostname label, which a
    cluster may set otherwise): the scheduler binds the pod there or leaves it Pending."""
    if node is None:
        return None
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    required = {"nodeSelectorTerms": [term]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}


def _tolerations(gpu_resource: str | None) -> list[dict[str, Any]]:
    """GPU nodes are often tainted with their resource (``nvidia.com/gpu:NoSchedule``):
    a GPU slot's pod tolerates that; and it leaves a lost node after
    :data:`LOST_TOLERATION_S` instead of the default 300 s."""
    lost = [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": LOST_TOLERATION_S,
        }
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]
    gpu = (
        [{"key": gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]
        if gpu_resource
        else []
    )
    return gpu + lost


def service_body(
    launch: LaunchSpec,
    namespace: str,
    owner: str = DEFAULT_OWNER,
    *,
    instance: str = "0",
    by_instance: bool = True,
) -> dict[str, Any]:
    """The Service in front of the slot's serving pod: a stable in-cluster name for its
    port. It names the serving ``instance`` (an annotation, and its selector unless
    ``by_instance`` is False: pods made before instances were labelled)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": object_name(launch.slot),
            "namespace": namespace,
            "labels": {**_labels(launch), OWNER_LABEL: owner},
            "annotations": {PORT_ANNOTATION: str(launch.port), INSTANCE_LABEL: instance},
        },
        "spec": {
            "selector": _selector(launch.slot, instance if by_instance else None),
            "ports": [{"name": "http", "port": launch.port, "targetPort": launch.port}],
        },
    }


def switched_service(deployment: Deployment, namespace: str) -> dict[str, Any]:
    """The Service of ``deployment``'s slot serving that Deployment's instance (pure): its
    labels and port read from the Deployment (as :func:`service_body` wrote them from the
    launch)."""
    meta = deployment.metadata
    labels = dict((meta.labels if meta else None) or {})
    annotations = (meta.annotations if meta else None) or {}
    port = int(annotations.get(PORT_ANNOTATION, "0") or 0)
    slot = labels.get(SLOT_LABEL, "")
    instance = instance_of(deployment)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": object_name(slot),
            "namespace": namespace,
            "labels": labels,
            "annotations": {PORT_ANNOTATION: str(port), INSTANCE_LABEL: instance},
        },
        "spec": {
            "selector": _selector(slot, instance),
            "ports": [{"name": "http", "port": port, "targetPort": port}],
        },
    }


def owned(labels: Mapping[str, str] | None, slot: str, owner: str) -> bool:
    """Ours: slotctl's labels for this slot, and this runtime's owner."""
    labels = labels or {}
    return (
        labels.get(MANAGED_LABEL) == "true"
        and labels.get(SLOT_LABEL) == slot
        and labels.get(OWNER_LABEL) == owner
    )


def ours(obj: Deployment | Service | None, slot: str, owner: str) -> bool:
    """Absent, or an object with this owner's labels for ``slot`` (one to start over)."""
    if obj is None:
        return True
    return owned((obj.metadata.labels if obj.metadata else None) or {}, slot, owner)


def terminating(pod: Pod) -> bool:
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


@dataclass(frozen=True, slots=True)
class PullSeen:
    """A pod's ``model-pull`` init container as its status says: ``waiting`` (not
    started: scheduling, the image), ``pulling``, ``done`` or ``failed`` (its words: the
    pull's last log line, ``slotctl: error [code]: message``)."""

    phase: str
    words: str
    code: str | None = None  # failed: the typed error's code, read from its words


_ERROR_LINE: Final = re.compile(r"slotctl: error \[([a-z_.]+)\]: (.*)")


def pull_seen(pod: Pod) -> PullSeen:
    """What the pod's model pull is doing (see :class:`PullSeen`)."""
    status = pod.status
    pulled = False
    for cs in (status.initContainerStatuses if status else None) or []:
        if cs.name != PULL_CONTAINER and not cs.name.startswith(f"{ADAPTER_PULL}-"):
            continue
        state = cs.state
        last = cs.lastState.terminated if cs.lastState else None
        if state and state.terminated:
            if state.terminated.exitCode == 0:
                pulled = True  # the next pull (an adapter's) may still run
                continue
            return _pull_failed(state.terminated.message, state.terminated.exitCode)
        if state and state.running:
            what = "the model" if cs.name == PULL_CONTAINER else "an adapter's files"
            return PullSeen("pulling", f"pulling {what} in the pod's init container")
        if state and state.waiting:
            reason = state.waiting.reason or ""
            if last is not None and last.exitCode:  # restarted after a failed pull
                return _pull_failed(last.message, last.exitCode)
            if reason in FATAL_WAITING:
                return PullSeen(
                    "failed", f"the pull's container: {reason}: {state.waiting.message or ''}"
                )
            return PullSeen("waiting", f"waiting: {reason}".rstrip(": "))
    if pulled:
        return PullSeen("done", "pulled")
    for cs in (status.containerStatuses if status else None) or []:
        if cs.name == CONTAINER and cs.state and (cs.state.running or cs.state.terminated):
            return PullSeen("done", "pulled")  # the server started: its init is over
    phase = (status.phase if status else None) or "Pending"
    return PullSeen("waiting", f"pod {phase.lower()}")


def _pull_failed(message: str | None, code: int | None) -> PullSeen:
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    for line in reversed(lines):
        found = _ERROR_LINE.search(line)
        if found:
            return PullSeen("failed", f"[{found[1]}] {found[2]}", found[1])
    tail = lines[-1] if lines else "no output"
    return PullSeen("failed", f"the pull exited with code {code}: {tail}")


def unschedulable(pod: Pod) -> str | None:
    for cond in (pod.status.conditions if pod.status else None) or []:
        if cond.type == "PodScheduled" and cond.status == "False":
            return cond.message or cond.reason or "unschedulable"
    return None


def observe(
    slot: str,
    deployment: Deployment,
    pods: Sequence[Pod],
    *,
    owner: str,
    namespace: str,
    lost: Mapping[str, str] | None = None,
) -> Observed:
    """A slot's Deployment and pods as an :class:`Observed` (pure): one without this
    owner's labels is reported ``managed=False``; else the pod to talk to (of the
    Deployment's own instance; running, of
    the wanted config first; terminating ones only counted). A pod on a node in ``lost``
    (node -> why: not ready for too long) does not run, whatever its status says."""
    meta = deployment.metadata
    labels = (meta.labels if meta else None) or {}
    annotations = (meta.annotations if meta else None) or {}
    replicas = (deployment.spec.replicas if deployment.spec else None) or 0
    name = (meta.name if meta else None) or object_name(slot)
    ident = f"deployment/{name}"
    mine = instance_of(deployment)
    pods = [p for p in pods if instance_of(p) == mine]  # the other instance's are not its
    if not owned(labels, slot, owner):
        return Observed(
            slot=slot,
            status=RunStatus.RUNNING if replicas else RunStatus.EXITED,
            ident=ident,
            managed=False,
            message=(
                f"Deployment {name} in {namespace} is not managed by "
                f"this controller (no {MANAGED_LABEL}=true / {SLOT_LABEL}={slot} / "
                f"{OWNER_LABEL}={owner} labels): "
                "it is left untouched; remove or rename it to free the slot's name"
            ),
        )
    wanted = annotations.get(HASH_LABEL)
    port = annotations.get(PORT_ANNOTATION, "")
    best: tuple[Pod, bool, int | None, str] | None = None
    for pod in (p for p in pods if not terminating(p)):  # the server to talk to
        running, code, words = _pod_state(pod)
        pod_hash = ((pod.metadata.annotations if pod.metadata else None) or {}).get(HASH_LABEL)
        if best is None or (running and not best[1]) or (running and pod_hash == wanted):
            best = (pod, running, code, words)
    if best is None or not replicas:
        words = "scaled to 0" if not replicas else "no pod yet"
        if any(map(terminating, pods)):
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
    node = pod.spec.nodeName if pod.spec else None
    if node is not None and lost and node in lost:
        running, words = False, f"its node {node} is lost: {lost[node]}"
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
        node=node,
    )


def start_verdict(pods: Sequence[Pod]) -> tuple[str, int | None] | None:
    """Why a start has failed for good (the words, the exit code), or None while it may
    still come up: a pod in phase Failed, or a container the kubelet would only retry
    with a growing back-off (:data:`FATAL_WAITING`, a restart after an exit)."""
    failed = [p for p in pods if p.status and p.status.phase == "Failed"]
    if failed:
        _, code, words = _pod_state(failed[0])
        return words, code
    return next((f for f in map(_start_failure, pods) if f), None)


def api_reason(exc: httpx2.HTTPStatusError) -> str:
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


def without_nulls(value: Any) -> Any:
    """A merge-patch body as a whole object (its None values mean "absent")."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value
