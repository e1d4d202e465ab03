"""Event stream (SSE) and Prometheus metrics against the real API server on 127.0.0.1.

The live tests run :class:`~controller.api.server.ApiServer` on port 0 around a real
SlotManager on the process runtime (demo servers as children), a real Reconciler and
the config dir written the way ``stack apply`` writes it. Device ``gpu`` has a fake probe
(8 GiB total, free = total - admitted) and a 4 GiB budget, so every memory figure is
exact. ``promtool check metrics`` (Debian package ``prometheus``) lints the real output:
the test fails, never skips, when ``promtool`` is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.api.app import ApiContext
from controller.api.assembly import openapi_document
from controller.api.metrics import METRICS, Metrics, eviction_reason
from controller.api.server import ApiServer
from controller.api.sse import KEEPALIVE
from controller.kit.eventbus import EventBus
from controller.model.errors import SlotctlError
from controller.model.events import Event, EventKind, EvictionReason, Op
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import HttpProber
from controller.reconcile.apply import apply_to_config
from controller.reconcile.reconciler import Reconciler
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.configdir import read_settings
from controller.spec.loader import load_stack_texts
from tests.integration.helpers import free_ports

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STATES = [s.value for s in SlotState]


# ============================================================================ SSE client


@dataclass
class Frame:
    id: int | None
    event: str
    data: Any


class SseReader:
    """Reads an open ``/api/events`` response frame by frame (comments kept apart)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.comments: list[str] = []
        self.frames: list[Frame] = []

    async def next(self, timeout: float = 20.0) -> Frame:
        async with asyncio.timeout(timeout):
            fields: dict[str, list[str]] = {}
            while True:
                raw = await self.response.content.readline()
                if not raw:
                    raise EOFError("the event stream ended")
                line = raw.decode().rstrip("\n")
                if line == "":
                    if "event" in fields or "data" in fields:
                        frame = Frame(
                            id=int(fields["id"][0]) if "id" in fields else None,
                            event=fields.get("event", ["message"])[0],
                            data=json.loads("\n".join(fields.get("data", ["null"]))),
                        )
                        self.frames.append(frame)
                        return frame
                    fields = {}
                    continue
                if line.startswith(":"):
                    self.comments.append(line[1:].strip())
                    continue
                name, _, value = line.partition(":")
                fields.setdefault(name, []).append(value.removeprefix(" "))

    async def until(self, check: Callable[[Frame], bool], timeout: float = 30.0) -> list[Frame]:
        """Frames up to and including the first that passes ``check``."""
        seen: list[Frame] = []
        deadline = time.monotonic() + timeout
        while True:
            frame = await self.next(max(0.1, deadline - time.monotonic()))
            seen.append(frame)
            if check(frame):
                return seen


def is_transition(slot: str, to: str) -> Callable[[Frame], bool]:
    return lambda f: f.event == "transition" and f.data["slot"] == slot and f.data["to"] == to


# ============================================================================ live fixture


def stack_toml(slots: Sequence[dict[str, Any]]) -> str:
    out = ['[stack]\nname = "obs"\n']
    for slot in slots:
        out.append(
            f'[[model]]\nid = "m-{slot["name"]}"\nsource = "demo://{slot["name"]}"\n'
            f"memory_gb = {slot['gb']}\n"
        )
    # Distinct ports (one free_port() per slot may hand the same one out twice).
    for slot, port in zip(slots, free_ports(len(slots)), strict=True):
        args = ["--load-seconds", str(slot.get("load", 0.3)), *slot.get("args", [])]
        out.append(
            f'\n[[slot]]\nname = "{slot["name"]}"\nprovider = "demo"\n'
            f'model.default = "m-{slot["name"]}"\ndevice = "gpu"\nport = {port}\n'
            f"autoload = {str(slot.get('autoload', False)).lower()}\n"
            f"priority = {slot.get('priority', 50)}\n"
            f"max_consecutive_failures = {slot.get('max_failures', 5)}\n"
            f"[slot.server]\nextra_args = {json.dumps(args)}\n"
        )
    return "".join(out)


