"""``make soak`` (``SLOTCTL_SOAK=1``) additions of issue 26: the ``kill -9`` loop in GitOps
mode, the stack switching between two sizes, and hung servers, one after another.

1. :func:`test_gitops_converges_after_50_kills_switching_between_two_sizes`: a real
   ``slotctl up STACK_DIR`` (process runtime, demo servers) SIGKILLed at 50 random moments
   while its stack file switches between 10 and 20 autoload slots (between lifetimes and
   while one runs: applies, prunes, adoptions, loads all get cut). A last controller must
   converge: ``stack diff --exit-code`` in sync, every declared slot ready on exactly one
   server, no server for an undeclared slot, every ``state.json`` whole, no temp file.
   It prints its figures (docs/reliability.md records them).
2. :func:`test_hung_servers_soak`: four watched slots; round after round one server is
   stopped (SIGSTOP) while idle or mid-stream, or wedged by ``--hang-after``; each time it
   is found, stopped and restarted, its requests end with a typed error, and the other
   servers keep their pid and their ``ready``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from controller.store.state import SlotStateRecord
from tests.e2e.conftest import Slotctl, SlotDef, wait_until
from tests.e2e.test_crash_consistency import (
    MAX_KILL_DELAY_S,
    Harness,
    SlotDecl,
    check_converged,
    finish,
    owned_processes,
    temp_files,
)
from tests.e2e.test_hung_server import WATCHED, chat, restarted
from tests.e2e.test_workflow import alive, write_stack
from tests.integration.helpers import free_ports

SOAK = os.environ.get("SLOTCTL_SOAK") == "1"
BIG = 20
SMALL = 10

soak = pytest.mark.skipif(not SOAK, reason="soak run: SLOTCTL_SOAK=1 (make soak)")


@pytest.fixture
def gitops(tmp_path: Path) -> Iterator[Harness]:
    seed = int(os.environ.get("SLOTCTL_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    print(f"gitops crash seed: SLOTCTL_CRASH_SEED={seed}")
    h = Harness(tmp_path, random.Random(seed))
    h.up_args = (str(h.stack_dir),)
    try:
        yield h
    finally:
        forced = h.close()
    assert not forced, f"left running after `slotctl down` (killed now): {forced}"


def figures(h: Harness, declared: set[str]) -> dict[str, int]:
    """What must all be 0 after the loop (but the counts of what ran)."""
    servers = owned_processes(h.state_dir)
    torn = 0
    for path in (h.state_dir / "slots").glob("*/state.json"):
        try:
            SlotStateRecord.model_validate(json.loads(path.read_bytes()))
        except (ValueError, ValidationError):
            torn += 1
    return {
        "duplicates": sum(len(p) - 1 for s, p in servers.items() if s in declared and p),
        "missing": sum(1 for s in declared if not servers.get(s)),
        "orphans": sum(len(p) for s, p in servers.items() if s not in declared),
        "torn_state_files": torn,
        "temp_files": len(temp_files(h.state_dir)),
    }


def converged(h: Harness) -> bool:
    return h.slotctl("stack", "diff", h.stack_dir, "--exit-code").returncode == 0


@pytest.mark.slow
@soak
@pytest.mark.timeout(1800)
def test_gitops_converges_after_50_kills_switching_between_two_sizes(gitops: Harness) -> None:
    h, rng = gitops, gitops.rng
    big = [
        SlotDecl(f"g{i:02d}", port, round(rng.uniform(0.0, 0.3), 2))
        for i, port in enumerate(free_ports(BIG))
    ]
    sizes = {SMALL: big[:SMALL], BIG: big}
    current = BIG
    h.write_stack(sizes[current])
    switches = 0

    def switch() -> None:
        nonlocal current, switches
        current = SMALL if current == BIG else BIG
        h.write_stack(sizes[current])
        switches += 1

    kills = 0
    while kills < 50:
        if rng.random() < 0.5:
            switch()  # while no controller runs
        controller = h.start_up()
        anchor = controller.started
        if rng.random() < 0.5:
            h.wait_locked()
            anchor = time.monotonic()
        if rng.random() < 0.3:
            switch()  # while one runs: the watcher applies it, the kill may cut that
        delay = rng.uniform(0.0, 2 * MAX_KILL_DELAY_S)
        time.sleep(max(0.0, anchor + delay - time.monotonic()))
        h.kill_controller()
        kills += 1

    h.start_up()
    h.wait_locked()
    wait_until(lambda: converged(h), "the last controller to converge", 180, every=1.0)
    time.sleep(1.5)  # a few monitor ticks (orphan reaping) before counting
    declared = {s.name for s in sizes[current]}
    counted = figures(h, declared)
    print(
        f"soak figures: kill -9 iterations={kills} size switches={switches} "
        f"final size={current} " + " ".join(f"{k}={v}" for k, v in counted.items())
    )
    assert counted == dict.fromkeys(counted, 0), f"{counted}\n{h.tail()}"
    check_converged(h, sizes[current])
    finish(h)


@contextlib.contextmanager
def resumed(pids: list[int]) -> Iterator[None]:
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _stream_and_stop(ctl: Slotctl, model: str, pid: int) -> str:
    """A long stream; the server stopped at its first event. Its last event's code."""
    _, events = chat(ctl, model, 4000, stream=True, on_first=lambda: os.kill(pid, signal.SIGSTOP))
    return str(events[-1]["error"]["code"]) if isinstance(events[-1], dict) else "[DONE]"


