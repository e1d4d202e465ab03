"""Desired state -> stack-file TOML (pure). Used by ``stack show`` and ``stack export``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import tomlkit
import tomlkit.items

from controller.spec.loader import DesiredSlot
from controller.spec.schema import AdapterSpec, AliasSpec, ModelSpec, SlotSpec

__all__ = ["model_effective", "render_stack", "slot_effective", "toml_table"]


def toml_table(data: Mapping[str, Any]) -> tomlkit.items.Table:
    """A readable TOML table: scalars first, ``model`` inline, other sub-tables after."""
    table = tomlkit.table()
    for key, value in data.items():
        if key == "model" and isinstance(value, Mapping):
            inline = tomlkit.inline_table()
            inline.update(value)
            table[key] = inline
        elif not isinstance(value, Mapping):
            table[key] = value
    for key, value in data.items():
        if key != "model" and isinstance(value, Mapping):
            sub = tomlkit.table()
            for k, v in value.items():
                sub[k] = v
            table[key] = sub
    return table


def model_effective(model: ModelSpec) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)


def slot_effective(spec: SlotSpec) -> dict[str, Any]:
    """Every field with its effective value (defaults and migrations applied)."""
    return spec.model_dump(mode="json", exclude_none=True)


def render_stack(
    stack: str,
    models: Iterable[ModelSpec],
    slots: Iterable[DesiredSlot],
    *,
    full: bool = True,
    aliases: Iterable[AliasSpec] = (),
    adapters: Iterable[AdapterSpec] = (),
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
    alias_aot = tomlkit.aot()
    for alias in aliases:
        alias_aot.append(toml_table(alias.model_dump(mode="json")))
    if len(alias_aot):
        doc["alias"] = alias_aot
    adapter_aot = tomlkit.aot()
    for adapter in adapters:
        adapter_aot.append(toml_table(adapter.model_dump(mode="json", exclude_none=True)))
    if len(adapter_aot):
        doc["adapter"] = adapter_aot
    return tomlkit.dumps(doc)
