"""The operator's shared judging of every CR, paced by what it costs (issue 28).

At 1,000 Slots one judging costs ~0.1-0.2 s; a burst of creates (one ``kubectl apply``)
asked for one every 50 ms, so judging took most of the event loop while the loads and the
status writes waited. :class:`SyncPacer` spaces them by their cost while CRs keep coming.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from controller.operator.run import (
    SYNC_BATCH_S,
    SYNC_GAP_MAX_S,
    SYNC_SPACING,
    Operator,
    SyncPacer,
)


def test_a_quiet_operator_judges_after_the_batch_window() -> None:
    pacer = SyncPacer()
    assert pacer.delay(100.0) == SYNC_BATCH_S
    pacer.took(100.0, 100.002)  # a cheap judging
    assert pacer.delay(100.01) == SYNC_BATCH_S
    pacer.took(200.0, 200.1)
    assert pacer.delay(300.0) == SYNC_BATCH_S  # long after the last one


def test_a_costly_judging_spaces_the_next_by_its_cost() -> None:
    pacer = SyncPacer()
    pacer.took(10.0, 10.1)  # 0.1 s
    assert pacer.delay(10.1) == pytest.approx(SYNC_SPACING * 0.1)
    assert pacer.delay(10.3) == pytest.approx(SYNC_SPACING * 0.1 - 0.2)
    pacer.took(20.0, 22.0)  # 2 s: the gap is capped
    assert pacer.delay(22.0) == pytest.approx(SYNC_GAP_MAX_S)


class _Judge:
    """What :meth:`Operator._sync_soon` uses of the operator, with a judging that costs
    ``cost`` seconds of the loop and records the indexes it saw."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self._sync_indexes: Any = {}
        self._next_sync: Any = None
        self._pacer = SyncPacer()
        self.judged: list[tuple[float, int]] = []  # (when it started, the newest ask it saw)

    def _sync(self, indexes: Any) -> Any:
        self.judged.append((time.monotonic(), indexes["n"]))
        time.sleep(self.cost)  # holds the loop, as the real judging does
        return indexes["n"]


async def test_a_burst_of_asks_is_judged_a_few_times_each_ask_seeing_its_own_change() -> None:
    judge = _Judge(cost=0.1)
    asks: list[asyncio.Task[Any]] = []
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < 1.5:  # a CR created every 10 ms for 1.5 s
        n += 1
        asks.append(asyncio.ensure_future(Operator._sync_soon(judge, {"n": n})))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
    seen = await asyncio.gather(*asks)
    # every ask's judging saw the indexes of that ask or newer
    assert all(got >= i + 1 for i, got in enumerate(seen))
    # judged at most once per cost x (1 + spacing) (+ the first and the last), where a
    # fixed 50 ms window judged once per 0.15 s (10 or more times)
    assert len(judge.judged) <= 1.5 / (0.1 * (1 + SYNC_SPACING)) + 2, judge.judged
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(judge.judged)]
    assert all(g >= 0.1 * (1 + SYNC_SPACING) - 0.02 for g in gaps), gaps
