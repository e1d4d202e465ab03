"""Runtimes: the one seam between the slot manager and processes / containers / pods.

``base`` defines the protocol; ``process`` (default), ``docker`` and ``fake`` implement it.
"""

from __future__ import annotations

from pathlib import Path

from controller.runtime.base import Runtime

__all__ = ["RUNTIME_KINDS", "make_runtime"]

RUNTIME_KINDS = ("process", "docker")


def make_runtime(kind: str, state_dir: Path) -> Runtime:
    """The runtime for ``--runtime KIND`` (docker is imported only when asked for)."""
    if kind == "process":
        from controller.runtime.process import ProcessRuntime

        return ProcessRuntime(state_dir)
    if kind == "docker":
        from controller.runtime.docker import DockerRuntime

        return DockerRuntime()
    raise ValueError(f"unknown runtime {kind!r}; choose one of {', '.join(RUNTIME_KINDS)}")
