"""The docker runtime against a real engine, with the demo server as the slot's server.

Each test runs ``python -m controller.demo`` in a container of the tiny imported image
(``docker_test_image``): the demo provider mounts the host's Python and this package
read-only, the runtime adds ``/usr`` and ``/etc`` as base mounts, and the container uses
the host network, so the server answers on ``127.0.0.1:<port>``. Every container a test
makes carries its ``docker_stack`` name and is removed afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import docker.errors
import psutil
import pytest

from controller.model.errors import SlotctlError, SlotSpawnFailed
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.runtime.base import (
    HASH_LABEL,
    MANAGED_LABEL,
    SLOT_LABEL,
    STACK_LABEL,
    LaunchSpec,
    Mount,
    Observed,
    RunStatus,
    Runtime,
)
from controller.runtime.docker.runtime import (
    PORT_LABEL,
    DockerEngineError,
    DockerRuntime,
    DockerUnavailable,
    container_name,
    device_options,
)
from controller.runtime.docker.spec import mounts_for
from controller.spec.schema import ModelSpec, SlotSpec
from tests.integration.docker_engine import TEST_LABEL, Engine

pytestmark = pytest.mark.docker

BASE_MOUNTS = (Mount("/usr", "/usr"), Mount("/etc", "/etc"))
MODEL = "m"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def demo_launch(slot: str, stack: str, image: str, extra_args: Sequence[str] = ()) -> LaunchSpec:
    spec = SlotSpec.model_validate(
        {
            "name": slot,
            "provider": "demo",
            "port": free_port(),
            "model": {"default": MODEL},
            "device": "cpu",
            "server": {"image": image, "extra_args": list(extra_args)},
        }
    )
    model = ModelSpec(id=MODEL, source=f"demo://{MODEL}")
    return build_launch(spec, model, BuildContext(runtime="docker", stack=stack))


async def eventually(
    check: Callable[[], Awaitable[Any]], *, timeout: float = 20.0, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns something truthy (50 ms, then 200 ms steps)."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.2)


async def models_listed(endpoint: str) -> list[str] | None:
    """The ids ``/v1/models`` lists, or None while the server does not answer."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{endpoint}/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as resp,
        ):
            if resp.status != 200:
                return None
            body = await resp.json()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return [str(item["id"]) for item in body.get("data", [])]


async def wait_listed(endpoint: str, timeout: float = 20.0) -> list[str]:
    async def check() -> list[str] | None:
        listed = await models_listed(endpoint)
        return listed if listed else None

    result: list[str] = await eventually(check, timeout=timeout, what=f"{endpoint} models")
    return result


async def wait_exited(runtime: DockerRuntime, slot: str, timeout: float = 20.0) -> Observed:
    async def check() -> Observed | None:
        observed = await runtime.inspect(slot)
        return observed if observed.status is RunStatus.EXITED else None

    result: Observed = await eventually(check, timeout=timeout, what=f"{slot} to exit")
    return result


async def complete(endpoint: str) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{endpoint}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            timeout=aiohttp.ClientTimeout(total=5),
        ) as resp,
    ):
        await resp.read()
        return resp.status


@pytest.fixture
async def make_runtime(docker_engine: Engine) -> AsyncIterator[Callable[..., DockerRuntime]]:
    """``make_runtime(**options)``: a DockerRuntime on the test engine, closed afterwards."""
    made: list[DockerRuntime] = []

    def make(base_url: str | None = None, **options: Any) -> DockerRuntime:
        options.setdefault("base_mounts", BASE_MOUNTS)
        made.append(DockerRuntime(base_url or docker_engine.base_url, **options))
        return made[-1]

    yield make
    for runtime in made:
        await runtime.close()


@pytest.fixture
def runtime(make_runtime: Callable[..., DockerRuntime]) -> DockerRuntime:
    return make_runtime()


@pytest.fixture
def launch_for(docker_stack: str, docker_test_image: str) -> Callable[..., LaunchSpec]:
    """``launch_for(name, *extra_args)``: a demo LaunchSpec for a slot unique to the test."""

    def make(name: str, *extra_args: str) -> LaunchSpec:
        return demo_launch(f"{name}-{docker_stack}", docker_stack, docker_test_image, extra_args)

    return make


# --------------------------------------------------------------------------- basics


def test_runtime_satisfies_protocol() -> None:
    runtime = DockerRuntime("unix:///nonexistent/docker.sock")  # lazy: connects on use
    assert isinstance(runtime, Runtime)
    assert runtime.kind == "docker"
    assert runtime.engine == "unix:///nonexistent/docker.sock"


