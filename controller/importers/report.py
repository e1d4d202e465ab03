"""The import report: every key of the source that was not carried over exactly, and why.

Nothing is dropped silently: a key the importer reads but cannot map is a
:class:`Finding` with its path in the source (``models.qwen.filters.stripParams``), a kind
and the reason. ``slotctl import`` prints them to stderr; ``--strict`` fails on any but
``owned`` ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

__all__ = ["KINDS", "STRICT_KINDS", "Finding", "FindingKind", "ImportReport"]

# dropped: slotctl has no equivalent (the setting is lost);
# approximated: mapped to the nearest slotctl setting, which behaves differently (said how);
# owned: slotctl sets this itself (ports, hosts, GPU flags, probes): nothing is lost;
# needs-input: the importer cannot decide without the user (a file name, an unset variable).
FindingKind = Literal["dropped", "approximated", "owned", "needs-input"]
KINDS: Final[tuple[FindingKind, ...]] = ("dropped", "approximated", "owned", "needs-input")
STRICT_KINDS: Final[frozenset[str]] = frozenset({"dropped", "approximated", "needs-input"})


@dataclass(frozen=True, slots=True)
class Finding:
    """One key of the source and what became of it."""

    key: str  # its path in the source: models.qwen.ttl, groups.big.exclusive, [qwen].c
    kind: FindingKind
    reason: str

    def line(self, source: str) -> str:
        return f"{source}: {self.key}: {self.kind}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class ImportReport:
    """The findings of one import, in the order the source was read."""

    source_format: str  # "llama-swap" | "llama-server-presets"
    findings: list[Finding] = field(default_factory=list)

    def add(self, key: str, kind: FindingKind, reason: str) -> None:
        finding = Finding(key, kind, reason)
        if finding not in self.findings:
            self.findings.append(finding)

    def keys(self, kind: str | None = None) -> list[str]:
        return [f.key for f in self.findings if kind is None or f.kind == kind]

    def strict_failures(self) -> list[Finding]:
        """What ``--strict`` refuses: anything not carried over exactly."""
        return [f for f in self.findings if f.kind in STRICT_KINDS]

    def counts(self) -> dict[str, int]:
        return {k: sum(1 for f in self.findings if f.kind == k) for k in KINDS}
