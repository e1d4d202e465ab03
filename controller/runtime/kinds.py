"""Which runtime runs the servers: ``--runtime process|docker|kubernetes``.

:func:`make_runtime` builds the one asked for (docker and kubernetes imported only then);
:func:`base_mounts_from_env` reads ``SLOTCTL_DOCKER_MOUNTS``.
"""

from __future__ import annotations

import os
from pathlib import Path

from controller.runtime.base import Mount, Runtime

__all__ = ["RUNTIME_KINDS", "base_mounts_from_env", "make_runtime"]

RUNTIME_KINDS = ("process", "docker", "kubernetes")


def make_runtime(kind: str, state_dir: Path) -> Runtime:
    """The runtime for ``--runtime KIND`` (docker and kubernetes imported only when asked for)."""
    if kind == "process":
        from controller.runtime.process.runtime import ProcessRuntime

        return ProcessRuntime(state_dir)
    if kind == "docker":
        from controller.runtime.docker.runtime import DockerRuntime

        return DockerRuntime(base_mounts=base_mounts_from_env(), owner=str(state_dir.resolve()))
    if kind == "kubernetes":
        from controller.runtime.kubernetes.runtime import KubernetesRuntime

        return KubernetesRuntime()
    raise ValueError(f"unknown runtime {kind!r}; choose one of {', '.join(RUNTIME_KINDS)}")


def base_mounts_from_env(value: str | None = None) -> tuple[Mount, ...]:
    """``SLOTCTL_DOCKER_MOUNTS="/usr:/usr:ro,/data:/data"``: binds added to every container.

    For images that run host binaries (tests, air-gapped hosts); ``ro`` is the default.
    """
    raw = os.environ.get("SLOTCTL_DOCKER_MOUNTS", "") if value is None else value
    mounts = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            raise ValueError(f"SLOTCTL_DOCKER_MOUNTS: {item!r} is not SRC:DST[:ro|rw]")
        read_only = len(parts) == 2 or parts[2] != "rw"
        mounts.append(Mount(parts[0], parts[1], read_only=read_only))
    return tuple(mounts)