async def test_start_serves_with_labels_and_stop_removes(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec], docker_client: Any
) -> None:
    launch = launch_for("basic")
    before = time.time()
    started = await runtime.start(launch)
    assert started.running and started.managed
    assert started.endpoint == f"http://127.0.0.1:{launch.port}"
    assert started.config_hash == launch.config_hash()
    assert started.stack == launch.stack
    assert started.started_at is not None and abs(started.started_at - before) < 30

    assert await wait_listed(launch.endpoint) == [MODEL]

    container = docker_client.containers.get(container_name(launch.slot))
    labels = container.labels
    assert labels[MANAGED_LABEL] == "true"
    assert labels[SLOT_LABEL] == launch.slot
    assert labels[STACK_LABEL] == launch.stack
    assert labels[HASH_LABEL] == launch.config_hash()
    assert labels[PORT_LABEL] == str(launch.port)
    host = container.attrs["HostConfig"]
    assert host["RestartPolicy"]["Name"] in ("no", "")
    assert host["NetworkMode"] == "host"
    assert host["Init"] is True
    binds = {m["Destination"]: m for m in container.attrs["Mounts"]}
    assert {"/usr", "/etc"} <= set(binds)
    assert all(not m["RW"] for m in binds.values())

    inspected = await runtime.inspect(launch.slot)
    assert inspected.running and inspected.ident == started.ident
    assert inspected.started_at == pytest.approx(started.started_at, abs=1e-3)

    stopped = await runtime.stop(launch.slot, timeout=5)
    assert stopped.status is RunStatus.EXITED and stopped.exit_code == 0
    assert (await runtime.inspect(launch.slot)).status is RunStatus.MISSING
    assert (await runtime.stop(launch.slot, timeout=1)).status is RunStatus.MISSING
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(container_name(launch.slot))


async def test_adoption_by_a_second_runtime(
    runtime: DockerRuntime,
    make_runtime: Callable[..., DockerRuntime],
    launch_for: Callable[..., LaunchSpec],
    docker_client: Any,
) -> None:
    launch = launch_for("adopt")
    started = await runtime.start(launch)
    await wait_listed(launch.endpoint)

    other = make_runtime()  # as if the controller restarted
    seen = await other.inspect(launch.slot)
    assert seen.running and seen.ident == started.ident
    assert seen.config_hash == launch.config_hash()
    assert seen.endpoint == launch.endpoint

    adopted = await other.start(launch)
    assert adopted.ident == started.ident
    named = docker_client.containers.list(
        all=True, filters={"name": container_name(launch.slot), "label": MANAGED_LABEL}
    )
    assert [c.id for c in named] == [started.ident]
    assert await models_listed(launch.endpoint) == [MODEL]

    managed = [o.slot for o in await other.list_managed()]
    assert launch.slot in managed


