"""``SlotManager.stop_all`` at shutdown (issue 14): batch holds are released, not drained;
requests in flight are drained up to ``drain_timeout_s`` and reported through
``on_drain``; ``end_drains`` (a second Ctrl-C) revokes them at once. Also the view's hold
fields (``held_for_s``, ``holds``) that ``slot list`` shows as "held until"."""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.model.errors import SlotNotReady
from controller.model.lifecycle import SlotState
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec

S = SlotState


async def _harness(tmp: Path) -> Harness:
    h = Harness(tmp)
    slots = [slot_spec("held", drain_timeout_s=100), slot_spec("busy", drain_timeout_s=100)]
    await h.manager.set_desired(desired(slots, [model_spec("held-m"), model_spec("busy-m")]))
    return h


async def test_view_shows_holds_and_when_the_last_one_ends(tmp_path: Path) -> None:
    h = await _harness(tmp_path)
    m = h.manager
    await m.load("held")
    view = m.view("held")
    assert (view.held_for_s, view.holds) == (None, 0)
    await m.hold("held", 600)
    await m.hold("held", 3600)
    request = await m.acquire("held")
    view = m.view("held")
    assert (view.leases, view.holds, view.held_for_s) == (3, 2, 3600.0)
    h.clock.advance(100)
    assert m.view("held").held_for_s == 3500.0
    m.release(request)
    assert m.view("held").holds == 2


async def test_stop_all_releases_holds_and_drains_requests(tmp_path: Path) -> None:
    h = await _harness(tmp_path)
    m = h.manager
    await m.load("held")
    await m.load("busy")
    hold = await m.hold("held", 3600)
    request = await m.acquire("busy")
    told: list[tuple[str, int, float]] = []
    t0 = h.clock.now
    await m.stop_all(on_drain=lambda *args: told.append(args))
    assert told == [("busy", 1, 100.0)]  # the hold is not waited for
    assert hold.released and hold.error is None
    assert isinstance(request.error, SlotNotReady)  # revoked after the drain
    assert h.clock.now - t0 >= 100.0
    assert m.view("held").state is S.OFFLINE and m.view("busy").state is S.OFFLINE


async def test_end_drains_revokes_requests_at_once(tmp_path: Path) -> None:
    h = await _harness(tmp_path)
    m = h.manager
    await m.load("busy")
    request = await m.acquire("busy")
    t0 = h.clock.now
    stopping = asyncio.create_task(m.stop_all())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not stopping.done() and m.view("busy").state is S.SERVING  # draining
    m.end_drains()
    await stopping
    assert h.clock.now - t0 < 100.0
    assert request.lost.is_set() and isinstance(request.error, SlotNotReady)
    assert m.view("busy").state is S.OFFLINE


async def test_revoke_leases_ends_holds_and_requests_and_keeps_servers(tmp_path: Path) -> None:
    h = await _harness(tmp_path)
    m = h.manager
    await m.load("held")
    await m.load("busy")
    hold = await m.hold("held", 3600)
    request = await m.acquire("busy")
    assert m.revoke_leases("the controller stopped") == 2
    for lease in (hold, request):
        assert lease.lost.is_set() and isinstance(lease.error, SlotNotReady)
        assert "the controller stopped" in str(lease.error)
    for name in ("held", "busy"):  # still loaded, no lease left
        view = m.view(name)
        assert view.state is S.READY and view.leases == 0
    assert all(h.runtime.objects[n].exit_code is None for n in ("held", "busy"))
