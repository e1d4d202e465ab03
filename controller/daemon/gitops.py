"""GitOps mode of ``slotctl up STACK_DIR``: validate the stack dir and apply it.

Every save is validated with the loader; an invalid stack dir changes nothing (the last
good desired state stays) and says where it is wrong, and the next valid save says so.
A valid one is applied with ``prune`` (the stacks it ever declared are its own: their
undeclared slots go) through the guard (``controller.reconcile.apply.apply_to_config``), except
pinned slots, which are kept with a warning. Parsing and writes block: they run in a
worker thread, one apply at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from controller.model.errors import SlotctlError
from controller.reconcile.apply import apply_to_config, pruned_pinned
from controller.spec.configdir import read_settings
from controller.spec.desired import DesiredCache
from controller.spec.loader import DesiredState, load_stacks

__all__ = ["GitOps"]


class GitOps:
    """Applies one stack dir to one config dir; see the module docstring."""

    def __init__(
        self,
        stack_dir: Path,
        config_dir: Path,
        say: Callable[[str], None],
        *,
        desired: DesiredCache | None = None,
    ) -> None:
        self.stack_dir = stack_dir
        self.config_dir = config_dir
        self.desired = desired if desired is not None else DesiredCache(config_dir)
        self.say = say
        # The stacks the dir declares (ever, this run): the API refuses writes to them.
        self.stacks: set[str] = set()
        self._invalid = False
        self._lock = asyncio.Lock()

    def apply(self) -> bool:
        """Validate the stack dir and apply it; an invalid one changes nothing."""
        settings, _ = read_settings(self.config_dir)
        report = load_stacks([self.stack_dir], settings)
        if not report.ok or report.state is None:
            for p in report.errors:  # with its hint, as `stack validate` says it
                hint = f" ({p.hint})" if p.hint else ""
                self.say(f"invalid {p.where()}: [{p.code}] {p.message}{hint}")
            self.say("stack dir is invalid: nothing changed, the last good desired state stays")
            self._invalid = True
            return False
        if self._invalid:
            self._invalid = False
            self.say(f"stack dir {self.stack_dir} is valid again")
        for p in report.warnings:
            hint = f" ({p.hint})" if p.hint else ""
            self.say(f"warning {p.where()}: [{p.code}] {p.message}{hint}")
        self.stacks.update(report.state.stacks)
        state = DesiredState(
            stacks=tuple(sorted(self.stacks)),
            models=report.state.models,
            slots=report.state.slots,
            aliases=report.state.aliases,
            adapters=report.state.adapters,
            model_stacks=report.state.model_stacks,
        )
        snapshot = self.desired.read_fresh()  # the disk as it is now, before writing
        for name in pruned_pinned(state, snapshot):
            self.say(
                f"warning: pinned slot {name} is no longer in {self.stack_dir}: kept (remove "
                f"it with `slotctl stack apply {self.stack_dir} --prune --force`)"
            )
        try:
            changed = apply_to_config(
                state, self.config_dir, prune=True, snapshot=snapshot, keep_pinned=True
            )
        except SlotctlError as exc:  # a refused write: report it, keep the last good state
            self.say(f"apply failed: [{exc.code}] {exc.message}")
            return False
        except OSError as exc:  # the config dir refuses writes (full, read-only)
            self.say(f"apply failed: cannot write the config dir: {exc}")
            return False
        if changed:
            self.say(f"applied {self.stack_dir}: {', '.join(changed)}")
        return True

    async def apply_off_loop(self) -> bool:
        """:meth:`apply` in a worker thread (parsing and writes block), one at a time."""
        async with self._lock:
            return await asyncio.to_thread(self.apply)
