"""The declarative workflow on the Docker runtime, against a real engine (SPEC §3, §4, §8).

The CLI runs as subprocesses (``slotctl up --runtime docker``, ``stack apply --wait``,
``stack diff --exit-code``, ``down``) with ``DOCKER_HOST`` pointing at the test engine
(``docker_engine``: the host's, or a private ``dockerd``) and
``SLOTCTL_DOCKER_MOUNTS=/usr:/usr,/etc:/etc`` so the tiny test image
(``docker_test_image``) runs the host's interpreter and the demo server. One test walks
the whole story on a 3-slot demo stack:

1. ``up`` + ``apply --wait``: every slot ``ready``, one labelled container each;
   ``diff --exit-code`` 0;
2. a container killed by hand (``docker kill`` through the SDK): ``diff`` 1, the
   controller replaces it (a new container), ``diff`` 0 again;
3. one slot's ``extra_args`` changed: only that slot's container is recreated;
4. the controller SIGKILLed at a few random moments and restarted: converges again with
   exactly one container per slot (listed by the ``slotctl.slot`` label);
5. ``down`` removes every managed container.

Containers of the test's stack are force-removed by the ``docker_stack`` fixture whatever
happens.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import pytest

from controller.store.lock import ControllerLock
from tests.e2e.conftest import wait_until
from tests.integration.docker_engine import Engine
from tests.integration.helpers import free_ports

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
SLOTS = ("alpha", "beta", "gamma")
T = TypeVar("T")


@dataclass
class DockerSlot:
    name: str
    port: int
    extra_args: list[str] = field(default_factory=lambda: ["--load-seconds", "0.2"])


def render(stack: str, image: str, slots: list[DockerSlot]) -> str:
    out = [f'[stack]\nname = "{stack}"\n']
    for slot in slots:
        out.append(f'\n[[model]]\nid = "m-{slot.name}"\nsource = "demo://{slot.name}"\n')
    for slot in slots:
        args = ", ".join(f'"{a}"' for a in slot.extra_args)
        out.append(
            f'\n[[slot]]\nname = "{slot.name}"\nprovider = "demo"\n'
            f'model.default = "m-{slot.name}"\ndevice = "cpu"\nport = {slot.port}\n'
            "autoload = true\n"
            f'[slot.server]\nimage = "{image}"\nextra_args = [{args}]\n'
        )
    return "".join(out)


@dataclass
class Workflow:
    root: Path
    engine: Engine
    client: Any
    stack: str
    image: str
    rng: random.Random
    slots: list[DockerSlot] = field(init=False)
    controller: subprocess.Popen[bytes] | None = None
    log: IO[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.config_dir = self.root / "config"
        self.state_dir = self.root / "state"
        self.stack_file = self.root / "stack" / f"{self.stack}.toml"
        self.stack_file.parent.mkdir(parents=True)
        self.log_path = self.root / "controller.log"
        self.log = self.log_path.open("ab")
        self.slots = [DockerSlot(n, p) for n, p in zip(SLOTS, free_ports(len(SLOTS)), strict=True)]

    # ------------------------------------------------------------------ the CLI

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTCTL_")}
        env |= {
            "PYTHONPATH": str(REPO),
            "NO_COLOR": "1",
            "DOCKER_HOST": self.engine.base_url,
            "SLOTCTL_DOCKER_MOUNTS": "/usr:/usr,/etc:/etc",
        }
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
            "--runtime",
            "docker",
            *map(str, args),
        ]

    def run(self, *args: str | Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args), capture_output=True, text=True, timeout=timeout, env=self.env
        )

    def explain(self, result: subprocess.CompletedProcess[str]) -> str:
        return f"exit {result.returncode}\n{result.stdout}\n{result.stderr}\n--- up\n{self.tail()}"

    def tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def write_stack(self) -> Path:
        self.stack_file.write_text(render(self.stack, self.image, self.slots))
        return self.stack_file

    def apply_wait(self) -> str:
        result = self.run("stack", "apply", self.write_stack(), "--wait", "--timeout", "120")
        assert result.returncode == 0, self.explain(result)
        return result.stdout

    def diff(self) -> int:
        result = self.run("stack", "diff", self.stack_file, "--exit-code", timeout=60)
        assert result.returncode in (0, 1), self.explain(result)
        return result.returncode

    # ------------------------------------------------------------------ the controller

    def start_up(self) -> subprocess.Popen[bytes]:
        assert self.controller is None
        self.log.write(b"\n===== slotctl up\n")
        self.log.flush()
        self.controller = subprocess.Popen(
            self.argv("up", "--listen", "127.0.0.1:0"),
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        return self.controller

    def wait_locked(self) -> None:
        proc = self.controller
        assert proc is not None

        def locked() -> bool:
            assert proc.poll() is None, f"slotctl up exited:\n{self.tail()}"
            record = ControllerLock(self.state_dir).running()
            return record is not None and record.pid == proc.pid

        wait_until(locked, "the controller to take the state dir's lock", timeout=30, every=0.05)

    def kill_controller(self) -> None:
        proc, self.controller = self.controller, None
        assert proc is not None
        code = proc.poll()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert code is None, f"the controller exited on its own ({code}):\n{self.tail()}"

    def down(self) -> subprocess.CompletedProcess[str]:
        """``slotctl down``; reaps our controller (a zombie child otherwise) meanwhile."""
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
                controller.wait(90)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            if controller is not None and controller.poll() is None:
                controller.kill()
                controller.wait(10)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # ------------------------------------------------------------------ containers

    def containers(self) -> dict[str, list[Any]]:
        """Every container (any status) labelled ``slotctl.slot``, for this stack, by slot."""
        found: dict[str, list[Any]] = {}
        for container in self.client.containers.list(
            all=True, filters={"label": f"slotctl.stack={self.stack}"}, ignore_removed=True
        ):
            labels = container.attrs["Config"]["Labels"] or {}
            slot = labels.get("slotctl.slot")
            if slot:
                found.setdefault(slot, []).append(container)
        return found

    def ids(self) -> dict[str, str]:
        """slot -> id of its one running container (asserts there is exactly one)."""
        out = {}
        for slot, containers in self.containers().items():
            assert len(containers) == 1, f"slot {slot}: {[c.name for c in containers]}"
            (container,) = containers
            assert container.status == "running", f"{container.name}: {container.status}"
            assert container.name == f"slotctl-{slot}"
            out[slot] = str(container.id)
        return out

    def close(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.down()
        self.log.close()


@pytest.fixture
def workflow(
    tmp_path: Path, docker_engine: Engine, docker_client: Any, docker_test_image: str,
    docker_stack: str,
) -> Iterator[Workflow]:  # fmt: skip
    seed = int(os.environ.get("SLOTCTL_DOCKER_SEED") or random.SystemRandom().randrange(2**32))
    print(f"docker workflow seed: SLOTCTL_DOCKER_SEED={seed}")
    flow = Workflow(
        tmp_path, docker_engine, docker_client, docker_stack, docker_test_image, random.Random(seed)
    )
    try:
        yield flow
    finally:
        flow.close()  # docker_stack then force-removes whatever is left of the stack


def kill_container_until_drift(flow: Workflow, slot: str) -> str:
    """``docker kill`` the slot's container; ``diff`` must see the drift (exit 1).

    The controller replaces a killed container within about a second; should it win the
    race against the ``diff`` subprocess (a new container already runs), kill again. On a
    loaded machine (the suite's other workers, other jobs) a subprocess's start can take
    longer than that second several times in a row: up to eight tries.
    """
    for _ in range(8):
        killed = flow.ids()[slot]
        flow.client.containers.get(killed).kill()
        if flow.diff() == 1:
            return killed
        assert flow.ids()[slot] != killed, "diff says in sync while the killed container is gone"
    raise AssertionError("the controller always replaced the container before diff ran")


@pytest.mark.timeout(300)
def test_docker_workflow(workflow: Workflow) -> None:
    flow = workflow
    declared = set(SLOTS)

    # 1. up + apply --wait: ready, one container per slot, in sync.
    flow.start_up()
    flow.wait_locked()
    flow.apply_wait()
    first = flow.ids()
    assert set(first) == declared
    assert flow.diff() == 0

    # 2. A container killed by hand: drift, then the controller replaces it.
    victim = flow.rng.choice(SLOTS)
    killed = kill_container_until_drift(flow, victim)
    wait_until(lambda: flow.diff() == 0, "diff to report in sync again", timeout=90, every=0.5)
    after_kill = flow.ids()
    assert after_kill[victim] != killed
    assert {s: i for s, i in after_kill.items() if s != victim} == {
        s: i for s, i in first.items() if s != victim
    }

    # 3. One slot's extra_args changed: only its container is recreated.
    changed = flow.rng.choice(SLOTS)
    next(s for s in flow.slots if s.name == changed).extra_args = ["--load-seconds", "0.3"]
    out = flow.apply_wait()
    assert "recreate" in out and changed in out, out
    recreated = flow.ids()
    assert {s for s in SLOTS if recreated[s] != after_kill[s]} == {changed}
    assert flow.diff() == 0

    # 4. kill -9 of the controller at random moments (while the desired state moves).
    time.sleep(flow.rng.uniform(0.0, 1.0))
    flow.kill_controller()  # the first one, while it keeps everything in sync
    for _ in range(4):
        if flow.rng.random() < 0.5:
            slot = flow.rng.choice(flow.slots)
            slot.extra_args = ["--load-seconds", f"{flow.rng.uniform(0.0, 0.5):.2f}"]
            flow.write_stack()
            result = flow.run("stack", "apply", flow.stack_file)
            assert result.returncode == 0, flow.explain(result)
        flow.start_up()
        if flow.rng.random() < 0.5:
            flow.wait_locked()
        time.sleep(flow.rng.uniform(0.0, 2.0))
        flow.kill_controller()
    flow.start_up()
    flow.wait_locked()
    flow.apply_wait()
    containers = flow.containers()
    assert set(containers) == declared, f"containers of undeclared slots: {set(containers)}"
    duplicates = {s: [c.name for c in cs] for s, cs in containers.items() if len(cs) != 1}
    assert not duplicates, f"more than one container for a slot: {duplicates}"
    assert set(flow.ids()) == declared
    assert flow.diff() == 0

    # 5. down stops the controller and removes every managed container.
    controller = flow.controller
    result = flow.down()
    assert result.returncode == 0, flow.explain(result)
    assert controller is not None and controller.returncode == 0, flow.tail()
    left = flow.client.containers.list(
        all=True, filters={"label": "slotctl.managed=true"}, ignore_removed=True
    )
    assert not [c.name for c in left if c.labels.get("slotctl.stack") == flow.stack]