def _hang(ctl: Slotctl, model: str) -> str:
    """Requests to a ``--hang-after`` server until one gets no answer but a typed error."""
    for _ in range(10):
        status, (body,) = chat(ctl, model, 2)
        if status != 200:
            return str(body["error"]["code"])
    raise AssertionError("the --hang-after server never hung")


@pytest.mark.slow
@soak
@pytest.mark.timeout(1800)
def test_hung_servers_soak(ctl: Slotctl) -> None:
    rng = random.Random(int(os.environ.get("SLOTCTL_CRASH_SEED") or 26))
    breaker = (("max_consecutive_failures", "50"),)
    ports = free_ports(4)
    slots = [
        SlotDef(f"h{i}", extra=("--tokens-per-second", "50"), options=WATCHED + breaker, port=p)
        for i, p in enumerate(ports[:3])
    ] + [SlotDef("wedge", extra=("--hang-after", "4"), options=WATCHED + breaker, port=ports[3])]
    write_stack(ctl.tmp / "gitops" / "soak.toml", slots)
    ctl.start_up(ctl.tmp / "gitops")
    ctl.wait_states({s.name: "ready" for s in slots}, timeout=120)
    rounds, codes = 12, []
    for n in range(rounds):
        slot = slots[n % len(slots)]
        pids = ctl.pids()
        pid = pids[slot.name]
        with resumed([pid]):
            if slot.name == "wedge":
                codes.append(_hang(ctl, "m-wedge"))
            elif rng.random() < 0.5:
                codes.append(_stream_and_stop(ctl, f"m-{slot.name}", pid))
            else:
                os.kill(pid, signal.SIGSTOP)  # idle: only the liveness probe can tell
            restarted(ctl, slot.name, pid, timeout=120)
        others = {k: v for k, v in pids.items() if k != slot.name}
        assert {k: ctl.pids()[k] for k in others} == others, "another server was touched"
        assert all(alive(p) for p in others.values())
        ctl.wait_states({s.name: "ready" for s in slots}, timeout=60)
    assert set(codes) <= {"slot.upstream_timeout", "slot.health_failed"}, codes
    print(f"soak figures: hung-server rounds={rounds} restarts={rounds} typed errors={codes}")
    rows = {row["name"]: row for row in ctl.json("slot", "list")}
    assert all(rows[s.name].get("leases", 0) == 0 for s in slots), rows
