"""One load's walk through the slot manager: how often it decides, and how it bounces.

The real :class:`~controller.slots.manager.SlotManager` over ``FakeRuntime``, ``FakeClock``
and a fake memory probe (no I/O but the state files), for the walks the admit loop serves
(docs/design/0016): a cold load that fits, one that evicts, one in an exclusive group whose
member is loaded, a wake that fits and a wake that evicts, and a request's cold load through
a lease. For each walk it counts:

* **decisions**: the calls of the pure :func:`controller.scheduling.decision.decide_load`
  (the placement behind it costs ~70 us on 2 GPUs, ~0.3 ms on 8);
* **crossings**: calls from one part of the manager into another among ``admission``,
  ``loading``, ``unloading``, ``residency`` and ``admit`` (a function of one part calling a
  function of another; a profile hook counts them).

Prints a table; never fails.

    python bench/admit_walk.py
"""

from __future__ import annotations

import asyncio
import dis
import functools
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import controller.scheduling.decision as decision_module
from controller.model.sizes import GIB
from controller.slots.manager import SlotManager
from controller.spec.schema import ControllerSettings, SlotSpec
from tests.unit.manager_fixtures import Harness, desired, model_spec, settle, slot_spec

PARTS = ("admission", "loading", "unloading", "residency", "admit")


