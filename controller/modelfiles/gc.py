"""The models dir's GC: room made by removing model files nobody declared, least
recently used first, never a pinned model's — with a dry run that lists what it would do.

:func:`plan_gc` is pure: the entries of :func:`controller.modelfiles.inventory.scan`, the
references the caller declares (each model's destination: a file or a snapshot
directory; ``pinned`` for a model a pinned slot serves), and optionally the bytes needed.
An entry that a reference covers (the same path, one inside the other) is kept; the rest
are candidates, oldest last use first, taken until ``need_bytes`` are freed (all of them
when no need is given). ``spare_referenced=False`` (a deliberate, aggressive GC) lets
declared but unpinned models' files go too — they are pulled again when next loaded;
pinned ones never go. :func:`apply_gc` carries a plan out and forgets the removed
entries. Called by :mod:`controller.modelfiles.pull` (``ModelFiles.gc`` and the room a pull
needs), later by ``slotctl model gc [--dry-run]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from controller.modelfiles.inventory import CacheEntry
from controller.modelfiles.layout import CacheLayout
from controller.modelfiles.records import FileRecords

__all__ = ["GcPlan", "Reference", "apply_gc", "plan_gc"]


@dataclass(frozen=True, slots=True)
class Reference:
    """A declared model's destination (a file or snapshot directory) that GC must keep."""

    path: Path
    model: str
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class GcPlan:
    remove: tuple[CacheEntry, ...]  # in the order they go (least recently used first)
    kept: tuple[tuple[CacheEntry, str], ...]  # with the reason each stays
    need_bytes: int | None = None

    @property
    def freed_bytes(self) -> int:
        return sum(e.size for e in self.remove)

    @property
    def short_bytes(self) -> int:
        """What the plan can not free of ``need_bytes`` (0: it is enough)."""
        return 0 if self.need_bytes is None else max(0, self.need_bytes - self.freed_bytes)

    def lines(self) -> list[str]:
        """The dry run, one line per entry (``remove``/``keep``, size, path, reason)."""
        out = [f"remove {e.size:>14} {e.path}" for e in self.remove]
        out += [f"keep   {e.size:>14} {e.path} ({why})" for e, why in self.kept]
        return out


def _covers(ref: Path, entry: Path) -> bool:
    return ref == entry or ref in entry.parents or entry in ref.parents


def plan_gc(
    entries: Sequence[CacheEntry],
    references: Iterable[Reference],
    *,
    need_bytes: int | None = None,
    spare_referenced: bool = True,
) -> GcPlan:
    refs = list(references)
    kept: list[tuple[CacheEntry, str]] = []
    candidates: list[CacheEntry] = []
    for entry in entries:
        covering = [r for r in refs if _covers(r.path, entry.path)]
        pinned = sorted(r.model for r in covering if r.pinned)
        if pinned:
            kept.append((entry, f"pinned: {', '.join(pinned)}"))
        elif covering and spare_referenced:
            kept.append((entry, f"declared: {', '.join(sorted(r.model for r in covering))}"))
        else:
            candidates.append(entry)
    candidates.sort(key=lambda e: (e.last_used, str(e.path)))
    remove: list[CacheEntry] = []
    freed = 0
    for entry in candidates:
        if need_bytes is not None and freed >= need_bytes:
            kept.append((entry, "not needed"))
            continue
        remove.append(entry)
        freed += entry.size
    return GcPlan(tuple(remove), tuple(kept), need_bytes)


def _remove(entry: CacheEntry, root: Path) -> None:
    if entry.kind == "snapshot":
        shutil.rmtree(entry.path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            entry.path.unlink()
    parent = entry.path.parent
    while parent != root and root in parent.parents:
        try:
            parent.rmdir()  # only while empty
        except OSError:
            break
        parent = parent.parent


async def apply_gc(plan: GcPlan, layout: CacheLayout, records: FileRecords) -> int:
    """Remove the plan's entries (in a thread); returns the bytes freed."""
    for entry in plan.remove:
        await asyncio.to_thread(_remove, entry, layout.models_dir)
        records.forget(entry.path)
    return plan.freed_bytes
