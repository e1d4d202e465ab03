"""SPEC §3: observations (to ``warming``, ``ready``, ``idle``, the ``ready``↔``serving`` lease
flips) are coalesced and written off the loop, within ``LAG_WRITE_S``; every intent and
outcome (``pulling``, ``starting``, ``unloading``, ``offline``, ``error``, a placement, and
``idle -> serving``, which a refused write must refuse) is durable before the controller
acts on it.

A SlotManager on FakeRuntime + FakeClock with the real :class:`~controller.store.StateStore`
in a temp dir: the lag writer's worker thread really writes ``state.json``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.model.events import Event, EventKind, Op
from controller.model.lifecycle import SlotState
from controller.slots.manager import SlotManager
from controller.slots.table import LAG_WRITE_S, OBSERVED
from controller.store.state import SlotStateRecord
from tests.unit.manager_fixtures import (
    Harness,
    assert_legal_history,
    desired,
    model_spec,
    slot_spec,
)

S = SlotState


def on_disk(m: SlotManager, name: str) -> SlotState | None:
    record = m.store.read(name)
    return record.state if record else None


async def until(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class WriteLog:
    """Wraps the store's real ``write``: which thread wrote which state (optionally slow
    in the lag writer's thread)."""

    def __init__(self, m: SlotManager, *, slow_in_thread_s: float = 0.0) -> None:
        self.writes: list[tuple[str, SlotState, bool]] = []  # (slot, state, on the loop)
        self.in_thread = threading.Event()
        self._real = m.store.write
        self._slow = slow_in_thread_s
        self._loop_thread = threading.get_ident()
        m.store.write = self.write  # type: ignore[method-assign]

    def write(self, record: SlotStateRecord, *, durable: bool = True) -> None:
        on_loop = threading.get_ident() == self._loop_thread
        if not on_loop:
            self.in_thread.set()
            time.sleep(self._slow)
        self._real(record, durable=durable)
        self.writes.append((record.name, record.state, on_loop))


async def loaded(tmp_path: Path, *names: str) -> tuple[Harness, SlotManager]:
    """Loaded slots, their observed ``ready`` on disk (the lag writer done)."""
    h = Harness(tmp_path)
    slots = [slot_spec(n, idle_timeout_s=10) for n in names]
    await h.manager.set_desired(desired(slots, [model_spec(f"{n}-m", 1) for n in names]))
    for name in names:
        await h.manager.load(name)
    await until(lambda: not h.manager.core.table.unpersisted, "the ready observations on disk")
    return h, h.manager


async def test_a_lease_flip_writes_nothing_on_the_request_path(tmp_path: Path) -> None:
    _h, m = await loaded(tmp_path, "a")
    log = WriteLog(m)
    lease = await m.acquire("a")
    assert m.view("a").state is S.SERVING
    assert on_disk(m, "a") is S.READY  # not yet: the lag writer has it
    assert "a" in m.core.table.unpersisted
    await until(lambda: on_disk(m, "a") is S.SERVING, "the serving flip on disk")
    m.release(lease)
    assert m.view("a").state is S.READY and on_disk(m, "a") is S.SERVING
    await until(lambda: not m.core.table.unpersisted, "the lag writer to settle")
    assert on_disk(m, "a") is S.READY
    assert log.writes and not [w for w in log.writes if w[2]], "a flip was written on the loop"


async def test_flips_within_the_window_coalesce_into_one_write(tmp_path: Path) -> None:
    _h, m = await loaded(tmp_path, "a")
    log = WriteLog(m)
    for _ in range(200):
        m.release(await m.acquire("a"))
    await until(lambda: not m.core.table.unpersisted, "the lag writer to finish")
    assert on_disk(m, "a") is S.READY
    assert len(log.writes) <= 3, log.writes  # 400 flips, one lag window: one write or so
    assert sum(1 for t in m.transitions if t[0] == "a") >= 400  # every flip still an event