@dataclass
class Live:
    manager: SlotManager
    reconciler: Reconciler
    server: ApiServer
    url: str
    session: aiohttp.ClientSession
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def bus(self) -> EventBus:
        return self.manager.events

    @property
    def metrics(self) -> Metrics:
        metrics = self.server.ctx.store.get(METRICS)
        assert isinstance(metrics, Metrics)
        return metrics

    @contextlib.asynccontextmanager
    async def events(self, **headers: str) -> AsyncIterator[SseReader]:
        async with self.session.get(
            f"{self.url}/api/events", headers={**AUTH, **headers}
        ) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            yield SseReader(response)

    async def post(self, path: str) -> tuple[int, Any]:
        async with self.session.post(f"{self.url}{path}", headers=AUTH) as response:
            return response.status, await response.json()

    async def get_json(self, path: str) -> Any:
        async with self.session.get(f"{self.url}{path}", headers=AUTH) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def scrape(self) -> str:
        async with self.session.get(f"{self.url}/metrics", headers=AUTH) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return await response.text()

    async def wait_state(self, slot: str, state: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.manager.view(slot).state.value != state:
            assert time.monotonic() < deadline, f"{slot}: {self.manager.view(slot)}"
            await asyncio.sleep(0.05)


SLOTS = [
    {"name": "alpha", "gb": 1.5, "priority": 60},
    {"name": "beta", "gb": 1.5, "priority": 20},
    {"name": "gamma", "gb": 2.0, "priority": 70},
    {"name": "huge", "gb": 100.0, "autoload": True},  # never fits: waits for memory
    {"name": "crashy", "gb": 0.1, "args": ["--fail-on-load"], "max_failures": 1},
    # autoload and failing: a reconcile pass that fails (then the breaker holds it)
    {"name": "broken", "gb": 0.1, "autoload": True, "args": ["--fail-on-load"], "max_failures": 1},
]


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    config, state = tmp_path / "config", tmp_path / "state"
    config.mkdir()
    (config / "controller.toml").write_text(
        "safety_margin_gb = 0.0\n[memory_budget_gb]\ngpu = 4.0\n"
    )
    settings, problems = read_settings(config)
    assert not problems
    report = load_stack_texts([("obs.toml", stack_toml(SLOTS))], settings)
    assert report.ok and report.state is not None, report.errors
    apply_to_config(report.state, config, prune=True)

    manager: SlotManager | None = None

    def used(device: str) -> int:
        return manager.admitted_bytes(device) if manager is not None else 0

    manager = SlotManager(
        runtime=ProcessRuntime(state, kill_grace_s=5.0),
        state_dir=state,
        config_dir=config,
        settings=settings,
        prober=HttpProber(timeout_s=5.0),
        memory=FakeMemoryProbe({"gpu": 8 * GIB}, used_by=used),
        config=ManagerConfig(stop_timeout_s=5.0, tick_interval_s=0.2),
    )
    reconciler = Reconciler(manager, config, resync_s=3600)
    await manager.set_desired(reconciler.refresh().desired())
    ctx = ApiContext(
        manager=manager,
        reconciler=reconciler,
        config_dir=config,
        state_dir=state,
        token=TOKEN,
        events=manager.events,
    )
    server = ApiServer(ctx, "127.0.0.1", 0)
    address = await server.start()
    ctx.ready.set()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=60))
    env = Live(manager, reconciler, server, f"http://{address}", session)
    try:
        yield env
    finally:
        env.stop.set()
        for task in env.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await session.close()
        await server.stop()
        with contextlib.suppress(SlotctlError):
            await manager.stop_all(reason="test teardown")
        await manager.close()


def start_loops(env: Live) -> None:
    """The reconciler (autoload ``huge``: refused, an error per pass) and the manager."""
    env.tasks.append(asyncio.create_task(env.reconciler.run(env.stop)))
    env.tasks.append(asyncio.create_task(env.manager.run(env.stop)))


# ============================================================================ SSE


async def test_events_need_the_token(live: Live) -> None:
    async with live.session.get(f"{live.url}/api/events") as response:
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "auth.unauthorized"
    async with live.session.get(
        f"{live.url}/api/events", headers={"Authorization": "Bearer nope"}
    ) as response:
        assert response.status == 401


