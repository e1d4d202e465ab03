"""The operator's InferencePools (``--inference-pools``, the chart's
``inferencePool.enabled``): after every change on the status board, one pool per model
with the pods of its Ready slots, written by the kubernetes runtime
(:class:`~controller.runtime.kubernetes.pools.InferencePools`).

A part of :mod:`controller.operator.run`: it reads the manager's views (a slot is Ready as
its ``Ready`` condition is: ``dispatchable``) and the ports, and hands the pools' wants to
the runtime, which sends only what changed; a burst of events is one pass
(:data:`GAP_S`), a failed pass is tried again at the next change or after
:data:`RETRY_S`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from typing import Final

import httpx2

from controller.model.errors import SlotctlError
from controller.operator.board import StatusBoard
from controller.runtime.kubernetes.pools import InferencePools
from controller.runtime.kubernetes.poolspec import PoolWant, SlotFacts, wanted_pools
from controller.slots.manager import SlotManager

__all__ = ["PoolSync"]

log = logging.getLogger("slotctl.operator")

GAP_S: Final = 0.2  # a burst of events, one pass
RETRY_S: Final = 5.0  # a failed pass: again this soon, change or not


class PoolSync:
    """Slots' readiness -> the runtime's InferencePools (see the module docstring)."""

    def __init__(self, manager: SlotManager, board: StatusBoard, pools: InferencePools) -> None:
        self.manager = manager
        self.board = board
        self.pools = pools
        self.passes = 0

    def wants(self) -> dict[str, PoolWant]:
        facts = []
        for view in self.manager.views():
            try:
                port = self.manager.port(view.name)
            except SlotctlError:
                continue  # gone meanwhile
            facts.append(SlotFacts(view.name, view.model_id, port, view.dispatchable))
        return wanted_pools(facts)

    async def run(self, resync_s: float) -> None:
        seen: Hashable = None
        failed = False
        while True:
            try:
                await self.pools.keep(self.wants())
                failed = False
            except (SlotctlError, httpx2.HTTPError, OSError) as exc:
                if not failed:
                    log.warning("inference pools: %s (tried again)", exc)
                failed = True
            self.passes += 1
            seen = await self.board.wait(seen, RETRY_S if failed else resync_s)
            await asyncio.sleep(GAP_S)