async def test_every_intent_and_outcome_is_on_disk_before_its_event(tmp_path: Path) -> None:
    """Load, go idle, a request on the idle slot (idle -> serving is durable), unload:
    when each intent's or outcome's event fires, ``state.json`` already says so (persist,
    then commit); the observations (warming, ready, idle, serving -> ready) reach it
    within the lag window, and never before their intent."""
    h = Harness(tmp_path)
    m = h.manager
    await m.set_desired(desired([slot_spec("a", idle_timeout_s=10)], [model_spec("a-m", 1)]))
    checked: list[tuple[str, str]] = []
    lagged: list[tuple[str, str]] = []

    def check(event: Event) -> None:
        if event.kind != EventKind.TRANSITION or event.slot != "a":
            return
        edge = (event.from_state or "", event.to_state or "")
        if SlotState(event.to_state) in OBSERVED and edge != ("idle", "serving"):
            lagged.append(edge)
        else:
            assert on_disk(m, "a") == SlotState(event.to_state), event
            checked.append(edge)

    m.events.add_listener(check)
    await m.load("a")
    assert on_disk(m, "a") in (S.STARTING, S.WARMING, S.READY)  # the intent, or later
    await until(lambda: on_disk(m, "a") is S.READY, "ready on disk", timeout=LAG_WRITE_S + 2)
    h.clock.advance(10)
    await m.tick()
    assert m.view("a").state is S.IDLE
    lease = await m.acquire("a")  # idle -> serving: durable
    m.release(lease)  # serving -> ready: coalesced
    await m.unload("a", force=True)
    assert ("offline", "starting") in checked and ("idle", "serving") in checked
    assert ("ready", "unloading") in checked and ("unloading", "offline") in checked
    assert ("starting", "warming") in lagged and ("warming", "ready") in lagged
    assert ("ready", "idle") in lagged and ("serving", "ready") in lagged
    assert on_disk(m, "a") is S.OFFLINE
    assert_legal_history(m.transitions)


async def test_a_late_lag_write_never_overwrites_a_durable_transition(tmp_path: Path) -> None:
    """The lag writer is mid-write (slow disk) when an unload starts: the unload's durable
    writes wait for it and land after it; a flip it snapshotted earlier is not written."""
    _h, m = await loaded(tmp_path, "a", "b")
    log = WriteLog(m, slow_in_thread_s=0.3)
    lease_a, lease_b = await m.acquire("a"), await m.acquire("b")
    await asyncio.to_thread(log.in_thread.wait, 5)  # the lag writer is writing a's flip
    m.release(lease_b)  # b's record in that batch is now stale (serving; memory: ready)
    await m.unload("b", force=True)  # durable: ready -> unloading -> offline
    assert on_disk(m, "b") is S.OFFLINE
    await until(lambda: not m.core.table.unpersisted - {"a"}, "the lag writer's batch")
    await asyncio.sleep(0.4)  # any stale write of b would have landed by now
    assert on_disk(m, "b") is S.OFFLINE
    assert ("b", S.SERVING, False) not in log.writes[log.writes.index(("b", S.OFFLINE, True)) :]
    m.release(lease_a)
    await until(lambda: on_disk(m, "a") is S.READY, "a's last flip")


async def test_a_crash_while_a_flip_is_pending_recovers_as_ready(tmp_path: Path) -> None:
    """The controller dies with a request in flight, its flip to serving not written yet
    (state.json: ready) — or written (state.json: serving). Either way the next one
    adopts the running server as ``ready``, on disk too, with no new start."""
    h, m = await loaded(tmp_path, "a", "b")
    await m.acquire("b")
    await until(lambda: on_disk(m, "b") is S.SERVING, "b's flip on disk")
    await m.acquire("a")  # pending: never written (the crash comes first)
    writer = m.core.table._writer
    assert writer is not None
    writer.cancel()  # the crash: the lag writer dies with the process
    await asyncio.sleep(0.2)
    assert on_disk(m, "a") is S.READY and m.view("a").state is S.SERVING
    starts = dict(h.runtime.starts)

    m2 = h.new_manager()
    await m2.set_desired(
        desired(
            [slot_spec(n, idle_timeout_s=10) for n in "ab"], [model_spec("a-m"), model_spec("b-m")]
        )
    )
    await m2.recover()
    assert [m2.view(n).state for n in "ab"] == [S.READY, S.READY]
    assert [on_disk(m2, n) for n in "ab"] == [S.READY, S.READY]
    assert dict(h.runtime.starts) == starts, "recovery started a server"
    assert_legal_history(m2.transitions)
    m2.release(await m2.acquire("b"))  # and it serves
    await m2.close()


