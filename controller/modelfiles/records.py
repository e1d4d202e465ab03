"""What the engine remembers about model files: verified digests by file identity, and
when each file or snapshot was last used.

One small JSON file in the state dir (``<state_dir>/models/files.json``), written through
the store's atomic writer (:func:`controller.store.files.atomic_write_json`; not fsynced:
the record is a cache — a lost entry costs one re-verification, never a wrong answer).
A file is *verified* when its identity (device, inode, size, mtime) is the one recorded
with its digest: a file replaced or touched since no longer matches and is hashed again.
Called by :mod:`controller.modelfiles.pull` (remember, look up, touch) and
:mod:`controller.modelfiles.inventory` (last use, for the GC's order).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from controller.modelfiles.digests import Digest
from controller.store.files import atomic_write_json

__all__ = ["RECORD_NAME", "FileIdentity", "FileRecords", "SnapshotRecord"]

log = logging.getLogger(__name__)
RECORD_NAME: Final = "files.json"
_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What says a file is still the one that was hashed."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    """A snapshot directory the engine put in place."""

    source: str
    commit: str
    files: int
    size: int
    pulled_at: float


class FileRecords:
    """The record of ``<state_dir>/models/files.json`` (loaded once, written on change)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "models" / RECORD_NAME
        self._files: dict[str, dict[str, Any]] = {}
        self._snapshots: dict[str, dict[str, Any]] = {}
        self._used: dict[str, float] = {}
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("models record %s unreadable (%s): starting afresh", self.path, exc)
            return
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            return
        self._files = dict(data.get("files") or {})
        self._snapshots = dict(data.get("snapshots") or {})
        self._used = {k: float(v) for k, v in (data.get("last_used") or {}).items()}

    def _save(self) -> None:
        atomic_write_json(
            self.path,
            {
                "version": _VERSION,
                "files": self._files,
                "snapshots": self._snapshots,
                "last_used": self._used,
            },
            durable=False,
            indent=None,
        )

    # -- verified digests -------------------------------------------------------------

    def verified(self, path: Path) -> Digest | None:
        """The digest ``path`` was verified with, while it is still that very file."""
        entry = self._files.get(os.fspath(path))
        identity = FileIdentity.of(path)
        if entry is None or identity is None:
            return None
        if entry.get("identity") != asdict(identity):
            return None
        try:
            return Digest.parse(str(entry.get("digest")))
        except ValueError:
            return None

    def files_under(self, directory: Path) -> list[Path]:
        """The recorded files inside ``directory``."""
        inside = os.fspath(directory).rstrip("/") + "/"
        return [Path(p) for p in self._files if p.startswith(inside)]

    def remember(self, path: Path, digest: Digest, source: str, when: float) -> None:
        identity = FileIdentity.of(path)
        if identity is None:
            return
        self._files[os.fspath(path)] = {
            "identity": asdict(identity),
            "digest": str(digest),
            "source": source,
            "verified_at": when,
        }
        self._used[os.fspath(path)] = when
        self._save()

    # -- snapshots ----------------------------------------------------------------------

    def remember_snapshot(self, directory: Path, record: SnapshotRecord) -> None:
        self._snapshots[os.fspath(directory)] = asdict(record)
        self._used[os.fspath(directory)] = record.pulled_at
        self._save()

    def snapshot(self, directory: Path) -> SnapshotRecord | None:
        entry = self._snapshots.get(os.fspath(directory))
        if entry is None:
            return None
        try:
            return SnapshotRecord(**entry)
        except TypeError:
            return None

    def snapshot_dirs(self) -> list[Path]:
        return [Path(p) for p in self._snapshots]

    # -- use ----------------------------------------------------------------------------

    def touch(self, path: Path, when: float) -> None:
        """``path`` (a file or a snapshot directory) was used at ``when``."""
        self._used[os.fspath(path)] = when
        self._save()

    def last_used(self, path: Path) -> float | None:
        return self._used.get(os.fspath(path))

    def forget(self, path: Path) -> None:
        """Drop everything recorded at or under ``path`` (it was removed)."""
        key = os.fspath(path)
        inside = key.rstrip("/") + "/"
        changed = False
        for table in (self._files, self._snapshots, self._used):
            for name in [n for n in table if n == key or n.startswith(inside)]:
                del table[name]
                changed = True
        if changed:
            self._save()
