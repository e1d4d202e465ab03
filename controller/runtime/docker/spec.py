"""What a slotctl container is, as pure functions over the docker SDK's data: its name,
labels and ownership, its create options (mounts, network, accelerators) and the
:class:`~controller.runtime.base.Observed` read back from its attributes.

Sits under :mod:`controller.runtime.docker.runtime` (the runtime, which does the engine calls in
worker threads); nothing here talks to an engine, so the rules are unit-testable alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import docker.types

from controller.model.devices import GpuRef
from controller.model.errors import SlotSpawnFailed
from controller.runtime.base import (
    HASH_LABEL,
    MANAGED_LABEL,
    SLOT_LABEL,
    STACK_LABEL,
    LaunchSpec,
    Mount,
    Observed,
    RunStatus,
    visibility_env,
)

CONTAINER_PREFIX: Final = "slotctl-"
PORT_LABEL: Final = "slotctl.port"
# The controller (its resolved state dir) that created a container: two controllers on
# one engine never adopt, stop or reap each other's containers.
OWNER_LABEL: Final = "slotctl.owner"
DEFAULT_SOCKET: Final = "unix:///var/run/docker.sock"
AMD_DEVICES: Final = ("/dev/kfd", "/dev/dri")
NPU_DEVICES: Final = ("/dev/accel",)
_NEVER_STARTED: Final = "0001-01-01T00:00:00Z"


def container_name(slot: str) -> str:
    return f"{CONTAINER_PREFIX}{slot}"


def device_options(
    device: str,
    runtimes: Sequence[str],
    exists: Callable[[str], bool] = os.path.exists,
    gpus: Sequence[GpuRef] = (),
) -> dict[str, Any]:
    """Container create options giving a ``device`` slot its accelerator (pure).

    ``gpu``: the GPUs it was placed on (``gpus``; every GPU when none is given) as a
    device request by UUID or index when the engine has the NVIDIA runtime, else the AMD
    device nodes when the host has them (the visibility variables choose the GPUs:
    :func:`~controller.runtime.base.visibility_env`); ``npu``: ``/dev/accel``; ``cpu``:
    none. Raises :class:`SlotSpawnFailed` when the host cannot provide what was asked for.
    """
    device = device.split(":", 1)[0]
    if device == "cpu":
        return {}
    if device == "gpu":
        if "nvidia" in runtimes:
            if gpus:
                ids = [g.uuid or str(g.index) for g in gpus]
                request = docker.types.DeviceRequest(device_ids=ids, capabilities=[["gpu"]])
            else:
                request = docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])
            return {"device_requests": [request]}
        if all(exists(path) for path in AMD_DEVICES):
            return {"devices": [f"{path}:{path}:rwm" for path in AMD_DEVICES]}
        raise SlotSpawnFailed(
            "device 'gpu' requested, but the Docker engine has no 'nvidia' runtime and the "
            f"host has no {' + '.join(AMD_DEVICES)} (AMD); refusing to run on the CPU",
            device=device,
        )
    if device == "npu":
        if all(exists(path) for path in NPU_DEVICES):
            return {"devices": [f"{path}:{path}:rwm" for path in NPU_DEVICES]}
        raise SlotSpawnFailed(
            f"device 'npu' requested, but the host has no {' + '.join(NPU_DEVICES)}",
            device=device,
        )
    raise SlotSpawnFailed(f"unknown device {device!r}", device=device)


def parse_started_at(value: str | None) -> float | None:
    """``State.StartedAt`` (RFC 3339, nanoseconds) as epoch seconds; None if never."""
    if not value or value == _NEVER_STARTED:
        return None
    text = value.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    main, sep, rest = text.partition(".")
    if sep:  # trim nanoseconds to the microseconds fromisoformat accepts
        digits = "".join(ch for ch in rest if ch.isdigit())
        zone = rest[len(digits) :]
        text = f"{main}.{digits[:6].ljust(6, '0')}{zone}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def owned(labels: Mapping[str, str], slot: str, owner: str | None) -> bool:
    """Ours: slotctl's labels for this slot and, when the runtime has an owner, that owner."""
    if labels.get(MANAGED_LABEL) != "true" or labels.get(SLOT_LABEL) != slot:
        return False
    return owner is None or labels.get(OWNER_LABEL) == owner


def covered(path: str, mounts: Sequence[Mount]) -> bool:
    """Is ``path`` already visible in the container (mounted at, or under, an identity bind)?"""
    wanted = Path(path)
    for mount in mounts:
        target = Path(mount.target)
        if wanted == target or (target in wanted.parents and Path(mount.source) == target):
            return True
    return False