async def test_a_refused_lag_write_is_reported_once_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk: the flip still serves (memory), one error event, housekeeping's
    ``retry_unpersisted`` writes it once the disk takes writes again."""
    import errno

    import controller.store.state as store_module

    _h, m = await loaded(tmp_path, "a")
    real = store_module.atomic_write_json
    full = threading.Event()
    full.set()

    def refusing(*args: object, **kwargs: object) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "atomic_write_json", refusing)
    errors: list[Event] = []
    m.events.add_listener(lambda e: errors.append(e) if e.kind == EventKind.ERROR else None)
    for _ in range(3):
        m.release(await m.acquire("a"))
        await asyncio.sleep(0.1)
    assert m.view("a").state is S.READY and "a" in m.core.table.unpersisted
    assert len(errors) == 1 and errors[0].error == "state.write_failed"
    full.clear()
    m.core.table.retry_unpersisted()
    assert on_disk(m, "a") is S.READY and not m.core.table.unpersisted


async def test_housekeeping_leaves_a_pending_flip_to_the_lag_writer(tmp_path: Path) -> None:
    """Each housekeeping interval retries lagging writes on the loop; one the running lag
    writer is about to write stays its (a write on the loop per interval, before)."""
    _h, m = await loaded(tmp_path, "a", "b")
    log = WriteLog(m, slow_in_thread_s=0.3)
    table = m.core.table
    lease = await m.acquire("a")
    await until(lambda: log.in_thread.is_set(), "the lag writer's thread")
    m.release(lease)  # pending again, while the writer's thread sleeps
    table.retry_unpersisted()
    assert not [w for w in log.writes if w[2]], "housekeeping wrote a pending flip on the loop"
    await until(lambda: not table.unpersisted, "the lag writer to finish")
    assert on_disk(m, "a") is S.READY
    # A refused one is still retried on the loop while the writer runs for another.
    table.unpersisted.add("b")
    table._refused.add("b")
    lease = await m.acquire("a")
    table.retry_unpersisted()
    assert ("b", S.READY, True) in log.writes and "b" not in table.unpersisted
    m.release(lease)
    await until(lambda: not table.unpersisted, "the lag writer to finish")
    # With no lag writer running, everything lagging is written at once (the safety net).
    await until(lambda: table._writer is None or table._writer.done(), "the writer to end")
    table.unpersisted.add("a")
    table.retry_unpersisted()
    assert ("a", S.READY, True) in log.writes and not table.unpersisted


async def test_only_the_lease_flip_may_lag(tmp_path: Path) -> None:
    """The one writer refuses to let any other transition lag, whatever its caller asks."""
    _h, m = await loaded(tmp_path, "a")
    table = m.core.table
    slot = table.get("a")
    table.set(slot, S.UNLOADING, op=Op.UNLOAD, durable=False)
    assert on_disk(m, "a") is S.UNLOADING and "a" not in table.unpersisted
    table.set(slot, S.OFFLINE, op=Op.UNLOAD, durable=False)
    assert on_disk(m, "a") is S.OFFLINE


async def test_a_crash_before_the_observations_are_written_loses_nothing(
    tmp_path: Path,
) -> None:
    """The controller dies right after a load and a request (its observations, warming,
    ready, serving, not yet on disk): state.json holds the intent (starting, with the
    process record), and a new controller adopts the running server and probes it back to
    ready: no second server, the same server serves."""
    h = Harness(tmp_path)
    m = h.manager
    want = desired([slot_spec("a")], [model_spec("a-m", 1)])
    await m.set_desired(want)
    await m.load("a")
    lease = await m.acquire("a")
    assert m.view("a").state is S.SERVING and on_disk(m, "a") is S.STARTING
    starts = dict(h.runtime.starts)
    writer = m.core.table._writer
    assert writer is not None and not writer.done()
    writer.cancel()  # the controller dies: its lag writer with it, nothing written
    m2 = h.new_manager()
    await m2.set_desired(want)
    await m2.recover()
    assert m2.view("a").state is S.READY
    assert dict(h.runtime.starts) == starts  # adopted, not started again
    assert [t for t in m2.transitions if t[0] == "a"] == [
        ("a", "starting", "warming"),
        ("a", "warming", "ready"),
    ]
    assert_legal_history(m2.transitions)
    del lease  # the old controller's lease died with it