async def test_sse_delivers_the_transitions_of_a_load_in_order(live: Live) -> None:
    async with live.events() as stream:
        status, body = await live.post("/api/slots/alpha/load")
        assert status == 202, body
        frames = await stream.until(is_transition("alpha", "ready"))
    alpha = [f for f in frames if f.data["slot"] == "alpha"]
    transitions = [(f.data["from"], f.data["to"]) for f in alpha if f.event == "transition"]
    assert transitions == [("offline", "starting"), ("starting", "warming"), ("warming", "ready")]
    kinds = [f.event for f in alpha]
    assert kinds.index("admission") < kinds.index("transition")  # admitted, then started
    ids = [f.id for f in frames]
    assert all(isinstance(i, int) for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for frame in frames:  # the frame's id and event name are the event's own
        assert frame.id == frame.data["id"] and frame.event == frame.data["kind"]
    assert stream.comments and stream.comments[0] == "slotctl event stream"


async def test_resume_with_last_event_id_gets_exactly_the_missed_events(live: Live) -> None:
    async with live.events() as witness:  # connected throughout: the reference
        async with live.events() as first:
            assert (await live.post("/api/slots/alpha/load"))[0] == 202
            seen = await first.until(is_transition("alpha", "warming"))
        last_seen = seen[-1].id
        assert last_seen is not None
        # Disconnected: the load finishes, beta loads and alpha unloads meanwhile.
        await live.wait_state("alpha", "ready")
        assert (await live.post("/api/slots/beta/load"))[0] in (200, 202)
        await live.wait_state("beta", "ready")
        assert (await live.post("/api/slots/alpha/unload"))[0] == 200
        reference = await witness.until(is_transition("alpha", "offline"))
        missed = [f.id for f in reference if f.id is not None and f.id > last_seen]
        assert len(missed) >= 6  # warming->ready, beta's load, alpha's unload

        async with live.events(**{"Last-Event-ID": str(last_seen)}) as resumed:
            replay = [await resumed.next() for _ in missed]
            assert [f.id for f in replay] == missed  # exactly: nothing lost, nothing twice
            assert all(f.event != "gap" for f in replay)
            # ... and the stream goes on live after the replay, without duplicates
            assert (await live.post("/api/slots/beta/unload"))[0] == 200
            after = await resumed.until(is_transition("beta", "offline"))
            assert after[0].id == missed[-1] + 1
            live_ids = [f.id for f in after]
            assert live_ids == sorted(live_ids) and len(set(live_ids)) == len(live_ids)

    # The query parameter does the same for clients that cannot set headers.
    async with live.session.get(
        f"{live.url}/api/events", params={"last_event_id": str(last_seen)}, headers=AUTH
    ) as response:
        reader = SseReader(response)
        assert [(await reader.next()).id for _ in missed] == missed


async def test_resume_older_than_the_buffer_says_gap_first(tmp_path: Path) -> None:
    bus = EventBus(buffer_size=5)
    ctx = ApiContext(None, None, tmp_path, tmp_path, TOKEN, bus)
    ctx.store.set(KEEPALIVE, 0.2)
    server = ApiServer(ctx, "127.0.0.1", 0)
    url = f"http://{await server.start()}"
    for _ in range(20):
        bus.emit("transition", "load", slot="s", from_state="offline", to_state="starting")
    try:
        async with aiohttp.ClientSession() as session:
            # id 3 is long gone: a gap (16 missed), then the 5 buffered events
            async with session.get(
                f"{url}/api/events", headers={**AUTH, "Last-Event-ID": "3"}
            ) as response:
                reader = SseReader(response)
                gap = await reader.next()
                assert gap.event == "gap" and gap.id is None
                assert gap.data["reason"] == "expired"
                assert gap.data["missed"] == 12 and gap.data["first_available"] == 16
                assert [(await reader.next()).id for _ in range(5)] == [16, 17, 18, 19, 20]
                # idle: keep-alive comments, no frames
                await asyncio.sleep(0.7)
                bus.emit("probe", "probe", slot="s", message="live")
                live_frame = await reader.next()
                assert live_frame.id == 21 and live_frame.event == "probe"
                assert "keep-alive" in reader.comments
            # an id from before a controller restart (ids start again): gap, whole buffer
            async with session.get(
                f"{url}/api/events", headers={**AUTH, "Last-Event-ID": "999"}
            ) as response:
                reader = SseReader(response)
                gap = await reader.next()
                assert gap.event == "gap" and gap.data["reason"] == "reset"
                assert (await reader.next()).id == 17
            # in sync: no gap, nothing to replay
            async with session.get(
                f"{url}/api/events", headers={**AUTH, "Last-Event-ID": "21"}
            ) as response:
                reader = SseReader(response)
                bus.emit("probe", "probe", slot="s", message="next")
                assert (await reader.next()).id == 22
            # a malformed id: the typed 400
            async with session.get(
                f"{url}/api/events", headers={**AUTH, "Last-Event-ID": "abc"}
            ) as response:
                assert response.status == 400
                assert (await response.json())["error"]["code"] == "request.invalid"
    finally:
        await server.stop()


async def test_disconnect_unsubscribes_and_shutdown_ends_streams(tmp_path: Path) -> None:
    bus = EventBus()
    ctx = ApiContext(None, None, tmp_path, tmp_path, TOKEN, bus)
    server = ApiServer(ctx, "127.0.0.1", 0)
    url = f"http://{await server.start()}"
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"{url}/api/events", headers=AUTH)
        assert response.status == 200
        assert len(bus._subscribers) == 1
        response.close()  # the client goes away
        deadline = time.monotonic() + 5
        while bus._subscribers:
            assert time.monotonic() < deadline, "the subscription outlived its client"
            await asyncio.sleep(0.05)
        # a connected stream does not hold up the server's shutdown
        response = await session.get(f"{url}/api/events", headers=AUTH)
        reader = SseReader(response)
        started = time.monotonic()
        await server.stop()
        assert time.monotonic() - started < 3.0
        with pytest.raises((EOFError, aiohttp.ClientError)):
            await reader.next(timeout=5)
        response.close()
    assert not bus._subscribers


