"""The process runtime's records: ``slots/<name>/process.json`` (and a surge's own).

Part of :mod:`controller.runtime.process.runtime`. A record holds a server's pid and start time
(a recycled pid is never taken for ours), its argv, config hash, endpoint and port; it is
written through the store (atomic), read again only when the file changed.
"""

from __future__ import annotations

import os
from typing import Any, Final

from controller.store.state import StateStore

__all__ = ["RECORD", "RECORD_DURABLE", "ProcessRecords"]

RECORD: Final = "process.json"
# The record is written atomically but not fsynced: it must survive a crash of the
# controller (the page cache does), not one of the machine, which ends the server it
# describes too (a lost or older record then names a process that is gone; the pid's
# start time rules out a recycled pid). It saves two fsyncs at every start.
RECORD_DURABLE: Final = False


class ProcessRecords:
    """The slots' ``process.json`` records, read again only when the file has changed.

    Every look at a slot (``inspect``: each probe attempt asks whether the server is
    alive) needs its record; the runtime writes it itself, so a read is mostly a parse of
    what it wrote. A look ``stat``s the file (its inode, size, change and modification
    times: an atomic rewrite is a new inode) and parses it only when that changed; what
    this runtime writes it keeps as written. A record deleted or edited by hand is seen
    at the next look, as before; a restarted controller reads every record from disk.
    """

    def __init__(self, store: StateStore, name: str = RECORD) -> None:
        self.store = store
        self.name = name  # process.json; a surge's second server has a record of its own
        self._paths: dict[str, str] = {}
        self._known: dict[str, tuple[tuple[int, int, int, int], dict[str, Any]]] = {}

    def _path(self, slot: str) -> str:
        path = self._paths.get(slot)
        if path is None:
            path = self._paths[slot] = os.fspath(self.store.slot_dir(slot) / self.name)
        return path

    def _stamp(self, slot: str) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self._path(slot))  # noqa: PTH116  (a str path: no Path per look)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def read(self, slot: str) -> dict[str, Any] | None:
        """The record as on disk now (not to be mutated: it may be the one kept)."""
        stamp = self._stamp(slot)
        known = self._known.get(slot)
        if known is not None and known[0] == stamp:
            return known[1]
        self._known.pop(slot, None)
        record = self.store.read_aux(slot, self.name) if stamp is not None else None
        if stamp is not None and record is not None:
            self._known[slot] = (stamp, record)  # read after the stat: newer costs a re-read
        return record

    def write(self, slot: str, record: dict[str, Any]) -> None:
        self._known.pop(slot, None)
        self.store.write_aux(slot, self.name, record, durable=RECORD_DURABLE)
        stamp = self._stamp(slot)
        if stamp is not None:
            self._known[slot] = (stamp, record)

    def delete(self, slot: str) -> None:
        self._known.pop(slot, None)
        self.store.delete_aux(slot, self.name)
