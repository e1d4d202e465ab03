"""Liveness of loaded slots (issue 26): a hung server is found while it serves too, only
silence counts, and every lease ends before the (slow) stop of the hung server.

FakeRuntime and FakeProber (``liveness_down``: the server sends no byte), a fake clock.
The real probe's HTTP is ``tests/integration/test_probe_http.py``; a real stopped server
end to end, ``tests/e2e/test_hung_server.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controller.model.errors import SlotHealthFailed
from controller.model.lifecycle import SlotState
from controller.probes.readiness import ProbeOutcome, ProbeResult, ProbeSpec
from tests.unit.manager_fixtures import (
    Harness,
    YieldingProber,
    assert_legal_history,
    desired,
    model_spec,
    slot_spec,
)

S = SlotState


async def test_a_serving_slot_whose_server_hangs_is_failed_and_its_leases_revoked(
    tmp_path: Path,
) -> None:
    """Before: liveness skipped ``serving`` slots, so a server that hung mid-request kept
    its slot ``serving`` (and its leases) for ever."""
    h = Harness(tmp_path)
    spec = slot_spec("a", liveness_interval_s=15, liveness_failures=2)
    await h.manager.set_desired(desired([spec], [model_spec("a-m")]))
    m = h.manager
    await m.load("a")
    leases = [await m.acquire("a") for _ in range(2)]
    assert m.view("a").state is S.SERVING
    h.prober.liveness_down.add("a")
    h.clock.advance(15)
    await m.tick()
    assert m.view("a").state is S.SERVING  # one miss of two
    h.clock.advance(15)
    await m.tick()
    view = m.view("a")
    assert view.state is S.ERROR and view.leases == 0
    assert "the server is hung" in view.message
    assert view.failures == 1  # the breaker counts it, as a crash
    assert h.runtime.stops["a"] == 1
    for lease in leases:
        assert lease.lost.is_set()
        with pytest.raises(SlotHealthFailed, match="liveness probe failed 2 times"):
            lease.check()
        m.release(lease)  # the router's release of a revoked lease changes nothing
    assert m.view("a").state is S.ERROR
    assert_legal_history(m.transitions)


async def test_only_silence_is_a_miss(tmp_path: Path) -> None:
    """A server that answers, even with a 503 (busy, or no free slot) or by refusing, is
    not hung: such answers never count. Before: every non-ready answer was a miss, so a
    busy server was killed after ``liveness_failures`` of them."""
    h = Harness(tmp_path)
    spec = slot_spec("a", liveness_interval_s=15, liveness_failures=2)
    await h.manager.set_desired(desired([spec], [model_spec("a-m")]))
    m = h.manager
    await m.load("a")
    h.runtime.script("a", outcome="hang")  # its probes now answer 503 ("loading")
    assert h.runtime.probe("a").outcome is ProbeOutcome.STILL_WARMING
    for _ in range(5):
        h.clock.advance(15)
        await m.tick()
    assert m.view("a").state is S.READY
    assert h.runtime.stops.get("a", 0) == 0
    h.prober.liveness_down.add("a")  # silence from now on: two misses end it
    for _ in range(2):
        h.clock.advance(15)
        await m.tick()
    assert m.view("a").state is S.ERROR


class Overlapping(YieldingProber):
    """Counts the liveness probes in flight at once (each takes a few loop turns) and
    records the timeout each was asked with."""

    in_flight = most = 0
    asked: list[tuple[str, float | None]]

    async def liveness(
        self, endpoint: str, spec: ProbeSpec, *, slot: str, timeout_s: float | None = None
    ) -> ProbeResult:
        self.asked.append((slot, timeout_s))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            for _ in range(5):
                await asyncio.sleep(0)
            return await super().liveness(endpoint, spec, slot=slot, timeout_s=timeout_s)
        finally:
            self.in_flight -= 1


async def test_due_probes_run_at_once_and_each_slot_has_its_own_timeout(
    tmp_path: Path,
) -> None:
    """A silent server costs the tick one ``liveness_timeout_s``, not one per slot: the
    due probes are awaited together; each is asked with its slot's timeout."""
    h = Harness(tmp_path)
    prober = h.prober = Overlapping(h.runtime)
    prober.asked = []
    m = h.manager = h.new_manager()
    specs = [
        slot_spec(name, liveness_interval_s=15, liveness_timeout_s=timeout)
        for name, timeout in (("a", 1), ("b", 2))
    ]
    await m.set_desired(desired(specs, [model_spec("a-m"), model_spec("b-m")]))
    for name in ("a", "b"):
        await m.load(name)
    h.clock.advance(15)
    await m.tick()
    assert prober.most == 2
    assert sorted(prober.asked) == [("a", 1.0), ("b", 2.0)]
