"""Devices as data: what a slot's ``device`` field names, the admission keys, shares.

Pure, at the bottom of the package (the schema, the memory probes, the placement and the
runtimes all read it). A slot declares a device *kind* and, for GPUs, optionally which
ones::

    device = "gpu"              any GPU (the controller places it: controller.scheduling.placement)
    device = "gpu:1"            pinned to GPU index 1
    device = "gpu:GPU-3f2a…"    pinned to the GPU with that NVML UUID
    device = "gpu:2,3"          pinned to GPUs 2 and 3 (a slot that spans two)
    device = "cpu" | "npu"      system memory

Admission, reservations and eviction are keyed per device: ``gpu:0``, ``gpu:1``…, ``cpu``,
``npu``; on a cluster ``NODE/gpu:N`` (the node's GPUs as the controller counts them: the
device plugin picks which physical GPU a pod gets) and ``NODE/cpu``. A slot that spans
``K`` GPUs holds :func:`share` of its bytes on each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "DEVICE_KINDS",
    "DEVICE_MAX_LENGTH",
    "DEVICE_PATTERN",
    "GPU_REF_PATTERN",
    "VISIBILITY_ENV_VARS",
    "DeviceRef",
    "GpuRef",
    "gpu_key",
    "key_index",
    "key_kind",
    "key_node",
    "parse_device",
    "share",
]

DEVICE_KINDS: Final = ("gpu", "npu", "cpu")
# The environment variables that choose which GPUs a process sees: the controller's to set
# (from a slot's placement), a slot's env may not, and a server never inherits them.
VISIBILITY_ENV_VARS: Final = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
    }
)
# One GPU: an index, or an NVML UUID (``GPU-…``) as ``nvidia-smi -L`` prints it. MIG
# instances are not placed (the probe lists physical GPUs): a ``MIG-…`` pin is refused.
GPU_REF_PATTERN: Final = r"(?:[0-9]{1,3}|GPU-[0-9A-Za-z-]{1,80})"
_GPU_REF_RE: Final = re.compile(GPU_REF_PATTERN)
# The schema's (and the CRD's) pattern: loose enough for RE2, which the API server runs
# and which refuses nested repeat counts; parse_device checks each GPU strictly.
DEVICE_PATTERN: Final = r"^(?:gpu|npu|cpu|gpu:[0-9A-Za-z-]+(?:,[0-9A-Za-z-]+)*)$"
DEVICE_MAX_LENGTH: Final = 512
MAX_PINS: Final = 16
_DEVICE_RE: Final = re.compile(DEVICE_PATTERN)


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """A parsed ``device`` field: its kind and, for pinned GPUs, which ones."""

    kind: str  # gpu | npu | cpu
    pins: tuple[str, ...] = ()  # GPU indices ("1") or UUIDs ("GPU-…"), as written

    @property
    def pinned(self) -> bool:
        return bool(self.pins)


@dataclass(frozen=True, slots=True)
class GpuRef:
    """One GPU a server is given: what the runtime needs to make it visible."""

    index: int
    uuid: str | None = None
    vendor: str | None = None  # nvidia | amd | None (a budget-only GPU: not known)
    node: str | None = None  # on a cluster: the node it is on (the index counts its GPUs)
    # Its memory (the probe's total, or its budget) when placed: what a server that sizes
    # itself as a fraction of the GPU is told (vLLM's --gpu-memory-utilization). Not
    # recorded: a restarted controller does not restart a running server.
    total_bytes: int | None = field(default=None, compare=False)
    # Its free memory as the probe read it just before the server starts: what a server
    # that fits itself to free memory is told to leave (llama-server's --fit-target).
    free_bytes: int | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        key = gpu_key(self.index)
        return f"{self.node}/{key}" if self.node else key


def parse_device(value: str) -> DeviceRef:
    """``gpu:1,2`` -> ``DeviceRef("gpu", ("1", "2"))``; raises ValueError when malformed."""
    if not _DEVICE_RE.fullmatch(value):
        raise ValueError(
            f"invalid device {value!r}: use gpu, gpu:INDEX, gpu:GPU-UUID, gpu:I,J…, npu or cpu"
        )
    kind, _, pins = value.partition(":")
    refs = tuple(pins.split(",")) if pins else ()
    bad = [r for r in refs if not _GPU_REF_RE.fullmatch(r)]
    if bad:
        raise ValueError(
            f"invalid device {value!r}: {bad[0]!r} is neither a GPU index nor a GPU UUID "
            "(GPU-…, as nvidia-smi -L prints it; MIG instances are not placed)"
        )
    if len(refs) > MAX_PINS:
        raise ValueError(f"invalid device {value!r}: at most {MAX_PINS} GPUs")
    if len(set(refs)) != len(refs):
        raise ValueError(f"invalid device {value!r}: a GPU is named twice")
    return DeviceRef(kind, refs)


def gpu_key(index: int) -> str:
    return f"gpu:{index}"


def key_kind(key: str) -> str:
    """The kind of an admission key: ``gpu:1`` -> ``gpu``, ``node-a/gpu`` -> ``gpu``."""
    return key.rsplit("/", 1)[-1].split(":", 1)[0]


def key_node(key: str) -> str | None:
    """The node of a cluster key: ``node-a/gpu:1`` -> ``node-a``; None on a host."""
    node, sep, _ = key.rpartition("/")
    return node if sep else None


def key_index(key: str) -> int | None:
    """The GPU index of a ``gpu:N`` key, else None."""
    kind, _, index = key.partition(":")
    return int(index) if kind == "gpu" and index.isdigit() else None


def share(total: int, span: int) -> int:
    """The bytes a slot of ``total`` bytes holds on each of the ``span`` devices it spans
    (rounded up: a load never counts less than it needs)."""
    return -(-total // max(1, span))
