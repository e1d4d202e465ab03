"""The engine's own corner of the models dir: partial files, staged snapshots, quarantine.

Everything the engine writes before it is verified lives under ``<models_dir>/.slotctl/``,
on the same filesystem as the files it becomes, so the last step is one ``rename``:

``partial/<key>.part``
    bytes of one file as they arrive (``<key>`` names the destination and the expected
    digest: a restart finds it again and resumes; a new upstream version gets a new one)
``partial/<key>.lock``
    held (``flock``) by the one process writing that partial file
``staging/<key>/``
    a snapshot's verified files until the last one is in, then renamed into place
``quarantine/<when>-<name>``
    bytes that failed verification, moved aside (never deleted, never served) with a
    ``.json`` beside them saying what was expected and what was found

Called by :mod:`controller.modelfiles.partial`, :mod:`controller.modelfiles.pull` and
:mod:`controller.modelfiles.inventory` (which skips this corner).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = ["ENGINE_DIR", "CacheLayout"]

ENGINE_DIR: Final = ".slotctl"


@dataclass(frozen=True, slots=True)
class CacheLayout:
    models_dir: Path

    @property
    def root(self) -> Path:
        return self.models_dir / ENGINE_DIR

    @property
    def partial_dir(self) -> Path:
        return self.root / "partial"

    @property
    def staging_dir(self) -> Path:
        return self.root / "staging"

    @property
    def quarantine_dir(self) -> Path:
        return self.root / "quarantine"

    @staticmethod
    def key(dest: Path, tag: str) -> str:
        """A file-name-safe key for ``dest`` at version ``tag`` (its expected digest)."""
        where = hashlib.sha256(os.fsencode(dest)).hexdigest()[:16]
        version = hashlib.sha256(tag.encode()).hexdigest()[:16]
        return f"{where}-{version}"

    @staticmethod
    def dest_prefix(dest: Path) -> str:
        """The prefix every partial of ``dest`` (any version) starts with."""
        return hashlib.sha256(os.fsencode(dest)).hexdigest()[:16] + "-"

    def partial(self, dest: Path, tag: str) -> Path:
        return self.partial_dir / f"{self.key(dest, tag)}.part"

    def staging(self, dest: Path, tag: str) -> Path:
        return self.staging_dir / self.key(dest, tag)

    def stale_partials(self, dest: Path, keep: Path) -> list[Path]:
        """Partial files of ``dest`` for other versions than ``keep`` (upstream moved on)."""
        prefix = self.dest_prefix(dest)
        if not self.partial_dir.is_dir():
            return []
        return sorted(
            p
            for p in self.partial_dir.iterdir()
            if p.name.startswith(prefix) and p.suffix == ".part" and p != keep
        )

    def is_internal(self, path: Path) -> bool:
        return path == self.root or self.root in path.parents

    def quarantine(self, path: Path, facts: dict[str, Any]) -> Path:
        """Move ``path`` (a file or directory) aside into the quarantine, with ``facts``
        (what was expected and found) in a ``.json`` beside it; returns where it went."""
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.quarantine_dir / f"{stamp}-{path.name}"
        n = 1
        while target.exists():
            n += 1
            target = self.quarantine_dir / f"{stamp}-{n}-{path.name}"
        path.rename(target)
        note = target.with_name(target.name + ".json")
        with contextlib.suppress(OSError):
            note.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return target
