"""Sizing: a slot's footprint estimated from its model file, and learnt from what ran.

A part of the manager (:mod:`controller.slots`), below :mod:`.loading` and
:mod:`.admission` (issue 36, docs/design/0022-footprints.md):

* :meth:`Sizing.estimate` reads the header of the file the slot's launch names (a GGUF,
  a safetensors repository: :mod:`controller.modelfiles.headers`, in a worker thread) and
  sizes its server by the launch's own argv (:mod:`controller.scheduling.footprint`);
  the record takes it (:meth:`~.table.SlotTable.sized`), and a slot without a declared
  ``memory_gb`` is admitted by it. Before a load, again once its files are pulled, in the
  dry run and ``slotctl model footprint``.
* :meth:`Sizing.observe` measures the running server (its process tree's RSS; NVML's
  per-process figure on a GPU: :mod:`controller.probes.usage`) at ready and while it
  serves (the housekeeping's liveness cadence); the peak is kept per model and launch
  config in ``state.json`` (:meth:`~.table.SlotTable.observed`) and admission counts the
  larger of it and the estimate. A declared ``memory_gb`` below what was seen is warned
  about once, with both figures.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from controller.model.errors import SlotctlError
from controller.model.events import EventKind, Op
from controller.model.sizes import format_gib
from controller.model.weights import GgufModel
from controller.modelfiles.headers import HeaderError, read_model
from controller.runtime.base import RuntimeKind
from controller.scheduling.footprint import estimate_gguf, estimate_safetensors, launch_facts
from controller.slots.core import Part
from controller.slots.records import Sizing as SizingFacts
from controller.slots.records import SlotRecord

__all__ = ["Sizing"]

log = logging.getLogger("slotctl.manager")

# Engines that size themselves to the share they are given (vLLM: its KV blocks fill
# --gpu-memory-utilization): what they were seen to hold is that share, not a need.
SELF_SIZING: frozenset[str] = frozenset({"vllm"})


class Sizing(Part):
    async def estimate(self, slot: SlotRecord) -> SizingFacts | None:
        """Estimate ``slot``'s footprint now and record it (None: no model bound)."""
        model = slot.model
        if model is None:
            self.table.sized(slot, None)
            return None
        provider = slot.spec.provider
        learns = provider not in SELF_SIZING
        try:
            launch = self.core.build_launch(slot)
            config_hash = self.core.launch_hash(slot)
        except SlotctlError as exc:
            facts = SizingFacts(model.id, None, None, f"no launch: {exc}", learns)
            self.table.sized(slot, facts)
            return facts
        path = launch.model_path
        why: str | None = None
        estimate = None
        if not path:
            why = "no model file to read (demo:// or no source)"
        else:
            try:
                read = await asyncio.to_thread(read_model, Path(path))
            except (HeaderError, OSError) as exc:
                read, why = None, f"its header cannot be read: {exc}"
            if read is None and why is None:
                why = (
                    "not on disk yet (estimated once pulled)"
                    if not Path(path).exists()
                    else "not a GGUF file or a safetensors repository"
                )
            if read is not None:
                argv = launch.placed_on(slot.placement).run_argv
                facts_of_launch = launch_facts(provider, slot.spec.device_kind, argv)
                if isinstance(read, GgufModel):
                    estimate = estimate_gguf(read, facts_of_launch)
                else:
                    estimate = estimate_safetensors(read, facts_of_launch)
        facts = SizingFacts(model.id, config_hash, estimate, why, learns)
        self.table.sized(slot, facts)
        return facts

    async def observe(self, slot: SlotRecord) -> None:
        """Measure ``slot``'s running server once and keep its peak (see the module)."""
        server = slot.server
        if server is None or slot.asleep or self.runtime.kind is not RuntimeKind.PROCESS:
            return  # a container's or a pod's figures are not read here (not host pids)
        try:
            seen = await self.runtime.inspect(slot.name)
        except SlotctlError:
            return
        ident = seen.ident
        if not seen.running or not ident or not ident.isdigit():
            return
        gpus = tuple(g.index for g in slot.placement)
        usage = await asyncio.to_thread(
            self.core.usage.measure, int(ident), slot.spec.device_kind, gpus
        )
        if usage is None or slot.server is not server:
            return
        kept = self.table.observed(
            slot, server.config_hash, usage.device_bytes, usage.host_bytes, usage.source
        )
        declared = slot.declared_bytes
        if declared is not None and 0 < declared < kept.device_bytes:
            key = f"declared-below-seen:{slot.model_id}:{server.config_hash}"
            if not self.table.warned(slot, key):
                message = (
                    f"slot {slot.name}: memory_gb declares {format_gib(declared)} but its "
                    f"server was seen using {format_gib(kept.device_bytes)} on "
                    f"{slot.spec.device_kind} ({usage.source}); admission counts the declared "
                    "figure: raise memory_gb, or remove it to admit by what was seen"
                )
                log.warning("%s", message)
                self.events.emit(
                    EventKind.ADMISSION,
                    Op.ADMIT,
                    slot=slot.name,
                    model=slot.model_id,
                    message=message,
                    details={"declared_bytes": declared, "seen_bytes": kept.device_bytes},
                )
