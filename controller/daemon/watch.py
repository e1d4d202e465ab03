"""Following the config dir (and, in GitOps mode, the stack dir) with watchfiles.

A change under the config dir re-reads it (the reconciler follows); a change under the
stack dir re-applies it first (``daemon.gitops``). A watch follows a directory's inode:
a directory deleted, replaced (``rm -rf`` and re-create, ``git clone``, a rename over
it) or missing is noticed within :data:`ROOT_CHECK_MS`, said in the log, and watched
again once it exists; then everything is re-read, since changes may have been missed
meanwhile (in GitOps mode the stack dir is re-applied, which also rebuilds a deleted
config dir).
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import watchfiles

__all__ = ["ROOT_CHECK_MS", "DirWatcher"]

ROOT_CHECK_MS = 500  # how often the watcher checks that its directories are still the same
# How often watchfiles' thread wakes to look for a batch that settled (and for stop): each
# wake takes the GIL from the event loop, which under router load costs both threads a
# forced switch; 25 ms keeps a save's pickup well under 0.1 s at 40 wakes a second.
WATCH_STEP_MS = 25
_IGNORED = (".slotctl.lock", "residency.json", ".tmp")


class DirWatcher:
    """Watches the config dir and the stack dir until ``stop``; see the module docstring.

    ``refresh`` re-reads the config dir; ``apply_stack_dir`` (GitOps mode only)
    re-applies the stack dir. Both are attributes, called on every change.
    """

    def __init__(
        self,
        config_dir: Path,
        stack_dir: Path | None,
        *,
        stop: asyncio.Event,
        say: Callable[[str], None],
        refresh: Callable[[], Awaitable[None]],
        apply_stack_dir: Callable[[], Awaitable[bool]] | None = None,
        debounce_ms: int = 50,
    ) -> None:
        self.config_dir = config_dir
        self.stack_dir = stack_dir
        self.stop = stop
        self.say = say
        self.refresh = refresh
        self.apply_stack_dir = apply_stack_dir
        self.debounce_ms = debounce_ms
        self.runs = 0

    def roots(self) -> dict[str, Path]:
        roots = {"config dir": self.config_dir}
        if self.stack_dir is not None:
            roots["stack dir"] = self.stack_dir
        return roots

    async def run(self) -> None:
        """Follow the directories until shutdown (a restart after a failure re-reads all)."""
        self.runs += 1
        rebuild = self.runs > 1  # restarted after a failure: changes may be missed
        while not self.stop.is_set():
            roots = self.roots()
            seen = {what: _identity(path) for what, path in roots.items()}
            present = [roots[what] for what, ident in seen.items() if ident is not None]
            if not present:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), ROOT_CHECK_MS / 1000)
                rebuild = self._roots_changed(seen) or rebuild
                continue
            # The re-read happens once the new watch runs (its first batch, at most
            # ROOT_CHECK_MS in): a change made before it is read, one made after it is
            # a change of the new watch; none falls between the two.
            async for changes in watchfiles.awatch(
                *present,
                stop_event=self.stop,
                debounce=self.debounce_ms,
                step=WATCH_STEP_MS,
                watch_filter=_relevant,
                rust_timeout=ROOT_CHECK_MS,
                yield_on_timeout=True,
            ):
                if rebuild:
                    rebuild = False
                    await self._rebuild()
                if changes:
                    await self._on_changes(changes)
                if self._roots_changed(seen, self._roots_deleted(changes)):
                    rebuild = True
                    break

    def _roots_deleted(self, changes: set[tuple[watchfiles.Change, str]]) -> set[str]:
        """The watched directories whose own deletion is among ``changes``.

        A directory deleted and re-created at once may get the same inode number back, so
        its identity alone cannot tell; its watch, though, died with the old one.
        """
        deleted = {Path(p).absolute() for c, p in changes if c == watchfiles.Change.deleted}
        return {what for what, path in self.roots().items() if path.absolute() in deleted}

    def _roots_changed(
        self, seen: dict[str, tuple[int, int] | None], deleted: set[str] | None = None
    ) -> bool:
        """Whether a watched directory appeared, vanished or was replaced; says which."""
        changed = False
        for what, path in self.roots().items():
            now = _identity(path)
            if now == seen.get(what) and what not in (deleted or ()):
                continue
            changed = True
            if now is None:
                tail = "nothing changes: the last good desired state stays"
                if what == "config dir" and self.stack_dir is not None:
                    tail += "; re-applying the stack dir to rebuild it"
                self.say(f"{what} {path} is gone or not a directory: {tail}")
            else:
                self.say(f"{what} {path} was re-created or replaced: watching the new one")
        return changed

    async def _rebuild(self) -> None:
        stack_dir = self.stack_dir
        if self.apply_stack_dir is not None and stack_dir and _identity(stack_dir) is not None:
            await self.apply_stack_dir()
        await self.refresh()

    async def _on_changes(self, changes: set[tuple[watchfiles.Change, str]]) -> None:
        stack_dir = self.stack_dir
        if stack_dir is not None and self.apply_stack_dir is not None:
            roots = {stack_dir.absolute()}
            with contextlib.suppress(OSError, RuntimeError):  # a loop, a vanished dir
                roots.add(stack_dir.resolve())
            # Never resolve() a changed path: a symlink loop there would raise.
            touched = [Path(p).absolute() for _, p in changes]
            if any(t in roots or roots & set(t.parents) for t in touched):
                await self.apply_stack_dir()
        await self.refresh()


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a directory, None when it is missing or not a directory."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _relevant(change: watchfiles.Change, path: str) -> bool:
    name = Path(path).name
    return not any(name.endswith(s) or name == s for s in _IGNORED) and not name.startswith(".")
