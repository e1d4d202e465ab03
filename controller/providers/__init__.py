"""Provider registry: ``build_launch(slot, model, ctx)`` -> the slot's LaunchSpec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Final

from controller.providers.base import BuildContext, Provider, model_path
from controller.providers.templates import (
    DemoProvider,
    GenericProvider,
    LlamaCppProvider,
    LlamaCppPythonProvider,
    VllmProvider,
)
from controller.runtime.base import LaunchSpec
from controller.spec.schema import PROVIDERS, SELF_MANAGED_PROVIDERS, ModelSpec, SlotSpec

__all__ = ["PROVIDER_REGISTRY", "BuildContext", "Provider", "build_launch", "model_path"]

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
    if ctx.runtime == "kubernetes" and ctx.host == "127.0.0.1":
        # In its own pod the server is reached at the pod's IP, from outside the pod.
        ctx = replace(ctx, host="0.0.0.0")  # noqa: S104
    return PROVIDER_REGISTRY[slot.provider].build(slot, model, ctx)
