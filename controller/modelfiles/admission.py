"""Disk admission: a pull is admitted against the models dir's free space before it
writes a byte, as a load is admitted against device memory.

``free - margin - reserved >= needed``, where ``needed`` is what this pull will still write
(its size less the bytes already on disk), ``margin`` is kept free for everything else on
that filesystem, and ``reserved`` is what the pulls in flight have been admitted for and
not yet written (two pulls started together must not both count the same free bytes).
A refusal is :class:`~controller.model.errors.InsufficientDisk` with the figures. Free
space is read through the :class:`DiskSpace` seam (``statvfs``); the tests run it on a
real small tmpfs. Called by :mod:`controller.modelfiles.pull`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from controller.model.errors import InsufficientDisk
from controller.model.sizes import format_gib

__all__ = ["DiskAdmission", "DiskSpace", "Reservation", "StatvfsDisk"]


class DiskSpace(Protocol):
    def free_bytes(self, path: Path) -> int:
        """Bytes an unprivileged writer may still write on ``path``'s filesystem."""
        ...


class StatvfsDisk:
    """The real disk: ``statvfs`` of the nearest existing directory (``f_bavail``: the
    blocks left to a non-root writer, as ``df`` shows them)."""

    def free_bytes(self, path: Path) -> int:
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        st = os.statvfs(probe)
        return st.f_bavail * st.f_frsize


@dataclass(slots=True)
class Reservation:
    """What one admitted pull may still write; shrinks as it writes, gone at release."""

    admission: DiskAdmission
    label: str
    needed: int
    written: int = 0
    released: bool = False

    @property
    def outstanding(self) -> int:
        return 0 if self.released else max(0, self.needed - self.written)

    def wrote(self, n: int) -> None:
        self.written += n

    def release(self) -> None:
        self.admission._release(self)


@dataclass(slots=True)
class DiskAdmission:
    models_dir: Path
    disk: DiskSpace = field(default_factory=StatvfsDisk)
    margin_bytes: int = 512 * 1024**2
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _held: list[Reservation] = field(default_factory=list)

    def reserved(self) -> int:
        with self._lock:
            return sum(r.outstanding for r in self._held)

    def free(self) -> int:
        return self.disk.free_bytes(self.models_dir)

    def admit(self, needed: int, label: str, *, reclaimable: int = 0) -> Reservation:
        """Reserve ``needed`` bytes for ``label`` or raise ``InsufficientDisk``."""
        free = self.free()
        with self._lock:
            reserved = sum(r.outstanding for r in self._held)
            available = free - self.margin_bytes - reserved
            if needed > available:
                raise InsufficientDisk(
                    f"{label} needs {format_gib(needed)} but the models dir "
                    f"{self.models_dir} has {format_gib(max(available, 0))} to give "
                    f"({format_gib(free)} free, {format_gib(self.margin_bytes)} kept free"
                    + (f", {format_gib(reserved)} promised to pulls in flight" if reserved else "")
                    + ")",
                    needed_bytes=needed,
                    free_bytes=free,
                    margin_bytes=self.margin_bytes,
                    reserved_bytes=reserved,
                    reclaimable_bytes=reclaimable,
                    path=str(self.models_dir),
                )
            reservation = Reservation(self, label, needed)
            self._held.append(reservation)
            return reservation

    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            reservation.released = True
            if reservation in self._held:
                self._held.remove(reservation)
