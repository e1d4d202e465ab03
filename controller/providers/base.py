"""What every provider template shares: the build context, model paths and probes.

Pure: builds :class:`~controller.runtime.base.LaunchSpec` values from a slot and its model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

from controller.model.devices import GpuRef
from controller.model.errors import SlotConfigError
from controller.modelfiles.sources import destination
from controller.probes.http import HttpCall
from controller.probes.readiness import ProbeSpec
from controller.probes.sleep import VLLM_SLEEP, SleepMode
from controller.runtime.base import LaunchSpec, RuntimeKind
from controller.spec.schema import AdapterSpec, ModelSpec, SlotSpec

__all__ = [
    "LIVENESS_PATH",
    "READY_LOG",
    "SLEEP_MODES",
    "BuildContext",
    "Provider",
    "adapter_path",
    "default_models_dir",
    "default_probe",
    "device_env",
    "model_path",
    "sleep_mode",
]


def default_models_dir() -> Path:
    """Where hf:// and relative model sources resolve when no models dir is configured:
    ``$SLOTCTL_MODELS_DIR``, else ``/models``."""
    return Path(os.environ.get("SLOTCTL_MODELS_DIR", "/models"))


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a launch is built for besides the slot and its model (build it with
    :func:`controller.providers.launch_context`, which every caller shares)."""

    runtime: RuntimeKind = RuntimeKind.PROCESS  # never FAKE: the fake runtime builds as process
    stack: str = ""
    models_dir: Path = field(default_factory=default_models_dir)
    host: str = "127.0.0.1"
    # The declared adapters (controller.spec.adapters): a start-time engine's launch
    # names the files of those its slot lists (``adapters``).
    adapters: Mapping[str, AdapterSpec] = field(default_factory=dict)
    # The image of slotctl itself on a container runtime (the kubernetes runtime's: the
    # operator's own), which a demo slot without server.image runs.
    image: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "runtime", RuntimeKind(self.runtime))  # a kind's name taken


class Provider(Protocol):
    @property
    def name(self) -> str: ...

    def build(self, slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> LaunchSpec:
        """The effective runtime config for ``slot`` serving ``model``."""
        ...


@runtime_checkable
class SizesToPlacement(Protocol):
    """A provider whose server sizes itself as a fraction of its GPUs (vLLM's
    ``--gpu-memory-utilization``): told where it was placed and the share it was admitted
    with."""

    def placement_args(
        self, slot: SlotSpec, gpus: tuple[GpuRef, ...], share_bytes: int
    ) -> tuple[str, ...]: ...


def model_path(model: ModelSpec | None, ctx: BuildContext) -> str | None:
    """Local file a server reads for ``model`` (None for demo:// and no source).

    ``hf://org/repo/file`` resolves into the models dir (``<models_dir>/org/repo/file``), a
    whole repository ``hf://org/repo`` (what vLLM serves) to its directory there, a URL
    to ``<models_dir>/_urls/host/path``; relative paths are relative to the models dir
    too. The one mapping is :func:`controller.modelfiles.sources.destination`: the pull writes
    exactly where the server reads.
    """
    if model is None or not model.source:
        return None
    source = model.source
    if source.startswith("demo://"):
        return None
    return str(destination(source, ctx.models_dir))


def adapter_path(adapter: AdapterSpec, ctx: BuildContext) -> str:
    """Where a server reads ``adapter``'s file: its source resolved as a model's
    (:func:`model_path`)."""
    return str(destination(adapter.source, ctx.models_dir))


def require_model(slot: SlotSpec, model: ModelSpec | None) -> ModelSpec:
    if model is None:
        raise SlotConfigError(
            f"slot {slot.name!r} (provider {slot.provider}) needs a model: set model.default",
            keys=["model.default"],
        )
    return model


def device_env(slot: SlotSpec) -> dict[str, str]:
    """Device visibility is the controller's: a cpu slot sees no GPU (a GPU slot sees the
    GPUs it is placed on: the runtime sets them, :func:`controller.runtime.base.visibility_env`)."""
    if slot.device_kind == "cpu":
        return {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    return {}


# The log line with which each provider's server announces that it serves (a regular
# expression, searched in each line of the slot's log): it wakes the readiness probe at
# once instead of at its next scheduled attempt. The HTTP probe still decides, so a
# line that comes early costs one extra probe, never a false "ready". uvicorn logs
# "Application startup complete" *before* it binds its port when it binds the port
# itself (``uvicorn.run``), and "Uvicorn running on" after; vLLM binds the socket first
# and hands it to uvicorn, which then logs only the former.
# The providers' own liveness endpoints (a capability: the probe asks it, never the
# provider's name). llama-server's /health answers 200 once loaded (503 while loading or,
# in older builds, with no free slot); vLLM's answers 200, or 503 once its engine died;
# the demo server's 200 (503 while loading). Any answer is alive (probe.check_liveness).
LIVENESS_PATH: Final[Mapping[str, str]] = {
    "demo": "/health",
    "llamacpp": "/health",
    "vllm": "/health",
}

# The providers whose servers can sleep (a capability: the manager asks the launch's
# ``sleep``, never the provider's name). vLLM's sleep mode (--enable-sleep-mode, the dev-mode
# endpoints behind VLLM_SERVER_DEV_MODE=1) is on by default: a wake is 18-200x faster than a
# reload (vLLM's figures). The demo server answers the same calls; its sleep is opt-in
# (`sleep = true`), as it is the test double of every other test. llama.cpp cannot sleep.
SLEEP_MODES: Final[Mapping[str, SleepMode]] = {
    "vllm": VLLM_SLEEP,
    "demo": replace(VLLM_SLEEP, env={}, default_on=False),
}


def sleep_mode(slot: SlotSpec) -> SleepMode | None:
    """The slot's sleep mode: its provider's, unless the slot opts out (``sleep = false``,
    or the provider's default is off and the slot does not say ``sleep = true``). A GPU
    slot's only: sleeping releases device memory into host memory."""
    mode = SLEEP_MODES.get(slot.provider)
    if mode is None or slot.device_kind != "gpu":
        return None
    wanted = mode.default_on if slot.sleep is None else slot.sleep
    return mode if wanted and slot.sleep_level in mode.levels else None


READY_LOG: Final[Mapping[str, str]] = {
    "demo": r"^slotctl-demo (ready|loaded without a model) ",
    "llamacpp": r"server is listening on ",  # llama-server, once the model is loaded
    "llama-cpp-python": r"Uvicorn running on ",  # llama_cpp.server: loads, then uvicorn.run
    "vllm": r"Application startup complete",
    "openai-compatible": r"Uvicorn running on ",  # most OpenAI-compatible servers
}


def default_probe(slot: SlotSpec, model_id: str) -> ProbeSpec:
    """Models list, then one sentinel request matching the slot type (SPEC §5)."""
    sentinel: HttpCall | None = None
    if slot.type == "llm":
        sentinel = HttpCall(
            "POST", "/v1/completions", {"model": model_id, "prompt": "ping", "max_tokens": 1}
        )
    elif slot.type == "embedding":
        sentinel = HttpCall("POST", "/v1/embeddings", {"model": model_id, "input": "ping"})
    return ProbeSpec(sentinel=sentinel)
