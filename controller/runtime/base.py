"""The runtime seam: one protocol for starting, stopping and observing slot servers.

Sits below the slot manager (which is the only caller that starts or stops anything) and
above the OS / Docker engine / Kubernetes API. Implementations: ``process`` (default),
``docker``, ``kubernetes`` (operator), and :class:`controller.runtime.fake.FakeRuntime`
for unit tests of the layers above.

A provider (``controller.providers``) turns a slot and its model into a
:class:`LaunchSpec`: the *effective runtime config*. Its :meth:`LaunchSpec.config_hash`
is what the reconciler compares to tell "same" from "needs recreate"; scheduling knobs
(priority, pinned, timeouts) are not part of it, so changing them never restarts a server.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

from controller import __version__
from controller.model.devices import GpuRef
from controller.probes.memory import MemoryProbe
from controller.probes.readiness import ProbeSpec
from controller.probes.sleep import SleepMode
from controller.probes.usage import ContainerUsage

__all__ = [
    "HASH_LABEL",
    "MANAGED_LABEL",
    "OWN_IMAGE_ENV",
    "SLOT_LABEL",
    "STACK_LABEL",
    "ContainerUsage",
    "LaunchSpec",
    "MeasuresContainers",
    "ModelPull",
    "Mount",
    "Notifying",
    "Observed",
    "ProgressCallback",
    "RunStatus",
    "Runtime",
    "RuntimeKind",
    "own_image",
    "visibility_env",
]

MANAGED_LABEL: Final = "slotctl.managed"
SLOT_LABEL: Final = "slotctl.slot"
STACK_LABEL: Final = "slotctl.stack"
HASH_LABEL: Final = "slotctl.config-hash"

# The kubernetes runtime's own image: the operator's (the chart sets it from its `image`).
# Its pods' model pulls run it, and a demo slot without server.image runs its demo server.
OWN_IMAGE_ENV: Final = "SLOTCTL_K8S_IMAGE"


def own_image() -> str:
    """slotctl's own container image where the kubernetes runtime runs it (the operator's:
    ``$SLOTCTL_K8S_IMAGE``, else ``slotctl:VERSION``, the tag the README builds)."""
    return os.environ.get(OWN_IMAGE_ENV) or f"slotctl:{__version__}"


ProgressCallback = Callable[[dict[str, Any]], Awaitable[None] | None]


class RunStatus(StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class ModelPull:
    """What a runtime that pulls in the server's own place pulls before the server starts
    (the kubernetes runtime: an init container's ``slotctl model pull`` on the node): the
    model as its catalogue entry names it, and the models dir of the pod."""

    model: str
    source: str
    models_dir: str
    sha256: str | None = None
    revision: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """``slotctl model pull``'s arguments for it (no controller: ``--source``)."""
        out = ["model", "pull", self.model, "--source", self.source]
        out += ["--models-dir", self.models_dir]
        if self.sha256:
            out += ["--sha256", self.sha256]
        if self.revision:
            out += ["--revision", self.revision]
        for pattern in self.include:
            out += ["--include", pattern]
        for pattern in self.exclude:
            out += ["--exclude", pattern]
        return out


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything a runtime needs to start one slot's server. Immutable, hashable."""

    slot: str
    stack: str
    provider: str
    port: int
    device: str
    model_id: str
    argv: tuple[str, ...]  # full argv for the process runtime; container args for docker
    image: str | None = None
    # A container's command (its image's entrypoint replaced), the argv its args: for a
    # server run in an image whose entrypoint is something else (slotctl's own: `slotctl`).
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    model_source: str | None = None
    model_path: str | None = None  # local file the server reads (mounted read-only)
    mounts: tuple[Mount, ...] = ()
    probe: ProbeSpec = field(default_factory=ProbeSpec)
    node: str | None = None  # kubernetes runtime: the node the slot is pinned to
    # kubernetes runtime: the model files its pod pulls first (an init container), when
    # its source can be pulled (hf://, http(s)://); the process and docker runtimes leave
    # pulls to the controller's models dir.
    pull: ModelPull | None = None
    # The kubernetes runtime: the files of the adapters the server may load, pulled into
    # the same cache by init containers after the model's (docs/adapters.md).
    adapter_pulls: tuple[ModelPull, ...] = ()
    gpus: int = 0  # GPUs the server spans (the slot's `gpus`; 0 off GPU)
    # The GPUs admission placed it on: made visible by the runtime (not hashed: a placement
    # is where a server runs, not what it is, and it is recorded in state.json).
    visible: tuple[GpuRef, ...] = field(default=(), compare=False)
    # How the server sleeps and wakes (a provider capability; None: it cannot, or the slot
    # opted out). What it changes in the server's argv and environment is hashed there.
    sleep: SleepMode | None = field(default=None, compare=False)
    # Arguments that follow the placement (vLLM's share of the GPU), appended at start:
    # not hashed, for the same reason (``run_argv``).
    placed_args: tuple[str, ...] = field(default=(), compare=False)
    # Where the server answers when the runtime decides it after start (a pod's IP): not
    # part of the config (a new pod IP is the same server config), so not hashed.
    address: str | None = field(default=None, compare=False)
    # config_hash() is asked on hot paths (views for the router): computed once.
    _hash: str | None = field(default=None, init=False, compare=False, repr=False)
    # The endpoint, as the router asks it for every request: made once.
    _endpoint: str | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def endpoint(self) -> str:
        found = self._endpoint
        if found is None:
            if self.address is not None:
                found = self.address
            else:
                host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host  # noqa: S104
                found = f"http://{host}:{self.port}"
            object.__setattr__(self, "_endpoint", found)
        return found

    def model_missing(self) -> bool:
        """The model file the server reads is not there (yet): the load has to pull it."""
        return self.model_path is not None and not Path(self.model_path).exists()

    def hash_input(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "image": self.image,
            "argv": list(self.argv),
            # only when set: the hashes of launches without one stay as they were
            **({"command": list(self.command)} if self.command else {}),
            "env": dict(sorted(self.env.items())),
            "model_source": self.model_source,
            "model_path": self.model_path,
            "port": self.port,
            "host": self.host,
            "device": self.device,
            "mounts": [[m.source, m.target, m.read_only] for m in self.mounts],
            # only when set: the hashes of launches without a node stay as they were
            **({"node": self.node} if self.node is not None else {}),
            **({"pull": asdict(self.pull)} if self.pull is not None else {}),
            # only when set: the hashes of launches without adapters stay as they were
            **(
                {"adapter_pulls": [asdict(p) for p in self.adapter_pulls]}
                if self.adapter_pulls
                else {}
            ),
            **({"gpus": self.gpus} if self.gpus > 1 else {}),
        }

    def placed_on(self, gpus: tuple[GpuRef, ...], args: tuple[str, ...] = ()) -> LaunchSpec:
        """This launch on the GPUs admission chose (what the runtime makes visible), with
        the arguments that follow from them (the provider's ``placement_args``)."""
        if gpus == self.visible and args == self.placed_args:
            return self
        placed = replace(self, visible=gpus, placed_args=args)
        object.__setattr__(placed, "_hash", self._hash)
        return placed

    @property
    def run_argv(self) -> tuple[str, ...]:
        """The argv (or container args) a runtime starts: ``argv`` and the placement's."""
        return self.argv + self.placed_args if self.placed_args else self.argv

    @property
    def device_kind(self) -> str:
        return self.device.split(":", 1)[0]

    def reached_at(self, endpoint: str | None) -> LaunchSpec:
        """This launch answering at ``endpoint`` (what the runtime observed); same hash."""
        if not endpoint or endpoint == self.endpoint:
            return self
        reached = replace(self, address=endpoint)
        object.__setattr__(reached, "_hash", self._hash)
        return reached

    def config_hash(self) -> str:
        """Stable hash of the effective runtime config (12 hex chars, label-safe)."""
        if self._hash is None:
            canonical = json.dumps(self.hash_input(), sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_hash", hashlib.sha256(canonical.encode()).hexdigest()[:12])
        assert self._hash is not None
        return self._hash

    def labels(self) -> dict[str, str]:
        return {
            MANAGED_LABEL: "true",
            SLOT_LABEL: self.slot,
            STACK_LABEL: self.stack,
            HASH_LABEL: self.config_hash(),
        }


def visibility_env(gpus: tuple[GpuRef, ...], *, in_container: bool = False) -> dict[str, str]:
    """The environment that shows a server exactly ``gpus`` (pure).

    NVIDIA: ``CUDA_VISIBLE_DEVICES`` by UUID where NVML gave them (indices can be ordered
    differently by CUDA), else by index with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (NVML's
    order). AMD: ``ROCR_VISIBLE_DEVICES`` by index, and ``HIP_VISIBLE_DEVICES`` counting the
    GPUs ROCr leaves visible (0..K-1), so an inherited value cannot hide them. A GPU of
    unknown vendor (a budget-only host) gets both. In a container the engine's device
    request already chose the NVIDIA GPUs (renumbered from 0): indices are not set there.
    """
    if not gpus:
        return {}
    env: dict[str, str] = {}
    vendors = {g.vendor for g in gpus}
    if vendors & {"nvidia", None}:
        if all(g.uuid for g in gpus):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.uuid) for g in gpus)
        elif not in_container:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus)
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if vendors & {"amd", None}:
        env["ROCR_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus)
        env["HIP_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpus)))
    return env


@dataclass(frozen=True, slots=True)
class Observed:
    """What a runtime sees of one slot's server right now."""

    slot: str
    status: RunStatus
    ident: str | None = None  # pid or container id
    exit_code: int | None = None
    started_at: float | None = None  # wall-clock seconds
    config_hash: str | None = None
    endpoint: str | None = None
    stack: str | None = None
    message: str = ""
    managed: bool = True  # False: an object with the slot's name we do not own
    node: str | None = None  # kubernetes runtime: the node the server's pod runs on

    @property
    def running(self) -> bool:
        return self.status is RunStatus.RUNNING


class RuntimeKind(StrEnum):
    """The runtimes (SPEC §4), and the fake one of the tests. A launch is built for one
    (:func:`controller.providers.launch_context`: the fake one builds as ``process``)."""

    PROCESS = "process"
    DOCKER = "docker"
    KUBERNETES = "kubernetes"
    FAKE = "fake"


@runtime_checkable
class Runtime(Protocol):
    """One interface, several implementations. All methods are coroutines."""

    kind: RuntimeKind

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        """Fetch what start needs (e.g. pull the image); no-op when present."""
        ...

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        """True when :meth:`prepare` has work to do (the slot shows ``pulling``)."""
        ...

    async def start(self, launch: LaunchSpec) -> Observed:
        """Start the server; raises ``SlotSpawnFailed`` with the reason."""
        ...

    async def stop(self, slot: str, timeout: float) -> Observed:
        """Graceful stop, forced after ``timeout`` s; cleans up an exited object too.

        Raises ``SlotTerminateTimeout`` if even the forced stop did not end it.
        Never touches an object the controller does not own.
        """
        ...

    async def inspect(self, slot: str) -> Observed:
        """Running, exited (with exit code when known) or missing."""
        ...

    async def list_managed(self) -> list[Observed]:
        """Every object carrying the controller's labels (for adoption and orphans)."""
        ...

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        """The last ``tail`` lines the server wrote."""
        ...

    async def close(self) -> None:
        """Release the runtime's own resources (an engine client); servers keep running."""
        ...


@runtime_checkable
class Notifying(Protocol):
    """A runtime that tells the manager what it sees change (the kubernetes runtime's
    watches): ``changed(slot)`` when a slot's server may have changed, ``note(slot,
    words)`` for what a start waits for (a pod the scheduler leaves Pending)."""

    def subscribe(self, changed: Callable[[str], None], note: Callable[[str, str], None]) -> None:
        """Take the two hooks (the manager's)."""
        ...


@runtime_checkable
class WarmsUp(Protocol):
    """A runtime with caches to fill before its first look (the kubernetes runtime's nodes
    and pods): the composition root awaits :meth:`warm_up` before recovery."""

    async def warm_up(self) -> None: ...


@runtime_checkable
class OffersMemory(Protocol):
    """A runtime that places servers on other machines and says what memory they offer
    (the kubernetes runtime: the nodes'); admission probes it instead of this host."""

    memory: MemoryProbe


@runtime_checkable
class MeasuresContainers(Protocol):
    """A runtime whose servers run in containers it can measure (the docker runtime): the
    slot manager learns a server's footprint from :meth:`container_usage` instead of a
    process tree (issue 36; :meth:`controller.probes.usage.ProcessUsage.of_container`).
    The kubernetes runtime does not: its pods run on other nodes, whose cgroups and GPUs
    this controller cannot read (a metrics pipeline would; docs/design/0022)."""

    async def container_usage(self, slot: str) -> ContainerUsage | None:
        """The slot's running container's memory figure and host pids; None when it has
        no running container of ours, or the engine reports no memory figure."""
        ...
