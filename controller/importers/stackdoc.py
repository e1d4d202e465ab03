"""The stack an import writes: models, slots and aliases as plain data, named to slotctl's
rules, rendered as a stack file (TOML, through the same tables ``stack show`` uses)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import tomlkit

from controller.importers.report import ImportReport
from controller.model.names import MODEL_ID_PATTERN, SLOT_NAME_PATTERN
from controller.spec.render import toml_table

__all__ = ["StackDoc", "model_id_of", "slot_name_of", "stack_name_of"]

_MODEL_ID_RE: Final = re.compile(MODEL_ID_PATTERN)
_SLOT_RE: Final = re.compile(SLOT_NAME_PATTERN)


def _label(text: str, fallback: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", text.lower())
    base = re.sub(r"-{2,}", "-", base).strip("-")[:63].strip("-")
    return base or fallback


def stack_name_of(text: str) -> str:
    """A DNS-1123 label for ``[stack] name``."""
    return _label(text, "imported")


def slot_name_of(model_id: str, taken: Iterable[str]) -> str:
    """A DNS-1123 label from a model id, unique among ``taken`` (``-2``, ``-3``…)."""
    used = set(taken)
    base = _label(model_id, "slot")
    name, n = base, 2
    while name in used:
        suffix = f"-{n}"
        name = base[: 63 - len(suffix)].rstrip("-") + suffix
        n += 1
    assert _SLOT_RE.fullmatch(name)
    return name


def model_id_of(raw: str, key: str, report: ImportReport) -> str:
    """``raw`` when it is a valid slotctl model id; else its nearest valid one, reported."""
    if _MODEL_ID_RE.fullmatch(raw):
        return raw
    fixed = re.sub(r"[^A-Za-z0-9._:/@+=-]+", "-", raw).lstrip("._:/@+=-")[:200] or "model"
    report.add(
        key,
        "approximated",
        f"model id {raw!r} is not a valid slotctl id ([A-Za-z0-9._:/@+=-], up to 200): "
        f"served as {fixed!r}",
    )
    return fixed


@dataclass(slots=True)
class StackDoc:
    """The imported desired state, in the order it was read."""

    name: str
    models: list[dict[str, Any]] = field(default_factory=list)
    slots: list[dict[str, Any]] = field(default_factory=list)
    aliases: list[dict[str, Any]] = field(default_factory=list)

    def model(self, model_id: str) -> dict[str, Any] | None:
        return next((m for m in self.models if m["id"] == model_id), None)

    def slot_of(self, model_id: str) -> dict[str, Any] | None:
        return next((s for s in self.slots if s["model"]["default"] == model_id), None)

    def render(self, header: Iterable[str] = ()) -> str:
        doc = tomlkit.document()
        for line in header:
            doc.add(tomlkit.comment(line))
        if header:
            doc.add(tomlkit.nl())
        meta = tomlkit.table()
        meta["name"] = self.name
        doc["stack"] = meta
        for key, entries in (("model", self.models), ("slot", self.slots), ("alias", self.aliases)):
            if entries:
                aot = tomlkit.aot()
                for entry in entries:
                    aot.append(toml_table(entry))
                doc[key] = aot
        return tomlkit.dumps(doc)


@dataclass(slots=True)
class ImportResult:
    """An import's stack, its report, and the commands it asks the user to run."""

    doc: StackDoc
    report: ImportReport
    commands: list[str] = field(default_factory=list)

    def render(self, source: str) -> str:
        counts = self.report.counts()
        header = [
            f" imported by `slotctl import` from {source} ({self.report.source_format})",
            " findings: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            if any(counts.values())
            else " findings: none",
        ]
        return self.doc.render(header)
