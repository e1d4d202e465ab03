"""What a container runs, as a kubelet works it out: the image's entrypoint and cmd
replaced by the container's ``command`` and ``args`` (Kubernetes' rule: ``command``
replaces the entrypoint, ``args`` the cmd; ``args`` alone keep the entrypoint).

The test kubelets know one image's entrypoint: slotctl's own (the repo's ``Dockerfile``:
``ENTRYPOINT ["slotctl"]``), any image whose repository is ``slotctl``. Every other image
the tests name has none (a Python base image's), so its args are the whole argv. So a pod
of slotctl's image that gives only args runs ``slotctl ARGS`` — as it would on a cluster.
"""

from __future__ import annotations

from typing import Any

SLOTCTL_ENTRYPOINT = ["slotctl"]


def entrypoint(image: str) -> list[str]:
    """The image's entrypoint (``[]``: none)."""
    name = image.rsplit("@", 1)[0]
    repository = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    return list(SLOTCTL_ENTRYPOINT) if repository.rsplit("/", 1)[-1] == "slotctl" else []


def container_argv(container: dict[str, Any]) -> list[str]:
    """The argv the container's process runs."""
    command = container.get("command")
    args = list(container.get("args") or [])
    if command:
        return [*command, *args]
    return [*entrypoint(str(container.get("image", ""))), *args]
