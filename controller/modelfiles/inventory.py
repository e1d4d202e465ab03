"""What the models dir holds: every model file and pulled snapshot, its size and last use.

A snapshot the engine put in place (recorded in :mod:`controller.modelfiles.records`) counts
as one entry — a GC removes a repository whole or not at all —; every other regular file
is an entry of its own. The engine's corner (``.slotctl/``: partial, staging, quarantine)
and symbolic links are never entries. Last use is the engine's record (a pull, a server
started on it), else the file's own atime or mtime, whichever is later. Blocking (walks
the directory): call it in a thread. Used by :mod:`controller.modelfiles.gc` and the model
list of :mod:`controller.modelfiles.pull`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from controller.modelfiles.layout import CacheLayout
from controller.modelfiles.records import FileRecords

__all__ = ["CacheEntry", "scan"]


@dataclass(frozen=True, slots=True)
class CacheEntry:
    path: Path
    kind: Literal["file", "snapshot"]
    size: int
    last_used: float
    files: int = 1


def _walk_files(
    root: Path, skip: set[Path], layout: CacheLayout
) -> list[tuple[Path, os.stat_result]]:
    found = []
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(directory)
        dirnames[:] = sorted(
            d for d in dirnames if here / d not in skip and not layout.is_internal(here / d)
        )
        for name in sorted(filenames):
            path = here / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):  # lstat: a symbolic link is never an entry
                found.append((path, st))
    return found


def scan(layout: CacheLayout, records: FileRecords) -> list[CacheEntry]:
    """Every entry of the models dir (see the module text), in path order."""
    root = layout.models_dir
    if not root.is_dir():
        return []
    snapshots = {d for d in records.snapshot_dirs() if d.is_dir() and root in d.parents}
    entries = []
    for directory in sorted(snapshots):
        files = _walk_files(directory, set(), layout)
        size = sum(st.st_size for _, st in files)
        seen = max((max(st.st_atime, st.st_mtime) for _, st in files), default=0.0)
        used = records.last_used(directory)
        entries.append(
            CacheEntry(directory, "snapshot", size, used if used is not None else seen, len(files))
        )
    for path, st in _walk_files(root, snapshots, layout):
        used = records.last_used(path)
        entries.append(
            CacheEntry(
                path,
                "file",
                st.st_size,
                used if used is not None else max(st.st_atime, st.st_mtime),
            )
        )
    return sorted(entries, key=lambda e: e.path)