def state_text(state: Mapping[str, Any], started_at: float | None, code: int | None) -> str:
    if state.get("Running"):
        return "paused" if state.get("Paused") else "running"
    if started_at is None:
        return "created, never started"
    text = f"exited with code {code}"
    if state.get("OOMKilled"):
        text += " (killed: out of memory)"
    elif code == 137:
        text += " (killed by SIGKILL)"
    if state.get("Error"):
        text += f": {state['Error']}"
    return text


def require_image(launch: LaunchSpec) -> str:
    """The slot's image; a typed error when it has none (the docker runtime needs one)."""
    if not launch.image:
        raise SlotSpawnFailed(
            f"slot {launch.slot!r} (provider {launch.provider}) has no container image: "
            "the docker runtime needs server.image",
            slot=launch.slot,
        )
    return launch.image


def labels_of(attrs: Mapping[str, Any]) -> Mapping[str, str]:
    """A container's labels, from its inspect attributes."""
    labels: Mapping[str, str] = (attrs.get("Config") or {}).get("Labels") or {}
    return labels


def observe(attrs: Mapping[str, Any], slot: str, owner: str | None) -> Observed:
    """A container's inspect attributes as an :class:`Observed`; one without our labels
    (or another controller's) is reported ``managed=False`` and never touched."""
    labels = labels_of(attrs)
    state: Mapping[str, Any] = attrs.get("State") or {}
    ident = str(attrs.get("Id") or "")
    running = bool(state.get("Running"))
    status = RunStatus.RUNNING if running else RunStatus.EXITED
    started_at = parse_started_at(state.get("StartedAt"))
    exit_code = None if running or started_at is None else int(state.get("ExitCode", 0))
    if not owned(labels, slot, owner):
        return Observed(
            slot=slot,
            status=status,
            ident=ident,
            exit_code=exit_code,
            started_at=started_at,
            managed=False,
            message=(
                f"container {container_name(slot)} ({ident[:12]}) is not managed by "
                f"this controller (no {MANAGED_LABEL}=true / {SLOT_LABEL}={slot}"
                + (f" / {OWNER_LABEL}={owner}" if owner else "")
                + " labels): it is left untouched; remove or rename it to free the "
                "slot's name"
            ),
        )
    port = labels.get(PORT_LABEL, "")
    return Observed(
        slot=slot,
        status=status,
        ident=ident,
        exit_code=exit_code,
        started_at=started_at,
        config_hash=labels.get(HASH_LABEL),
        endpoint=f"http://127.0.0.1:{port}" if port.isdigit() else None,
        stack=labels.get(STACK_LABEL),
        message=state_text(state, started_at, exit_code),
    )


def mounts_for(launch: LaunchSpec, base_mounts: Sequence[Mount]) -> list[Mount]:
    """The LaunchSpec's mounts, then base mounts and the model file (one per target)."""
    mounts: list[Mount] = []
    for mount in (*launch.mounts, *base_mounts):
        if all(m.target != mount.target for m in mounts):
            mounts.append(mount)
    if launch.model_path and not covered(launch.model_path, mounts):
        mounts.append(Mount(launch.model_path, launch.model_path, read_only=True))
    return mounts


def create_options(
    launch: LaunchSpec,
    *,
    owner: str | None,
    base_mounts: Sequence[Mount],
    network_mode: str,
    runtimes: Sequence[str],
) -> dict[str, Any]:
    """``containers.create`` keyword arguments for ``launch`` (``runtimes``: the engine's,
    consulted for a GPU slot)."""
    labels = {**launch.labels(), PORT_LABEL: str(launch.port)}
    if owner is not None:
        labels[OWNER_LABEL] = owner
    options: dict[str, Any] = {
        "image": launch.image,
        "command": list(launch.run_argv),
        **({"entrypoint": list(launch.command)} if launch.command else {}),
        "name": container_name(launch.slot),
        "labels": labels,
        "environment": {**launch.env, **visibility_env(launch.visible, in_container=True)},
        "mounts": [
            docker.types.Mount(m.target, m.source, type="bind", read_only=m.read_only)
            for m in mounts_for(launch, base_mounts)
        ],
        "init": True,
        "restart_policy": {"Name": "no"},
        "detach": True,
    }
    if network_mode == "host":
        options["network_mode"] = "host"
    else:
        options["network_mode"] = network_mode
        options["ports"] = {f"{launch.port}/tcp": ("127.0.0.1", launch.port)}
    options.update(device_options(launch.device, runtimes, gpus=launch.visible))
    return options
