"""Desired state -> stack-file TOML (pure). Used by ``stack show`` and ``stack export``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tomlkit

from controller.spec.guard import toml_table
from controller.spec.loader import DesiredSlot
from controller.spec.schema import ModelSpec, SlotSpec

__all__ = ["model_effective", "render_stack", "slot_effective"]


def model_effective(model: ModelSpec) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)


def slot_effective(spec: SlotSpec) -> dict[str, Any]:
    """Every field with its effective value (defaults and migrations applied)."""
    return spec.model_dump(mode="json", exclude_none=True)


def render_stack(
    stack: str, models: Iterable[ModelSpec], slots: Iterable[DesiredSlot], *, full: bool = True
) -> str:
    """A stack file that loads back to the same desired state."""
    doc = tomlkit.document()
    meta = tomlkit.table()
    meta["name"] = stack
    doc["stack"] = meta
    model_aot = tomlkit.aot()
    for model in models:
        model_aot.append(toml_table(model_effective(model)))
    if len(model_aot):
        doc["model"] = model_aot
    slot_aot = tomlkit.aot()
    for slot in slots:
        data = (
            slot_effective(slot.spec)
            if full
            else slot.spec.model_dump(mode="json", exclude_unset=True, exclude_none=True)
        )
        slot_aot.append(toml_table(data))
    if len(slot_aot):
        doc["slot"] = slot_aot
    return tomlkit.dumps(doc)