async def test_start_refuses_a_running_container_with_another_config(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    launch = launch_for("rehash")
    started = await runtime.start(launch)
    changed = demo_launch(launch.slot, launch.stack, launch.image or "", ["--load-seconds", "0.1"])
    with pytest.raises(SlotSpawnFailed, match="another config"):
        await runtime.start(changed)
    assert (await runtime.inspect(launch.slot)).ident == started.ident


async def test_exited_container_is_replaced_on_start(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    failing = launch_for("replace", "--fail-on-load")
    first = await runtime.start(failing)
    await wait_exited(runtime, failing.slot)
    healthy = demo_launch(failing.slot, failing.stack, failing.image or "")
    second = await runtime.start(healthy)
    assert second.running and second.ident != first.ident
    assert await wait_listed(healthy.endpoint) == [MODEL]


async def test_stop_escalates_to_kill(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    launch = launch_for("slow", "--slow-stop", "5")
    await runtime.start(launch)
    await wait_listed(launch.endpoint)
    began = time.monotonic()
    stopped = await runtime.stop(launch.slot, timeout=1)
    elapsed = time.monotonic() - began
    assert elapsed < 4, f"stop took {elapsed:.1f}s: it waited for the slow stop"
    assert stopped.status is RunStatus.EXITED
    assert stopped.exit_code == 137, stopped  # SIGKILL
    assert (await runtime.inspect(launch.slot)).status is RunStatus.MISSING


async def test_a_stopped_container_is_killed_after_the_stop_timeout(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec], docker_client: Any
) -> None:
    """A hung server in a container (its processes stopped with SIGSTOP: the engine's
    SIGTERM stays pending) is stopped all the same: SIGKILL after the timeout (issue 26)."""
    launch = launch_for("frozen")
    await runtime.start(launch)
    await wait_listed(launch.endpoint)
    container = docker_client.containers.get(container_name(launch.slot))
    init = psutil.Process(int(container.attrs["State"]["Pid"]))
    for proc in [init, *init.children(recursive=True)]:
        proc.send_signal(signal.SIGSTOP)
    began = time.monotonic()
    stopped = await runtime.stop(launch.slot, timeout=1)
    elapsed = time.monotonic() - began
    assert elapsed < 8, elapsed
    assert stopped.status is RunStatus.EXITED
    assert stopped.exit_code == 137, stopped  # SIGKILL
    assert (await runtime.inspect(launch.slot)).status is RunStatus.MISSING
    assert not init.is_running() or init.status() == psutil.STATUS_ZOMBIE


# --------------------------------------------------------------------------- faults


async def test_fail_on_load_exits_1_with_the_error_in_logs(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    launch = launch_for("fail", "--fail-on-load")
    await runtime.start(launch)
    exited = await wait_exited(runtime, launch.slot)
    assert exited.exit_code == 1
    assert exited.managed and "code 1" in exited.message
    lines = await runtime.logs(launch.slot)
    assert any("--fail-on-load" in line and "error" in line for line in lines), lines
    assert len(await runtime.logs(launch.slot, tail=1)) == 1


async def test_empty_models_comes_up_with_nothing_listed(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    launch = launch_for("empty", "--empty-models")
    await runtime.start(launch)

    async def loaded() -> bool:
        return any("without a model" in line for line in await runtime.logs(launch.slot))

    await eventually(loaded, what="the demo server to finish loading")
    assert await models_listed(launch.endpoint) == []
    assert (await runtime.inspect(launch.slot)).running


async def test_crash_after_exits_while_serving(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    launch = launch_for("crash", "--crash-after", "1")
    await runtime.start(launch)
    await wait_listed(launch.endpoint)
    assert await complete(launch.endpoint) == 200
    with pytest.raises(aiohttp.ClientError):
        await complete(launch.endpoint)
    exited = await wait_exited(runtime, launch.slot)
    assert exited.exit_code not in (None, 0)


# --------------------------------------------------------------------------- ownership


async def test_unlabelled_container_is_reported_and_never_touched(
    runtime: DockerRuntime,
    launch_for: Callable[..., LaunchSpec],
    docker_client: Any,
    docker_stack: str,
    docker_test_image: str,
) -> None:
    launch = launch_for("foreign")
    foreign = docker_client.containers.run(
        docker_test_image,
        ["/usr/bin/sleep", "300"],
        name=container_name(launch.slot),
        labels={TEST_LABEL: docker_stack},
        volumes={"/usr": {"bind": "/usr", "mode": "ro"}},
        network_mode="host",
        init=True,
        detach=True,
    )
    observed = await runtime.inspect(launch.slot)
    assert observed.managed is False and observed.running
    assert observed.ident == foreign.id
    assert "not managed" in observed.message

    with pytest.raises(SlotSpawnFailed, match="unmanaged container holds the name"):
        await runtime.start(launch)
    stopped = await runtime.stop(launch.slot, timeout=1)
    assert stopped.managed is False and stopped.running
    assert await runtime.logs(launch.slot) == []

    foreign.reload()
    assert foreign.status == "running"
    assert launch.slot not in [o.slot for o in await runtime.list_managed()]


async def test_list_managed_returns_only_labelled_containers(
    runtime: DockerRuntime,
    launch_for: Callable[..., LaunchSpec],
    docker_client: Any,
    docker_stack: str,
    docker_test_image: str,
) -> None:
    one, two = launch_for("list-a"), launch_for("list-b", "--fail-on-load")
    await runtime.start(one)
    await runtime.start(two)
    await wait_exited(runtime, two.slot)
    docker_client.containers.create(
        docker_test_image,
        ["/usr/bin/true"],
        name=container_name(f"list-c-{docker_stack}"),
        labels={TEST_LABEL: docker_stack},
    )
    mine = [o for o in await runtime.list_managed() if o.stack == docker_stack]
    assert [(o.slot, o.status) for o in mine] == [
        (one.slot, RunStatus.RUNNING),
        (two.slot, RunStatus.EXITED),
    ]
    assert all(o.managed and o.config_hash for o in mine)


async def test_two_owners_on_one_engine_never_touch_each_other(
    make_runtime: Callable[..., DockerRuntime],
    launch_for: Callable[..., LaunchSpec],
    docker_stack: str,
) -> None:
    """Two controllers (state dirs) on one engine: each sees only its own containers."""
    ours = make_runtime(owner=f"/var/lib/a-{docker_stack}")
    theirs = make_runtime(owner=f"/var/lib/b-{docker_stack}")
    launch = launch_for("owned")
    started = await ours.start(launch)
    assert started.running and started.managed
    assert [o.slot for o in await ours.list_managed() if o.stack == docker_stack] == [launch.slot]
    assert [o for o in await theirs.list_managed() if o.stack == docker_stack] == []
    seen = await theirs.inspect(launch.slot)
    assert not seen.managed and "not managed by this controller" in seen.message
    stopped = await theirs.stop(launch.slot, timeout=1)
    assert not stopped.managed
    assert await theirs.logs(launch.slot) == []
    with pytest.raises(SlotSpawnFailed):
        await theirs.start(launch)
    still = await ours.inspect(launch.slot)
    assert still.running and still.ident == started.ident
    assert (await ours.stop(launch.slot, timeout=5)).status is RunStatus.EXITED


# --------------------------------------------------------------------------- images


async def test_needs_prepare_and_pull_failure(
    runtime: DockerRuntime,
    make_runtime: Callable[..., DockerRuntime],
    launch_for: Callable[..., LaunchSpec],
) -> None:
    launch = launch_for("pull")
    assert await runtime.needs_prepare(launch) is False
    await runtime.prepare(launch)  # present: a no-op

    # A registry on a closed local port: refused at once, no internet needed.
    missing = LaunchSpec(
        slot=launch.slot,
        stack=launch.stack,
        provider="demo",
        port=launch.port,
        device="cpu",
        model_id=MODEL,
        argv=launch.argv,
        image="127.0.0.1:9/slotctl-test/nonexistent:1",
    )
    assert await runtime.needs_prepare(missing) is True
    events: list[dict[str, Any]] = []
    short = make_runtime(pull_timeout_s=20)
    began = time.monotonic()
    with pytest.raises(SlotSpawnFailed) as caught:
        await short.prepare(missing, events.append)
    assert time.monotonic() - began < 20
    message = str(caught.value)
    assert "127.0.0.1:9/slotctl-test/nonexistent" in message
    assert "connection refused" in message.lower() or "dial tcp" in message.lower(), message
    assert caught.value.code == "slot.spawn_failed"

    with pytest.raises(SlotSpawnFailed, match="not present locally"):
        await short.start(missing)
    assert (await short.inspect(missing.slot)).status is RunStatus.MISSING


async def test_start_without_image_fails() -> None:
    runtime = DockerRuntime("unix:///nonexistent/docker.sock")  # fails before any call
    launch = LaunchSpec(
        slot="noimage", stack="x", provider="demo", port=1, device="cpu", model_id="m", argv=()
    )
    with pytest.raises(SlotSpawnFailed, match="no container image"):
        await runtime.start(launch)
    with pytest.raises(SlotSpawnFailed, match="no container image"):
        await runtime.prepare(launch)


# --------------------------------------------------------------------------- engine down


async def test_unreachable_engine_gives_typed_errors(tmp_path: Any) -> None:
    socket_url = f"unix://{tmp_path}/nothing.sock"
    dead = DockerRuntime(socket_url)
    try:
        await _check_unreachable(dead, socket_url)
    finally:
        await dead.close()


async def _check_unreachable(dead: DockerRuntime, socket_url: str) -> None:
    launch = demo_launch("dead", "x", "slotctl-test/base:1")
    with pytest.raises(SlotSpawnFailed, match="unreachable") as spawn:
        await dead.start(launch)
    assert socket_url in str(spawn.value)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: dead.inspect(launch.slot),
        lambda: dead.stop(launch.slot, 1),
        dead.list_managed,
        lambda: dead.logs(launch.slot),
        lambda: dead.needs_prepare(launch),
    ]
    for call in calls:
        with pytest.raises(DockerUnavailable) as caught:
            await call()
        assert socket_url in str(caught.value)
        assert isinstance(caught.value, SlotctlError)
        assert caught.value.code == "runtime.unavailable"
    assert issubclass(DockerUnavailable, DockerEngineError)


# --------------------------------------------------------------------------- pure parts


def test_device_options() -> None:
    assert device_options("cpu", ["nvidia"]) == {}
    gpu = device_options("gpu", ["runc", "nvidia"], exists=lambda _: False)
    (request,) = gpu["device_requests"]
    assert request["Count"] == -1 and request["Capabilities"] == [["gpu"]]
    amd = device_options("gpu", ["runc"], exists=lambda _: True)
    assert amd == {"devices": ["/dev/kfd:/dev/kfd:rwm", "/dev/dri:/dev/dri:rwm"]}
    with pytest.raises(SlotSpawnFailed, match="refusing to run on the CPU"):
        device_options("gpu", ["runc"], exists=lambda _: False)
    with pytest.raises(SlotSpawnFailed, match="/dev/accel"):
        device_options("npu", [], exists=lambda _: False)


def test_model_file_is_mounted_once_read_only() -> None:
    runtime = DockerRuntime("unix:///nonexistent.sock", base_mounts=BASE_MOUNTS)
    base = LaunchSpec(
        slot="s",
        stack="x",
        provider="llamacpp",
        port=1,
        device="cpu",
        model_id="m",
        argv=(),
        image="img",
        model_path="/models/a.gguf",
    )
    mounts = mounts_for(base, runtime.docker.base_mounts)
    assert [m.target for m in mounts] == ["/usr", "/etc", "/models/a.gguf"]
    assert all(m.read_only for m in mounts)
    provided = dataclasses.replace(
        base, mounts=(Mount("/models/a.gguf", "/models/a.gguf"), Mount("/usr", "/usr"))
    )
    assert [m.target for m in mounts_for(provided, runtime.docker.base_mounts)] == [
        "/models/a.gguf",
        "/usr",
        "/etc",
    ]
    in_dir = dataclasses.replace(base, mounts=(Mount("/models", "/models"),))
    assert [m.target for m in mounts_for(in_dir, runtime.docker.base_mounts)] == [
        "/models",
        "/usr",
        "/etc",
    ]


class _FakePullApi:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    def pull(self, image: str, *, stream: bool, decode: bool) -> Any:
        assert stream and decode
        yield from self.events


class _FakeImages:
    def get(self, image: str) -> Any:
        raise docker.errors.ImageNotFound(f"No such image: {image}")


class _FakeClient:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.api = _FakePullApi(events)
        self.images = _FakeImages()


def _layer(layer: str, status: str, current: int, total: int) -> dict[str, Any]:
    return {"status": status, "id": layer, "progressDetail": {"current": current, "total": total}}


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_prepare_streams_aggregate_progress(asynchronous: bool) -> None:
    events = [
        {"status": "Pulling from org/server", "id": "1"},
        _layer("a", "Downloading", 10, 100),
        _layer("b", "Downloading", 5, 50),
        _layer("a", "Downloading", 100, 100),
        {"status": "Status: Downloaded newer image for org/server:1"},
    ]
    runtime = DockerRuntime(_FakeClient(events))
    launch = demo_launch("pull", "x", "org/server:1")
    seen: list[dict[str, Any]] = []

    async def record_async(event: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        seen.append(event)

    assert await runtime.needs_prepare(launch) is True
    await runtime.prepare(launch, record_async if asynchronous else seen.append)
    assert [(e["current"], e["total"]) for e in seen] == [
        (0, None),
        (10, 100),
        (15, 150),
        (105, 150),
        (105, 150),
    ]
    assert {e["slot"] for e in seen} == {"pull"} and seen[-1]["status"].startswith("Status:")


async def test_prepare_error_event_is_typed() -> None:
    events = [{"error": "manifest unknown", "errorDetail": {"message": "manifest unknown"}}]
    runtime = DockerRuntime(_FakeClient(events))
    with pytest.raises(SlotSpawnFailed, match="manifest unknown"):
        await runtime.prepare(demo_launch("pull", "x", "org/server:1"))


async def test_ready_line_in_the_container_log_wakes_the_probe(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    """The engine's log stream wakes the probe; the clock's schedule never fires."""
    from controller.probes.readiness import ProbeOutcome
    from tests.unit.test_probe_wake import wait_ready_stuck

    launch = launch_for("wake", "--load-seconds", "1")
    assert launch.probe.ready_log is not None
    await runtime.start(launch)
    result = await wait_ready_stuck(runtime, launch, timeout=60)
    # the first attempt, at once, then the one the ready line woke: no scheduled attempt
    assert result.outcome is ProbeOutcome.READY and result.attempts == 2, result
    await runtime.stop(launch.slot, timeout=5)
