"""Pulling: a load's model files fetched and verified before its server starts (SPEC §10).

A part of the manager (:mod:`controller.slots`), below :mod:`.loading` and
:mod:`.admission` (which ask it) and over the model-files engine, the core's ``files`` seam
(:class:`~controller.modelfiles.pull.ModelFiles`, built by the composition root; None where
this controller manages no model files). A load whose files are absent (or declared with a
``sha256`` not verified yet) goes ``offline → pulling → starting``:

* **admission's disk half** (:meth:`Pulling.admit`, before memory is admitted): a missing
  file no source can pull is refused (``model.file_missing``), and a pull that does not fit
  the models dir's free space is refused (``model.insufficient_disk``, needed and free
  bytes) — typed refusals, no transition, not a byte written;
* **the pull** (:meth:`Pulling.fetch`, while the slot is ``pulling``; then the runtime's
  own, :meth:`Pulling.prepare`: an image, the kubernetes runtime's pod pull): the engine's
  ``ensure`` (joined with any pull of the same files: two slots, one download), its
  progress a ``progress`` event each time the engine publishes (its interval throttles
  them) and the slot's view (:attr:`~.flight.LoadFlight.pull_progress`); a failure is the
  engine's typed error, which the load turns into ``error`` under the crash-loop breaker;
  an unload or a removal stops the pull (:meth:`~.flight.LoadFlight.stop_pull`): this
  slot leaves it, and the engine cancels it when nobody else waits for it;
* **use** (:meth:`Pulling.used`): a server started on the files marks them used (the GC's
  least-recently-used order); **references** (:meth:`Pulling.references`): the declared
  models' files, a pinned slot's pinned, which a GC never removes;
* **the dry run** (:meth:`Pulling.explain`): "would pull 4.1 GB from hf://…", or the
  refusal the load would meet.

The engine is imported by the composition root only (its hub client on first use): this
module names its types for the type checker alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from controller.model.errors import ModelPullFailed, SlotctlError
from controller.model.events import EventKind, Op
from controller.modelfiles.gc import Reference
from controller.modelfiles.progress import PullProgress, progress_words
from controller.runtime.base import LaunchSpec, ProgressCallback
from controller.slots.core import Core, Part
from controller.slots.dryrun import LoadPlan, PlanPull, Refusal
from controller.slots.records import SlotRecord
from controller.spec.schema import ModelSpec

if TYPE_CHECKING:
    from controller.modelfiles.pull import ModelFiles

__all__ = ["Pulling"]


class Pulling(Part):
    def __init__(self, core: Core) -> None:
        super().__init__(core)

    @property
    def files(self) -> ModelFiles | None:
        return self.core.files

    def _start_files(self, slot: SlotRecord) -> list[ModelSpec]:
        """The files of the adapters a start-time engine is started with (its launch names
        them: they must be on disk before it starts)."""
        adapters = self.core.adapters
        return [adapters[a].as_model() for a in slot.spec.adapters if a in adapters]

    def needed(self, slot: SlotRecord) -> bool:
        """A load of ``slot`` passes through ``pulling`` for its model files (and its
        start-time adapters'): a stat and a record lookup, no network."""
        files = self.files
        if files is None:
            return False
        wanted = [slot.model] if slot.model is not None else []
        return any(files.needs_pull(m) for m in [*wanted, *self._start_files(slot)])

    async def admit(self, slot: SlotRecord) -> None:
        """The disk half of a load's admission, before its memory is (see the module):
        raises the typed refusal (said once, no transition) or returns."""
        files = self.files
        if files is None or slot.model is None or not files.needs_pull(slot.model):
            return
        plan = await files.plan(slot.model)
        refusal = await files.refusal(plan)
        if refusal is not None:
            raise self.table.refuse(slot, Op.LOAD, refusal)

    async def fetch(self, slot: SlotRecord) -> str | None:
        """Pull ``slot``'s model files (the slot is ``pulling``); None once they are on
        disk and verified, or why the pull was stopped (an unload, a removal). Raises the
        engine's typed error when the pull fails."""
        files, model = self.files, slot.model
        if files is None or model is None:
            return None
        flight = slot.flight

        def progressed(progress: PullProgress) -> None:
            if flight.pull_task is None:
                return  # the pull ended for this load: a late snapshot says nothing new
            flight.progressed(progress)
            self.events.emit(
                EventKind.PROGRESS,
                Op.LOAD,
                slot=slot.name,
                model=model.id,
                message=progress_words(progress),
                details=progress.details(),
            )

        try:
            stopped = await self._stoppable(slot, files.ensure(model, on_progress=progressed))
            for adapter in self._start_files(slot) if stopped is None else []:
                stopped = await self._stoppable(slot, files.ensure(adapter))
                if stopped is not None:
                    break
            return stopped
        except SlotctlError:
            raise
        except Exception as error:  # not the engine's typed error: a bug, said as a failed pull
            raise ModelPullFailed(
                f"model {model.id}: the pull failed: {type(error).__name__}: {error}",
                source=model.source or "",
                reason="internal",
            ) from error

    async def prepare(
        self, slot: SlotRecord, launch: LaunchSpec, progress: ProgressCallback
    ) -> str | None:
        """The runtime's own fetching for ``launch`` (an image; on the kubernetes runtime
        the pod's model pull), stoppable as :meth:`fetch` is; None once done, else why
        it was stopped. Raises the runtime's typed error."""
        return await self._stoppable(slot, self.runtime.prepare(launch, progress))

    @staticmethod
    async def _stoppable(slot: SlotRecord, work: Coroutine[Any, Any, Any]) -> str | None:
        """Run ``work`` as the load's pull: an unload or a removal stops it
        (:meth:`~.flight.LoadFlight.stop_pull`: None when it ran to its end, else why it
        was stopped); its failure is raised; the load's own cancellation cancels it."""
        flight = slot.flight
        task = asyncio.ensure_future(work)
        flight.pulling(task)
        try:
            await asyncio.wait({task})  # its outcome read below, whatever it is
        except asyncio.CancelledError:  # the load itself is cancelled (shutdown, removal)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise
        finally:
            flight.pulled()
        if task.cancelled():
            return flight.pull_stopped or "the pull was cancelled"
        error = task.exception()
        if error is not None:
            raise error
        return None

    def used(self, slot: SlotRecord) -> None:
        """A server started on ``slot``'s model files: they were used now."""
        files = self.files
        if files is not None and slot.model is not None:
            files.mark_used(slot.model)

    def references(self) -> list[Reference]:
        """What a GC of the models dir keeps: every declared model's files, pinned when a
        pinned slot serves the model."""
        files = self.files
        if files is None:
            return []
        pinned = {s.model_id for s in self.table if s.spec.pinned and s.model_id}
        out = []
        for model in self.table.models.values():
            want = files.wanted(model)
            if want is not None:
                out.append(Reference(want.dest, model.id, pinned=model.id in pinned))
        for adapter in self.core.adapters.values():  # (controller/slots/adapters.py)
            want = files.wanted(adapter.as_model())
            if want is not None:
                out.append(Reference(want.dest, adapter.id, pinned=adapter.pinned))
        return out

    async def explain(self, slot: SlotRecord, plan: LoadPlan) -> LoadPlan:
        """``plan`` (a load's dry run) with its pull: what it would fetch, or the refusal
        the load would meet for its files (which then is the plan's)."""
        files = self.files
        if files is None or slot.model is None or plan.action == "none":
            return plan
        if not files.needs_pull(slot.model):
            return plan
        pull = await files.plan(slot.model)
        step = PlanPull(
            action=pull.action,
            source=pull.source,
            path=str(pull.path) if pull.path is not None else None,
            bytes=pull.bytes,
            bytes_total=pull.bytes_total,
            message=pull.message,
            error=dict(pull.error) if pull.error is not None else None,
            in_flight=pull.in_flight,
        )
        refusal = await files.refusal(pull)
        if refusal is not None and plan.action != "refuse":
            return replace(plan, action="refuse", refusal=Refusal(refusal), pull=step)
        return replace(plan, pull=step)