def _part(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    module = frame.f_globals.get("__name__", "")
    if module.startswith("controller.slots."):
        tail = module.rsplit(".", 1)[1]
        return tail if tail in PARTS else None
    return None


@functools.cache
def _starts(code: CodeType) -> frozenset[int]:
    """The offsets of a code object's first ``RESUME`` (a call; a coroutine resumed after
    an ``await`` is at another ``RESUME``, which the profile hook also reports)."""
    return frozenset(
        i.offset for i in dis.get_instructions(code) if i.opname == "RESUME" and i.arg == 0
    )


def _fresh(frame: FrameType) -> bool:
    return frame.f_lasti in _starts(frame.f_code)


class Counting:
    """Counts decide_load calls (wrapped where the manager's modules import it) and the
    crossings between the manager's parts while it is on."""

    def __init__(self, *, profile: bool = True) -> None:
        self.profile = profile  # count the crossings too (a profile hook: slower)
        self.decisions = 0
        self.crossings: Counter[tuple[str, str]] = Counter()
        self._patched: list[tuple[Any, Any]] = []

    def __enter__(self) -> Counting:
        original = decision_module.decide_load

        def counted(*args: Any, **kw: Any) -> Any:
            self.decisions += 1
            return original(*args, **kw)

        for name, module in list(sys.modules.items()):
            if name.startswith("controller.slots.") and hasattr(module, "decide_load"):
                self._patched.append((module, module.decide_load))
                module.decide_load = counted  # type: ignore[attr-defined]
        if self.profile:
            sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.profile:
            sys.setprofile(None)
        for module, original in self._patched:
            module.decide_load = original

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not _fresh(frame):
            return
        callee = _part(frame)
        caller = _part(frame.f_back)
        if callee and caller and callee != caller:
            self.crossings[(caller, callee)] += 1


def sleepy(name: str, **kw: Any) -> SlotSpec:
    return slot_spec(name, sleep=True, **kw)


async def _harness(tmp: Path, slots: list[SlotSpec], models: list[Any], gpu_gb: float) -> Harness:
    h = Harness(tmp, gpu_gb=gpu_gb)
    h.memory.totals["cpu"] = 64 * GIB
    h.manager.settings = ControllerSettings(safety_margin_gb=0.0)
    await h.manager.set_desired(desired(slots, models))
    return h


Walk = Callable[[Path], Awaitable[tuple[SlotManager, Callable[[], Awaitable[Any]]]]]


async def cold_fits(tmp: Path) -> tuple[SlotManager, Callable[[], Awaitable[Any]]]:
    h = await _harness(tmp, [slot_spec("a")], [model_spec("a-m", 4)], 24)
    return h.manager, lambda: h.manager.load("a")


async def cold_evicts(tmp: Path) -> tuple[SlotManager, Callable[[], Awaitable[Any]]]:
    h = await _harness(
        tmp, [slot_spec("a"), slot_spec("b")], [model_spec("a-m", 6), model_spec("b-m", 6)], 8
    )
    await h.manager.load("a")
    h.clock.advance(30)
    return h.manager, lambda: h.manager.load("b")


async def cold_group_swap(tmp: Path) -> tuple[SlotManager, Callable[[], Awaitable[Any]]]:
    models = [model_spec("a-m", 4, group="g"), model_spec("b-m", 4, group="g")]
    h = await _harness(tmp, [slot_spec("a"), slot_spec("b")], models, 24)
    await h.manager.load("a")
    return h.manager, lambda: h.manager.load("b")


async def cold_group_swap_evicts(tmp: Path) -> tuple[SlotManager, Callable[[], Awaitable[Any]]]:
    models = [
        model_spec("a-m", 2, group="g"),
        model_spec("b-m", 6, group="g"),
        model_spec("c-m", 6),
    ]
    h = await _harness(tmp, [slot_spec("a"), slot_spec("b"), slot_spec("c")], models, 8)
    await h.manager.load("a")
    await h.manager.load("c")
    h.clock.advance(30)
    return h.manager, lambda: h.manager.load("b")  # a swapped out, c evicted


async def wake_fits(tmp: Path) -> tuple[SlotManager, Callable[[], Awaitable[Any]]]:
    h = await _harness(
        tmp, [sleepy("a"), slot_spec("b")], [model_spec("a-m", 6), model_spec("b-m", 6)], 8
    )
    await h.manager.load("a")
    h.clock.advance(30)
    await h.manager.load("b")  # a sleeps
    await h.manager.unload("b")
    return h.manager, lambda: h.manager.load("a")


async def wake_evicts(tmp: Path) -> tuple[SlotManager, Callable[[], Awaitable[Any]]]:
    h = await _harness(
        tmp, [sleepy("a"), sleepy("b")], [model_spec("a-m", 6), model_spec("b-m", 6)], 8
    )
    await h.manager.load("a")
    h.clock.advance(30)
    await h.manager.load("b")  # a sleeps
    h.clock.advance(30)
    return h.manager, lambda: h.manager.load("a")  # b sleeps, a wakes


async def wake_evicts_unload(tmp: Path) -> tuple[SlotManager, Callable[[], Awaitable[Any]]]:
    h = await _harness(
        tmp, [sleepy("a"), slot_spec("b")], [model_spec("a-m", 6), model_spec("b-m", 6)], 8
    )
    await h.manager.load("a")
    h.clock.advance(30)
    await h.manager.load("b")  # a sleeps
    h.clock.advance(30)
    return h.manager, lambda: h.manager.load("a")  # b (cannot sleep) unloaded, a wakes


async def request_cold(tmp: Path) -> tuple[SlotManager, Callable[[], Awaitable[Any]]]:
    h = await _harness(tmp, [slot_spec("a")], [model_spec("a-m", 4)], 24)

    async def request() -> None:
        lease = await h.manager.acquire("a")
        h.manager.release(lease)

    return h.manager, request


WALKS: dict[str, Walk] = {
    "cold load, fits": cold_fits,
    "cold load, evicts one": cold_evicts,
    "cold load, group swap": cold_group_swap,
    "cold load, swap and evict": cold_group_swap_evicts,
    "wake, fits": wake_fits,
    "wake, evicts one (sleeps)": wake_evicts,
    "wake, evicts one (unloads)": wake_evicts_unload,
    "request, cold load": request_cold,
}


async def measure(walk: Walk) -> tuple[int, int, Counter[tuple[str, str]]]:
    with tempfile.TemporaryDirectory() as tmp:
        manager, act = await walk(Path(tmp))
        with Counting() as counting:
            await act()
            await settle(manager)
        await manager.close()
    return counting.decisions, sum(counting.crossings.values()), counting.crossings


async def main() -> None:
    print(f"{'walk':<28} {'decisions':>9} {'crossings':>9}  between parts")
    for name, walk in WALKS.items():
        decisions, crossings, detail = await measure(walk)
        pairs = ", ".join(f"{a}->{b} {n}" for (a, b), n in sorted(detail.items()))
        print(f"{name:<28} {decisions:>9} {crossings:>9}  {pairs}")


if __name__ == "__main__":
    asyncio.run(main())
