"""The one admit loop (docs/design/0016): how many times a walk decides, and what it keeps.

Every walk that needs memory — a cold load, a wake, a pod that landed elsewhere — goes
through :meth:`controller.slots.admission.Admission.admit`: decide, make room (exclusive
peers out, victims evicted), decide again, reserve. The walks of ``bench/admit_walk.py``
are counted here: the pure ``decide_load`` runs once for a load that fits, once more for
each kind of room it has to make (before the loop: a wake decided twice when it fit and
three times when it evicted; a victim spared by a request cost a third decision).
SPEC §6's semantics are the other tests' (test_residency, test_sleep_tier, test_multigpu,
test_manager_statemachine); these check the counts, and that a refused walk changes
nothing however many rounds it had.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.admit_walk import WALKS, Counting
from controller.model.errors import InsufficientMemory, SlotPinned
from controller.model.lifecycle import SlotState
from tests.unit.manager_fixtures import Harness, desired, model_spec, settle, slot_spec

S = SlotState

DECISIONS = {
    "cold load, fits": 1,
    "cold load, evicts one": 2,  # decide, evict, decide again (evicting nothing)
    "cold load, group swap": 2,  # decide, the peer unloaded, decide again
    "cold load, swap and evict": 3,  # decide, peer out, decide, evict, decide again
    "wake, fits": 1,
    "wake, evicts one (sleeps)": 2,
    "wake, evicts one (unloads)": 2,
    "request, cold load": 1,
}


@pytest.mark.parametrize("walk", list(DECISIONS))
async def test_each_walk_decides_once_per_round_of_room_made(tmp_path: Path, walk: str) -> None:
    manager, act = await WALKS[walk](tmp_path)
    with Counting(profile=False) as counting:
        await act()
        await settle(manager)
    assert manager.view(walk_target(walk)).dispatchable
    assert counting.decisions == DECISIONS[walk]
    await manager.close()


def walk_target(walk: str) -> str:
    return "a" if walk.startswith(("wake", "cold load, fits", "request")) else "b"


async def test_a_victim_spared_by_a_request_refuses_in_two_decisions(tmp_path: Path) -> None:
    """Revalidated before it goes: the request since spares the victim; the decision
    after the evictions evicts nothing more and refuses (it was three decisions)."""
    h = Harness(tmp_path, budget_gb=8)
    m = h.manager
    slots = [slot_spec("v1", priority=10), slot_spec("v2", priority=20), slot_spec("new")]
    models = [model_spec("v1-m", 4), model_spec("v2-m", 4), model_spec("new-m", 8)]
    await m.set_desired(desired(slots, models))
    await m.load("v1")
    await m.load("v2")
    h.clock.advance(100)
    h.runtime.turns = 2  # stopping v1 yields: a request for v2 lands meanwhile
    with Counting(profile=False) as counting:
        load = asyncio.create_task(m.load("new"))
        while m.view("v1").state is not S.UNLOADING:
            await asyncio.sleep(0)
        lease = await m.acquire("v2")
        with pytest.raises(InsufficientMemory):
            await load
    assert counting.decisions == 2
    assert m.view("v2").state is S.SERVING and m.view("new").state is S.OFFLINE
    m.release(lease)
    await m.close()


async def test_a_refused_swap_unloads_no_peer_and_decides_once(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    m = h.manager
    slots = [slot_spec("a", pinned=True), slot_spec("b")]
    models = [model_spec("a-m", 4, group="g"), model_spec("b-m", 4, group="g")]
    await m.set_desired(desired(slots, models))
    await m.load("a")
    transitions = len(m.transitions)
    with Counting(profile=False) as counting, pytest.raises(SlotPinned):
        await m.load("b")
    assert counting.decisions == 1
    assert m.view("a").state is S.READY and len(m.transitions) == transitions
    await m.close()
