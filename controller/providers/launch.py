"""A slot's launch: the provider registry, the one build context and the config hash.

:func:`build_launch` turns a slot and its model into the runtime's
:class:`~controller.runtime.base.LaunchSpec` through its provider's template;
:func:`launch_context` and :func:`launch_hash` are the one build context and config hash
the manager and ``stack diff``/``apply`` share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Final

from controller.model.devices import GpuRef
from controller.model.errors import SlotConfigError, SlotctlError
from controller.providers.base import BuildContext, Provider, SizesToPlacement, default_models_dir
from controller.providers.templates import (
    DemoProvider,
    GenericProvider,
    LlamaCppProvider,
    LlamaCppPythonProvider,
    VllmProvider,
)
from controller.runtime.base import LaunchSpec, RuntimeKind, own_image
from controller.spec.schema import (
    PROVIDERS,
    SELF_MANAGED_PROVIDERS,
    AdapterSpec,
    ModelSpec,
    SlotSpec,
)

__all__ = [
    "PROVIDER_REGISTRY",
    "build_launch",
    "launch_context",
    "launch_hash",
    "placement_args",
    "with_port",
]

PROVIDER_REGISTRY: Final[Mapping[str, Provider]] = {
    "demo": DemoProvider(),
    "llamacpp": LlamaCppProvider(),
    "llama-cpp-python": LlamaCppPythonProvider(),
    "vllm": VllmProvider(),
    "openai-compatible": GenericProvider("openai-compatible"),
    **{name: GenericProvider(name, self_managed=True) for name in SELF_MANAGED_PROVIDERS},
}
assert set(PROVIDER_REGISTRY) == set(PROVIDERS), "every schema provider has a template"


def build_launch(slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> LaunchSpec:
    """The slot's effective runtime config. A slot whose port the controller chooses
    (``port`` absent or ``"auto"``) comes with its chosen port already (``with_port``);
    without one it cannot be built (:class:`SlotConfigError`)."""
    if slot.port is None:
        raise SlotConfigError(
            f"slot {slot.name!r}: its port is chosen by the controller and not chosen yet",
            keys=["port"],
        )
    if ctx.runtime is RuntimeKind.KUBERNETES and ctx.host == "127.0.0.1":
        # In its own pod the server is reached at the pod's IP, from outside the pod.
        ctx = replace(ctx, host="0.0.0.0")  # noqa: S104
    return PROVIDER_REGISTRY[slot.provider].build(slot, model, ctx)


def placement_args(slot: SlotSpec, gpus: tuple[GpuRef, ...], share_bytes: int) -> tuple[str, ...]:
    """The arguments a provider's server needs for where it was placed (a capability:
    :class:`~controller.providers.base.SizesToPlacement`)."""
    provider = PROVIDER_REGISTRY[slot.provider]
    if not isinstance(provider, SizesToPlacement):
        return ()
    return tuple(provider.placement_args(slot, gpus, share_bytes))


def with_port(slot: SlotSpec, port: int | None) -> SlotSpec:
    """``slot`` with the port the controller chose for it (an auto port; a slot that
    names its own port, or ``port`` None, as it is)."""
    if slot.port is not None or port is None:
        return slot
    return slot.model_copy(update={"port": port})


def launch_context(
    runtime: RuntimeKind | str,
    stack: str,
    models_dir: Path | None = None,
    adapters: Mapping[str, AdapterSpec] | None = None,
) -> BuildContext:
    """The build context of a slot of ``stack`` on ``runtime``: the one both the manager and
    ``stack diff``/``apply`` build with, so they hash alike. The fake runtime builds as
    ``process``; ``models_dir`` None is the default (:func:`default_models_dir`). The
    kubernetes runtime's context carries slotctl's own image (:func:`own_image`)."""
    kind = RuntimeKind(runtime)
    if kind is RuntimeKind.FAKE:
        kind = RuntimeKind.PROCESS
    image = own_image() if kind is RuntimeKind.KUBERNETES else None
    return BuildContext(
        runtime=kind,
        stack=stack,
        models_dir=models_dir or default_models_dir(),
        adapters=adapters or {},
        image=image,
    )


def launch_hash(slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> str | None:
    """The config hash ``slot`` would run with (its labels' ``slotctl.config-hash``); None
    when its launch cannot be built (yet: a port still to choose, a refused config)."""
    try:
        return build_launch(slot, model, ctx).config_hash()
    except SlotctlError:
        return None
