"""SPEC §8: the reconciler "converges after a crash of the controller at any point".

A real ``slotctl up`` controller (a subprocess, process runtime, demo servers) reconciles
a 20-slot autoload stack applied with ``stack apply --wait``; the test SIGKILLs it at
random moments — while it imports, acquires its lock, adopts and recovers servers, loads
and probes them, recreates slots whose config changed, prunes slots no longer declared —
and starts it again each time. Between lifetimes the desired state keeps moving (changed
``--load-seconds``: recreate; transient slots added and pruned; a server killed by hand),
so the kills land on every kind of action. A SIGKILLed controller leaves its servers
running (they live in their own sessions): the next one must adopt them, never start a
duplicate, and stop the servers nobody declares any more.

After the kill loop a last ``up`` + ``stack apply --wait`` must converge, and then:

* every autoload slot is ``ready`` (and ``stack diff --exit-code`` says in sync);
* zero duplicate servers: for each slot exactly one live process labelled
  ``SLOTCTL_SLOT=<slot>`` with ``SLOTCTL_OWNER=<state dir>``, whose pid is process.json's;
* zero orphans: no labelled process for a slot that is not declared;
* every ``state.json`` parses as :class:`~controller.store.SlotStateRecord`, and no temp
  file (``.*.tmp``) of a killed writer is left in the state dir.

CI runs 50 kill points (about one minute alone, up to three in ``make test``'s parallel
run); ``SLOTCTL_SOAK=1`` (``make soak``) runs 300.
The random seed is printed (and ``SLOTCTL_CRASH_SEED`` replays one run).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil
import pytest

from controller.reconcile.apply import apply_to_config
from controller.spec.configdir import read_settings
from controller.spec.loader import load_stacks
from controller.store.lock import ControllerLock
from controller.store.state import SlotStateRecord
from tests.e2e.conftest import wait_until
from tests.integration.helpers import free_ports

REPO = Path(__file__).resolve().parents[2]
SOAK = os.environ.get("SLOTCTL_SOAK") == "1"
CORE_SLOTS = 20
TRANSIENT_SLOTS = 2
MAX_KILL_DELAY_S = 1.5


# ============================================================================ harness


@dataclass
class SlotDecl:
    name: str
    port: int
    load_seconds: float
    autoload: bool = True


def render_stack(slots: list[SlotDecl]) -> str:
    lines = ['[stack]\nname = "crash"\n']
    for slot in slots:
        lines.append(f'[[model]]\nid = "m-{slot.name}"\nsource = "demo://{slot.name}"\n')
    for slot in slots:
        lines.append(
            f'[[slot]]\nname = "{slot.name}"\nprovider = "demo"\n'
            f'model.default = "m-{slot.name}"\ndevice = "cpu"\nport = {slot.port}\n'
            f"autoload = {'true' if slot.autoload else 'false'}\n"
            "warmup_timeout_s = 30\n"
            "[slot.server]\n"
            f'extra_args = ["--load-seconds", "{slot.load_seconds:.2f}"]\n'
        )
    return "\n".join(lines)


def owned_processes(state_dir: Path) -> dict[str, list[psutil.Process]]:
    """Live (non-zombie) processes labelled as servers of ``state_dir``, by slot."""
    owner = str(state_dir.resolve())
    found: dict[str, list[psutil.Process]] = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("SLOTCTL_OWNER") != owner or env.get("SLOTCTL_MANAGED") != "true":
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        found.setdefault(env.get("SLOTCTL_SLOT", ""), []).append(proc)
    return found


@dataclass
class Controller:
    proc: subprocess.Popen[bytes]
    started: float


@dataclass
class Harness:
    root: Path
    rng: random.Random
    config_dir: Path = field(init=False)
    state_dir: Path = field(init=False)
    stack_dir: Path = field(init=False)
    log_path: Path = field(init=False)
    log: IO[bytes] = field(init=False)
    controller: Controller | None = None
    helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    lifetimes: int = 0
    up_args: tuple[str, ...] = ()  # e.g. the stack dir: GitOps mode

    def __post_init__(self) -> None:
        self.config_dir = self.root / "config"
        self.state_dir = (self.root / "state").resolve()
        self.stack_dir = self.root / "stack"
        for directory in (self.config_dir, self.state_dir, self.stack_dir):
            directory.mkdir(parents=True)
        self.log_path = self.root / "controller.log"
        self.log = self.log_path.open("ab")

    # ------------------------------------------------------------------ processes

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTCTL_")}
        env |= {"PYTHONPATH": str(REPO), "NO_COLOR": "1"}
        return env

    def argv(self, *args: str | Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "controller",
            "--config-dir",
            str(self.config_dir),
            "--state-dir",
            str(self.state_dir),
            *map(str, args),
        ]

    def slotctl(self, *args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )

    def start_up(self) -> Controller:
        assert self.controller is None
        self.lifetimes += 1
        self.log.write(f"\n===== lifetime {self.lifetimes}\n".encode())
        self.log.flush()
        proc = subprocess.Popen(
            self.argv("up", *self.up_args, "--listen", "127.0.0.1:0"),  # the API on any port
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        self.controller = Controller(proc, time.monotonic())
        return self.controller

    def wait_locked(self, timeout: float = 30.0) -> None:
        """Until the controller holds the state dir's lock (it wrote controller.json)."""
        assert self.controller is not None
        deadline = time.monotonic() + timeout
        lock = ControllerLock(self.state_dir)
        while time.monotonic() < deadline:
            record = lock.running()
            if record is not None and record.pid == self.controller.proc.pid:
                return
            assert self.controller.proc.poll() is None, self.tail()
            time.sleep(0.02)
        raise AssertionError(f"controller did not take the lock in {timeout}s\n{self.tail()}")

    def kill_controller(self) -> None:
        """SIGKILL: no shutdown, no cleanup; the servers it started keep running."""
        controller, self.controller = self.controller, None
        assert controller is not None
        code = controller.proc.poll()
        with contextlib.suppress(ProcessLookupError):
            controller.proc.send_signal(signal.SIGKILL)
        controller.proc.wait(10)
        assert code is None, f"the controller exited on its own ({code}):\n{self.tail()}"

    def helper(self, *args: str | Path) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            self.argv(*args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        self.helpers.append(proc)
        return proc

    def tail(self, lines: int = 60) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    # ------------------------------------------------------------------ desired state

    def write_stack(self, slots: list[SlotDecl]) -> Path:
        path = self.stack_dir / "crash.toml"
        tmp = path.with_suffix(".partial")  # never let a reader see half a file
        tmp.write_text(render_stack(slots))
        tmp.replace(path)
        return path

    def apply_in_process(self, slots: list[SlotDecl]) -> None:
        """What ``stack apply --prune`` writes (through the guard), without a subprocess."""
        path = self.write_stack(slots)
        settings, problems = read_settings(self.config_dir)
        assert not problems
        report = load_stacks([path], settings)
        assert report.ok and report.state is not None, report.errors
        apply_to_config(report.state, self.config_dir, prune=True)

    # ------------------------------------------------------------------ cleanup

    def down(self) -> subprocess.CompletedProcess[str]:
        """``slotctl down`` with the same dirs; reaps our controller while down waits for it.

        (``down`` waits until the controller's pid is gone; as our child it would linger
        as a zombie until we collect it.)
        """
        proc = subprocess.Popen(
            self.argv("down", "--timeout", "60"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        controller, self.controller = self.controller, None
        try:
            if controller is not None:
                controller.proc.wait(90)
            out, err = proc.communicate(timeout=120)
        except BaseException:
            proc.kill()
            proc.communicate()
            if controller is not None and controller.proc.poll() is None:
                controller.proc.kill()
                controller.proc.wait(10)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> list[str]:
        """Stop everything this test started; returns what had to be killed by force."""
        forced: list[str] = []
        for proc in self.helpers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.down()
        for slot, procs in owned_processes(self.state_dir).items():
            for proc in procs:
                forced.append(f"{slot}: pid {proc.pid}")
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
        self.log.close()
        return forced


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    seed = int(os.environ.get("SLOTCTL_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    print(f"crash-consistency seed: SLOTCTL_CRASH_SEED={seed}")
    h = Harness(tmp_path, random.Random(seed))
    try:
        yield h
    finally:
        forced = h.close()
    assert not forced, f"left running after `slotctl down` (killed now): {forced}"


# ============================================================================ the test


def state_records(state_dir: Path) -> dict[str, SlotStateRecord]:
    records = {}
    for path in sorted((state_dir / "slots").glob("*/state.json")):
        data = json.loads(path.read_bytes())
        record = SlotStateRecord.model_validate(data)
        assert record.name == path.parent.name, path
        records[record.name] = record
    return records


def temp_files(state_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(state_dir)) for p in state_dir.rglob(".*.tmp"))


def mutate(h: Harness, core: list[SlotDecl], transient: list[SlotDecl]) -> str:
    """Move the desired state (or the host) a little; returns what it did."""
    rng = h.rng
    choice = rng.random()
    if choice < 0.35:  # recreate a few slots: their runtime config (argv) changes
        picked = rng.sample(core, k=rng.randint(1, 4))
        for slot in picked:
            slot.load_seconds = round(rng.uniform(0.0, 0.3), 2)
        h.apply_in_process(core + transient)
        return f"recreate {','.join(s.name for s in picked)}"
    if choice < 0.55:  # declare or prune the transient slots
        if transient:
            transient.clear()
            h.apply_in_process(core)
            return "prune transient slots"
        transient.extend(
            SlotDecl(f"extra-{i}", port, round(rng.uniform(0.0, 0.3), 2))
            for i, port in enumerate(free_ports(TRANSIENT_SLOTS))
        )
        h.apply_in_process(core + transient)
        return "declare transient slots"
    if choice < 0.7:  # a server crashes while the controller is down or busy
        procs = [p for ps in owned_processes(h.state_dir).values() for p in ps]
        victims = rng.sample(procs, k=min(len(procs), rng.randint(1, 2)))
        for proc in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        return f"killed {len(victims)} server(s) by hand"
    return "no change"


def run_crash_loop(h: Harness, kills: int) -> None:
    rng = h.rng
    ports = free_ports(CORE_SLOTS)
    core = [
        SlotDecl(f"s{i:02d}", port, round(rng.uniform(0.0, 0.3), 2)) for i, port in enumerate(ports)
    ]
    transient: list[SlotDecl] = []
    stack = h.write_stack(core)

    # First lifetime: the stack is applied with --wait while the controller runs.
    h.start_up()
    h.wait_locked()
    apply = h.helper("stack", "apply", stack, "--prune", "--wait", "--timeout", "600")
    assert apply.stdout is not None
    for raw in apply.stdout:  # the config is written once "configured:" is printed
        if raw.startswith(b"configured:"):
            break
    time.sleep(rng.uniform(0.0, MAX_KILL_DELAY_S))
    h.kill_controller()
    apply.kill()
    done = 1
    history = ["initial apply"]

    # The other kill points: a fresh controller each time, killed after a random delay
    # measured from its start (interpreter start, imports, lock) or, every other time,
    # from the moment it holds the lock (recover/adopt, API start, loads, recreates,
    # prunes). The desired state moves while no controller runs, and while one does.
    while done < kills:
        if rng.random() < 0.25:
            history.append(mutate(h, core, transient))
        controller = h.start_up()
        anchor = controller.started
        if rng.random() < 0.5:
            h.wait_locked()
            anchor = time.monotonic()
        if rng.random() < 0.25:
            history.append(mutate(h, core, transient))
        delay = rng.uniform(0.0, MAX_KILL_DELAY_S)
        time.sleep(max(0.0, anchor + delay - time.monotonic()))
        h.kill_controller()
        done += 1
    print(f"{done} kill points; last changes: {history[-5:]}")

    # The final controller must converge on the (original port, current args) stack.
    h.start_up()
    h.wait_locked()
    stack = h.write_stack(core)
    result = h.slotctl("stack", "apply", stack, "--prune", "--wait", "--timeout", "90")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{h.tail()}"
    time.sleep(1.5)  # let the final controller run a bit (monitor ticks, orphan reaping)
    diff = h.slotctl("stack", "diff", stack, "--exit-code")
    assert diff.returncode == 0, f"{diff.stdout}\n{diff.stderr}\n{h.tail()}"
    check_converged(h, core)


def check_converged(h: Harness, core: list[SlotDecl]) -> None:
    declared = {s.name for s in core}
    records = state_records(h.state_dir)  # every state.json parses
    not_ready = {n: (r.state.value, r.message) for n, r in records.items() if n in declared}
    not_ready = {n: v for n, v in not_ready.items() if v[0] != "ready"}
    assert not not_ready, f"autoload slots not ready: {not_ready}\n{h.tail()}"
    assert declared <= set(records), f"no state.json for {declared - set(records)}"

    servers = owned_processes(h.state_dir)
    orphans = {slot: [p.pid for p in ps] for slot, ps in servers.items() if slot not in declared}
    assert not orphans, f"servers for undeclared slots: {orphans}"
    for name in sorted(declared):
        pids = [p.pid for p in servers.get(name, [])]
        assert len(pids) == 1, f"slot {name}: {len(pids)} live servers {pids}\n{h.tail()}"
        record = json.loads((h.state_dir / "slots" / name / "process.json").read_bytes())
        assert record["pid"] == pids[0], f"slot {name}: process.json {record} vs live {pids}"
        port = next(s.port for s in core if s.name == name)
        assert record["port"] == port

    leftovers = temp_files(h.state_dir)
    assert not leftovers, f"temp files of killed writers left in the state dir: {leftovers}"


def finish(h: Harness) -> None:
    """``slotctl down`` with the same dirs stops the controller and every server."""
    controller = h.controller
    result = h.down()
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert controller is not None and controller.proc.returncode == 0, h.tail()
    deadline = time.monotonic() + 10
    while (left := owned_processes(h.state_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"servers still running after `slotctl down`: {left}"


@pytest.mark.timeout(480)  # about 1 min alone, 3 in a parallel run on 2 loaded cores
def test_converges_after_50_controller_kills(harness: Harness) -> None:
    run_crash_loop(harness, kills=50)
    finish(harness)


@pytest.mark.slow
@pytest.mark.skipif(not SOAK, reason="soak run: SLOTCTL_SOAK=1 (make soak)")
@pytest.mark.timeout(1800)
def test_converges_after_300_controller_kills_soak(harness: Harness) -> None:
    run_crash_loop(harness, kills=300)
    finish(harness)


# ============================================================================ regressions
# Deterministic versions of crash points the kill loop (the first) or a review of the
# recovery paths (the others) found; each failed before its fix in ``controller/``.


def server_pids(h: Harness) -> dict[str, int]:
    out = {}
    for slot, procs in owned_processes(h.state_dir).items():
        assert len(procs) == 1, f"slot {slot}: {[p.pid for p in procs]}"
        out[slot] = procs[0].pid
    return out


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a reparented server may wait a while to be reaped)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
def test_config_changed_while_the_controller_was_down_recreates_the_server(
    harness: Harness,
) -> None:
    """The next controller adopts the old server, then recreates it: before the fix the
    adopted slot reported the *declared* config hash, so nothing ever recreated it and
    ``apply --wait`` never converged."""
    h = harness
    a, b = (SlotDecl(n, p, 0.1) for n, p in zip("ab", free_ports(2), strict=True))
    h.start_up()
    h.wait_locked()
    result = h.slotctl("stack", "apply", h.write_stack([a, b]), "--wait", "--timeout", "30")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{h.tail()}"
    before = server_pids(h)
    h.kill_controller()

    a.load_seconds = 0.2  # a new argv for a, while no controller runs
    result = h.slotctl("stack", "apply", h.write_stack([a, b]))
    assert result.returncode == 0, result.stderr
    h.start_up()
    h.wait_locked()
    result = h.slotctl("stack", "apply", h.stack_dir / "crash.toml", "--wait", "--timeout", "30")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{h.tail()}"
    after = server_pids(h)
    assert after["a"] != before["a"], "the outdated server of a was not replaced"
    assert after["b"] == before["b"], "b did not change: it must keep its server"
    check_converged(h, [a, b])
    finish(h)


@pytest.mark.timeout(120)
def test_port_changed_while_a_killed_controller_was_loading(harness: Harness) -> None:
    """An adopted, still-loading server whose config (here: its port) changed meanwhile is
    replaced at once: before the fix the restarted controller probed the *new* port,
    where nothing listens, and waited for ``warmup_timeout_s`` holding the slot."""
    h = harness
    old_port, new_port = free_ports(2)
    slot = SlotDecl("slow", old_port, 8.0)
    h.start_up()
    h.wait_locked()
    result = h.slotctl("stack", "apply", h.write_stack([slot]))
    assert result.returncode == 0, result.stderr
    wait_until(lambda: "slow" in owned_processes(h.state_dir), "the server to be spawned")
    h.kill_controller()  # mid-load: the server is up but lists no model for 8 s
    (old,) = owned_processes(h.state_dir)["slow"]

    slot.port, slot.load_seconds = new_port, 0.1
    result = h.slotctl("stack", "apply", h.write_stack([slot]))
    assert result.returncode == 0, result.stderr
    h.start_up()
    h.wait_locked()
    result = h.slotctl("stack", "apply", h.stack_dir / "crash.toml", "--wait", "--timeout", "20")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{h.tail()}"
    assert not alive(old), "the outdated server still runs"
    check_converged(h, [slot])
    finish(h)


@pytest.mark.timeout(60)
def test_temp_files_of_interrupted_writes_are_swept(harness: Harness) -> None:
    """A writer SIGKILLed between its temp file and the rename leaves ``.NAME.*.tmp``;
    the next controller (the lock holder) removes them."""
    h = harness
    slot_dir = h.state_dir / "slots" / "gone"
    slot_dir.mkdir(parents=True)
    leftovers = [
        slot_dir / ".state.json.k1ll3d.tmp",
        slot_dir / ".process.json.k1ll3d.tmp",
        h.state_dir / ".controller.json.k1ll3d.tmp",
    ]
    for path in leftovers:
        path.write_text('{"torn": ')
    h.start_up()
    h.wait_locked()
    # Until the token is written (before the API listens): a leftover swept before the
    # controller's own first writes would otherwise read as "none left" too early.
    wait_until(lambda: (h.state_dir / "token").exists(), "the API token", timeout=30)
    # A temp file of a write the new controller itself has in flight (its state) may show
    # for an instant, and another may follow it: what must hold is that none stays, and
    # that the leftovers are gone for good. (Reading twice raced a write that began
    # between the loop's last look and the assertion's.)
    deadline = time.monotonic() + 10
    seen = temp_files(h.state_dir)
    while seen and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = temp_files(h.state_dir)
    assert seen == []
    assert [p for p in leftovers if p.exists()] == []
    finish(h)


def listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(120)
def test_server_spawned_by_a_controller_killed_before_recording_it(harness: Harness) -> None:
    """A controller killed between spawning a server and writing its process.json leaves
    a live, labelled server behind a *stale* record (of a server that died earlier). The
    next controller must find it by its labels and stop it (its config is outdated by
    now): before the fix the stale record hid it, the slot went to ``error`` and every
    start failed with "already runs a server with another config" for ever."""
    h = harness
    (port,) = free_ports(1)
    slot = SlotDecl("rec", port, 0.1)
    h.start_up()
    h.wait_locked()
    result = h.slotctl("stack", "apply", h.write_stack([slot]), "--wait", "--timeout", "30")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{h.tail()}"
    h.kill_controller()

    record = json.loads((h.state_dir / "slots" / "rec" / "process.json").read_bytes())
    (recorded,) = owned_processes(h.state_dir)["rec"]
    assert recorded.pid == record["pid"]
    recorded.kill()  # the recorded server dies ...
    wait_until(lambda: not listening(port), "the recorded server to exit")
    labels = {
        "SLOTCTL_MANAGED": "true",
        "SLOTCTL_SLOT": "rec",
        "SLOTCTL_STACK": "crash",
        "SLOTCTL_CONFIG_HASH": record["config_hash"],
        "SLOTCTL_OWNER": str(h.state_dir),
        "SLOTCTL_PORT": str(port),
    }
    unrecorded = subprocess.Popen(  # ... and a later controller's start is never recorded
        record["argv"],
        env=h.env | labels,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    h.helpers.append(unrecorded)
    wait_until(lambda: listening(port), "the unrecorded server to listen")

    slot.load_seconds = 0.2  # its config is outdated by the time a controller runs again
    result = h.slotctl("stack", "apply", h.write_stack([slot]))
    assert result.returncode == 0, result.stderr
    h.start_up()
    h.wait_locked()
    result = h.slotctl("stack", "apply", h.stack_dir / "crash.toml", "--wait", "--timeout", "30")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{h.tail()}"
    wait_until(lambda: unrecorded.poll() is not None, "the unrecorded server to be stopped")
    check_converged(h, [slot])
    finish(h)