# ============================================================================ metrics


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed (Debian package `prometheus`: "
            "apt-get install -y prometheus); it lints the metrics output",
            pytrace=False,
        )
    return path


def promtool_check(text: str) -> None:
    result = subprocess.run(
        [promtool(), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, f"promtool:\n{result.stdout}{result.stderr}\n---\n{text}"
    assert not result.stdout.strip() and not result.stderr.strip(), result.stdout + result.stderr


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(
    table: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return table[(name, frozenset(labels.items()))]


def series(
    table: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str
) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels) in table if n == name]


async def test_metrics_after_activity_pass_promtool_and_count_right(live: Live) -> None:
    async with live.session.get(f"{live.url}/metrics") as response:
        assert response.status == 401  # metrics carry slot names: the token is required
    start_loops(live)  # the reconciler tries autoload `huge` (never fits): errors
    async with live.events() as stream:
        assert (await live.post("/api/slots/alpha/load"))[0] == 202
        await stream.until(is_transition("alpha", "ready"))
        assert (await live.post("/api/slots/beta/load"))[0] == 202
        await stream.until(is_transition("beta", "ready"))
        # gamma (2 GiB) does not fit next to alpha + beta (3 of 4 GiB): beta, the lowest
        # priority, is evicted to make room
        assert (await live.post("/api/slots/gamma/load"))[0] == 202
        await stream.until(is_transition("gamma", "ready"))
        # crashy fails its load once: max_consecutive_failures = 1 blocks it
        status, body = await live.post("/api/slots/crashy/load")
        if status == 202:
            await stream.until(is_transition("crashy", "error"))
        await live.wait_state("crashy", "error")
        status, body = await live.post("/api/slots/crashy/load")
        assert status == 503 and body["error"]["code"] == "slot.crash_looping"
        # the reconciler has tried huge by now (autoload): it waits for memory
        deadline = time.monotonic() + 20
        while live.manager.view("huge").waiting is None:
            assert time.monotonic() < deadline, "huge is not waiting for memory"
            await asyncio.sleep(0.05)
        # and has tried `broken` (autoload), which failed
        while live.metrics.reconcile_errors._value.get() < 1:
            assert time.monotonic() < deadline, "no reconcile error counted"
            await asyncio.sleep(0.05)
    live.metrics.request_done("alpha", "m-alpha", 200, 0.042)
    live.metrics.request_done("alpha", "m-alpha", 200, 0.2)
    live.metrics.request_done("gamma", "m-gamma", 503, 1.5)

    text = await live.scrape()
    promtool_check(text)
    table = samples(text)

    # one-hot state: exactly one 1 per slot, on its current state
    expected = {"alpha": "ready", "beta": "offline", "gamma": "ready", "huge": "offline"}
    expected["crashy"] = "error"
    for slot, now in expected.items():
        for state in STATES:
            want = 1.0 if state == now else 0.0
            assert value(table, "slotctl_slot_state", slot=slot, state=state) == want, slot
    # transitions counted one by one
    assert (
        value(
            table,
            "slotctl_transitions_total",
            slot="alpha",
            **{"from": "offline", "to": "starting"},
        )
        == 1
    )
    assert (
        value(
            table, "slotctl_transitions_total", slot="alpha", **{"from": "warming", "to": "ready"}
        )
        == 1
    )
    assert (
        value(
            table,
            "slotctl_transitions_total",
            slot="beta",
            **{"from": "unloading", "to": "offline"},
        )
        == 1
    )
    assert (
        value(
            table, "slotctl_transitions_total", slot="crashy", **{"from": "warming", "to": "error"}
        )
        == 1
    )
    # load durations: one per successful load, at least the demo's --load-seconds
    for slot in ("alpha", "beta", "gamma"):
        assert value(table, "slotctl_load_duration_seconds_count", slot=slot) == 1
        assert value(table, "slotctl_load_duration_seconds_sum", slot=slot) >= 0.3
    assert ("slotctl_load_duration_seconds_count", frozenset({("slot", "crashy")})) not in table
    # eviction with its reason class, refusals, crash loop
    assert value(table, "slotctl_evictions_total", slot="beta", reason="preload") == 1
    assert series(table, "slotctl_evictions_total") == [{"slot": "beta", "reason": "preload"}]
    assert value(table, "slotctl_admission_refusals_total", slot="huge") >= 1
    assert value(table, "slotctl_admission_refusals_total", slot="crashy") == 1
    assert value(table, "slotctl_admission_refusals_total", slot="alpha") == 0  # primed at 0
    assert value(table, "slotctl_crash_loop_blocked", slot="crashy") == 1
    assert value(table, "slotctl_crash_loop_blocked", slot="alpha") == 0
    assert value(table, "slotctl_slot_waiting_for_memory", slot="huge") == 1
    assert value(table, "slotctl_slot_waiting_for_memory", slot="alpha") == 0
    # leases and queue depth (nothing in flight)
    assert value(table, "slotctl_leases_active", slot="alpha") == 0
    assert value(table, "slotctl_queue_depth", slot="gamma") == 0
    # device memory, one series set per GPU (this host has one): total/free from the
    # probe, admitted by slotctl (resident: up, reserved: coming up), the budget
    admitted = int(3.5 * GIB)  # alpha 1.5 + gamma 2
    gpu0 = {"device": "gpu", "gpu": "0"}
    assert value(table, "slotctl_device_memory_bytes", **gpu0, kind="admitted") == admitted
    assert value(table, "slotctl_device_memory_bytes", **gpu0, kind="resident") == admitted
    assert value(table, "slotctl_device_memory_bytes", **gpu0, kind="reserved") == 0
    assert value(table, "slotctl_device_memory_bytes", **gpu0, kind="budget") == 4 * GIB
    assert value(table, "slotctl_device_memory_bytes", **gpu0, kind="total") == 8 * GIB
    free = 8 * GIB - admitted
    assert value(table, "slotctl_device_memory_bytes", **gpu0, kind="free") == free
    assert {s["slot"] for s in series(table, "slotctl_slot_gpu")} == {"alpha", "gamma"}
    # requests and their latency, from the router's request_done
    assert value(table, "slotctl_requests_total", slot="alpha", model="m-alpha", status="200") == 2
    assert value(table, "slotctl_requests_total", slot="gamma", model="m-gamma", status="503") == 1
    assert (
        value(table, "slotctl_request_duration_seconds_count", slot="alpha", model="m-alpha") == 2
    )
    bucket = value(
        table, "slotctl_request_duration_seconds_bucket", slot="alpha", model="m-alpha", le="0.05"
    )
    assert bucket == 1
    # reconcile: every pass timed, the failed ones counted
    assert value(table, "slotctl_reconcile_duration_seconds_count") >= len(SLOTS)
    assert value(table, "slotctl_reconcile_errors_total") >= 1
    assert value(table, "slotctl_build_info", version=__import__("controller").__version__) == 1

    # /api/devices has the same figures for the dashboard: each GPU (here one), with the
    # slots admitted on it
    devices = (await live.get_json("/api/devices"))["devices"]
    devices[0]["slots"].sort()
    assert devices == [
        {
            "device": "gpu:0",
            "kind": "gpu",
            "total_bytes": 8 * GIB,
            "free_bytes": free,
            "admitted_bytes": admitted,
            "reserved_bytes": 0,
            "resident_bytes": admitted,
            "budget_bytes": 4 * GIB,
            "safety_margin_bytes": 0,
            "source": "fake",
            "slots": ["alpha", "gamma"],
            "index": 0,
            "uuid": None,
            "name": None,
            "error": None,
        }
    ]


async def test_metrics_openmetrics_negotiation_and_fresh_app_lint(live: Live) -> None:
    text = await live.scrape()  # nothing happened yet: still valid, zero series present
    promtool_check(text)
    table = samples(text)
    assert value(table, "slotctl_slot_state", slot="alpha", state="offline") == 1
    headers = {**AUTH, "Accept": "application/openmetrics-text; version=1.0.0"}
    async with live.session.get(f"{live.url}/metrics", headers=headers) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert (await response.text()).rstrip().endswith("# EOF")


# ============================================================================ pure parts


def ev(kind: str, op: str, message: str, **kw: Any) -> Event:
    return Event(id=1, kind=kind, op=op, slot="s", message=message, **kw)


def test_eviction_reason_is_a_field_of_the_event() -> None:
    """Metrics read the reason class from the event, never from its message."""
    for reason in EvictionReason:
        event = ev(EventKind.EVICTION, Op.EVICT, "whatever the words", reason=reason)
        assert eviction_reason(event) == reason.value
    # A message that reads like an eviction is not one without the field ...
    assert eviction_reason(ev(EventKind.EVICTION, Op.EVICT, "evicted to make room")) is None
    # ... and only eviction events count.
    swap = ev(EventKind.TRANSITION, Op.UNLOAD, "exclusive group g: swapped out for b")
    assert eviction_reason(swap) is None
    assert eviction_reason(ev(EventKind.REFUSAL, Op.ADMIT, "no room")) is None


def test_openapi_documents_the_observability_routes() -> None:
    paths = openapi_document()["paths"]
    events = paths["/api/events"]["get"]
    assert "text/event-stream" in events["responses"]["200"]["content"]
    assert {p["name"] for p in events["parameters"]} == {"last_event_id"}
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert "401" in paths["/metrics"]["get"]["responses"]
    devices = paths["/api/devices"]["get"]["responses"]["200"]["content"]["application/json"]
    assert devices["schema"] == {"$ref": "#/components/schemas/DeviceList"}
    assert paths["/"]["get"]["security"] == []  # the page itself is public


async def test_dashboard_page_and_assets_are_public_and_locked_down(live: Live) -> None:
    async with live.session.get(f"{live.url}/") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in response.headers["Content-Security-Policy"]
        page = await response.text()
        assert '<script src="/static/app.js"' in page and "<script>" not in page
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        async with live.session.get(f"{live.url}/static/{name}") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith(kind)
    for bad in ("nope.js", "..%2Fdashboard.py", ".hidden", "index.py"):
        async with live.session.get(f"{live.url}/static/{bad}") as response:
            assert response.status == 404, bad
            assert (await response.json())["error"]["code"] == "http.not_found"
    async with live.session.get(f"{live.url}/api/devices") as response:
        assert response.status == 401
