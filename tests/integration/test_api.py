"""The HTTP API against the real server (SPEC §9, issue 6): ``slotctl up --listen
127.0.0.1:0`` as a subprocess on the real process runtime with demo servers, reached over
TCP with its generated token.

Every route and status code of the local API, the typed error body on every error, and
auth on every route: the live router is enumerated (``build_app``), so a route added
without auth fails ``test_auth_on_every_route``, and the set of public routes is pinned.

Two controllers: ``static`` (module scope) serves the tests that start no server (refusals,
config writes, auth, documents); tests that load slots get their own controller, so every
demo server they start is stopped by ``slotctl down`` before the leftover-process check.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from controller.api.app import ApiContext
from controller.api.assembly import ROUTES, build_app
from controller.api.openapi import openapi_path
from controller.kit.eventbus import EventBus
from controller.router.endpoints import ENDPOINTS
from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.helpers import free_port

GIB = 1024**3


# ============================================================================ harness


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: Any
    raw: bytes

    @property
    def code(self) -> str | None:
        error = self.body.get("error") if isinstance(self.body, dict) else None
        return error.get("code") if isinstance(error, dict) else None

    @property
    def error(self) -> dict[str, Any]:
        assert isinstance(self.body, dict) and isinstance(self.body.get("error"), dict), self
        return dict(self.body["error"])


class Api:
    """A plain HTTP client of one controller (independent of the CLI's own client)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = "",
        headers: Mapping[str, str] | None = None,
        raw: bytes | None = None,
        timeout: float = 60.0,
    ) -> Reply:
        """``token=""``: the right one; ``None``: no Authorization header; else that one."""
        sent = dict(headers or {})
        token = self.token if token == "" else token
        if token is not None and "Authorization" not in sent:
            sent["Authorization"] = f"Bearer {token}"
        payload = raw
        if body is not None:
            payload = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=payload, headers=sent)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        decoded: Any = None
        if data and "json" in response.headers.get("Content-Type", ""):
            decoded = json.loads(data)
        return Reply(response.status, dict(response.headers), decoded, data)

    def ok(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        reply = self.call(method, path, body)
        assert reply.status == status, reply
        return reply.body

    def slot(self, name: str) -> dict[str, Any]:
        body = self.ok("GET", f"/api/slots/{name}")
        assert isinstance(body, dict)
        return body

    def wait_state(self, name: str, *states: str, timeout: float = 30.0) -> dict[str, Any]:
        return wait_until(
            lambda: (view := self.slot(name))["state"] in states and view,
            f"slot {name} in {states}",
            timeout,
        )


def start_api(ctl: Slotctl, *args: str) -> Api:
    """``slotctl up --listen 127.0.0.1:0``; the port from controller.json, the token file."""
    ctl.start_up("--listen", "127.0.0.1:0", *args)
    record = ctl.state / "controller.json"

    def listening() -> str | None:
        try:
            listen = json.loads(record.read_text())["listen"]
        except (OSError, ValueError, KeyError):
            return None
        return listen if isinstance(listen, str) and not listen.endswith(":0") else None

    host, _, port = wait_until(listening, "the API to listen").rpartition(":")
    api = Api(host, int(port), (ctl.state / "token").read_text().strip())
    wait_until(lambda: api.call("GET", "/readyz").status == 200, "the controller to be ready")
    return api


def write_settings(config: Path, cpu_budget_gb: float) -> None:
    config.mkdir(parents=True, exist_ok=True)
    (config / "controller.toml").write_text(
        f"memory_budget_gb = {{cpu = {cpu_budget_gb}}}\nsafety_margin_gb = 0.0\n"
    )


def model(model_id: str, gb: float, **extra: Any) -> str:
    lines = [f'[[model]]\nid = "{model_id}"\nsource = "demo://{model_id.replace("/", "-")}"']
    lines.append(f"memory_gb = {gb}")
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def slot(name: str, model_id: str, *, load_s: float = 0.3, **extra: Any) -> str:
    lines = [
        f'[[slot]]\nname = "{name}"\nprovider = "demo"\nmodel.default = "{model_id}"',
        f'device = "cpu"\nport = {free_port()}',
    ]
    extra.setdefault("autoload", False)
    extra.setdefault("drain_timeout_s", 1.0)
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    lines.append(f'[slot.server]\nextra_args = ["--load-seconds", "{load_s}"]')
    return "\n".join(lines) + "\n"


def apply(ctl: Slotctl, text: str, name: str = "api.toml") -> Path:
    path = ctl.tmp / name
    path.write_text(text)
    ctl.ok("stack", "apply", path)
    return path


# A catalogue for the static controller: nothing in it is ever started.
STATIC_STACK = (
    '[stack]\nname = "api"\n'
    + model("m-a", 0.05, context_length=4096)
    + model("m-b", 0.05)
    + model("m-big", 4.0)
    + model("m-unserved", 0.05)
    + model("org/m-slash:q4", 0.05)
    + slot("a", "m-a")
    + slot("b", "m-b")
    + slot("big", "m-big")
    + slot("slash", "org/m-slash:q4")
    + slot("anchor", "m-b", pinned=True)
    + slot("spare", "")
)


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, Slotctl]]:
    ctl = Slotctl(tmp_path_factory.mktemp("static-api"))
    write_settings(ctl.config, cpu_budget_gb=1.0)
    try:
        apply(ctl, STATIC_STACK)
        yield start_api(ctl), ctl
    finally:
        leftovers = ctl.close()
    assert not leftovers, leftovers


@pytest.fixture
def api(static: tuple[Api, Slotctl]) -> Api:
    return static[0]


@pytest.fixture
def ctl(tmp_path: Path) -> Iterator[Slotctl]:
    harness = Slotctl(tmp_path)
    try:
        yield harness
    finally:
        leftovers = harness.close()
    assert not leftovers, f"left running after `slotctl down`: {leftovers}"


@pytest.fixture
def live(ctl: Slotctl) -> Iterator[tuple[Api, Slotctl]]:
    """A controller of its own for a test that starts demo servers (budget 1 GiB)."""
    write_settings(ctl.config, cpu_budget_gb=1.0)
    apply(
        ctl,
        '[stack]\nname = "live"\n'
        + model("m-one", 0.4)
        + model("m-two", 0.4)
        + model("m-three", 0.4)
        + model("m-alt", 0.4)
        + model("m-big", 4.0)
        + model("m-pin", 0.1)
        + slot("one", "m-one", priority=10)
        + slot("two", "m-two", priority=60)
        + slot("three", "m-three", priority=70)
        + slot("big", "m-big")
        + slot("pin", "m-pin", pinned=True),
    )
    yield start_api(ctl), ctl


def assert_typed(reply: Reply, status: int, code: str) -> dict[str, Any]:
    """The typed error body: ``{"error": {"code", "message", ...}}`` with that status."""
    assert reply.status == status, reply
    assert reply.headers.get("Content-Type", "").startswith("application/json"), reply
    error = reply.error
    assert error["code"] == code, reply
    assert isinstance(error["message"], str) and error["message"], reply
    return error


# ============================================================================ auth


def live_routes() -> list[tuple[str, str]]:
    """(method, canonical path) of every route the served API has: aiohttp's app, and
    the data plane's /v1 endpoints (the router's table)."""

    async def build() -> list[tuple[str, str]]:
        ctx = ApiContext(
            manager=None,
            reconciler=None,
            config_dir=Path("/nonexistent"),
            state_dir=Path("/nonexistent"),
            token="x",
            events=EventBus(),
        )
        app = build_app(ctx)
        out = [(e.method, e.path) for e in ENDPOINTS]
        for route in app.router.routes():
            resource = route.resource
            if resource is not None and route.method != "HEAD":
                out.append((route.method, resource.canonical))
        await app.cleanup()
        return out

    return asyncio.run(build())


_DUMMY = {"name": "a", "model_id": "m-a", "path": "transcriptions", "adapter": "a"}


def concrete(path: str) -> str:
    out = path
    for key, value in _DUMMY.items():
        out = out.replace("{" + key + "}", quote(value, safe=""))
    assert "{" not in out, f"no dummy value for a parameter of {path}"
    return out


PUBLIC = {
    ("GET", "/healthz"),
    ("GET", "/"),
    ("GET", "/static/{name}"),
    ("POST", "/api/login"),  # a one-time login code is its credential
}


def test_public_routes_are_exactly_health_and_the_dashboard() -> None:
    declared = {(r.method, openapi_path(r.path)) for r in ROUTES if r.public}
    assert ("GET", "/healthz") in declared
    assert declared <= PUBLIC, f"routes without auth: {sorted(declared - PUBLIC)}"
    served = set(live_routes())
    # Every served route is declared in the registry (so it has an auth decision and
    # OpenAPI documentation), and nothing is served twice.
    registry = {(r.method, openapi_path(r.path)) for r in ROUTES}
    assert served == registry, (sorted(served - registry), sorted(registry - served))


def test_auth_on_every_route(api: Api) -> None:
    routes = live_routes()
    assert len(routes) >= 25
    failures = []
    for method, path in routes:
        target = concrete(path)
        body = {} if method in ("POST", "PUT", "PATCH") else None
        if (method, path) in PUBLIC:
            reply = api.call(method, target, token=None)
            if reply.status == 401:
                failures.append(f"{method} {path}: public but answered 401")
            continue
        # /v1/* answers in OpenAI's error shape (its 401 code), the rest in slotctl's
        code = "invalid_api_key" if path.startswith("/v1/") else "auth.unauthorized"
        for token, what in ((None, "no token"), ("wrong-token", "a wrong token")):
            reply = api.call(method, target, body, token=token)
            if reply.status != 401 or reply.code != code:
                failures.append(f"{method} {path} with {what}: {reply.status} {reply.raw[:100]!r}")
            elif 'Bearer realm="slotctl"' not in reply.headers.get("WWW-Authenticate", ""):
                failures.append(f"{method} {path}: 401 without WWW-Authenticate")
        basic = api.call(method, target, body, headers={"Authorization": f"Basic {api.token}"})
        if basic.status != 401:
            failures.append(f"{method} {path}: the token as Basic auth answered {basic.status}")
    assert not failures, "\n".join(failures)


def test_unknown_routes_and_methods_are_typed(api: Api) -> None:
    assert_typed(api.call("GET", "/api/nope", token=None), 401, "auth.unauthorized")
    assert_typed(api.call("GET", "/api/nope"), 404, "http.not_found")
    assert_typed(api.call("DELETE", "/api/models"), 405, "http.method_not_allowed")


# ============================================================================ health, documents


def test_healthz_readyz_openapi(api: Api) -> None:
    health = api.call("GET", "/healthz", token=None)
    assert health.status == 200 and health.body["status"] == "ok"
    assert api.call("GET", "/healthz", token="wrong").status == 200
    assert api.ok("GET", "/readyz") == {"status": "ready"}
    doc = api.ok("GET", "/api/openapi.json")
    assert doc["openapi"].startswith("3.")
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for spec in ROUTES:
        op = doc["paths"][openapi_path(spec.path)][spec.method.lower()]
        assert "{" not in spec.path or "{" in openapi_path(spec.path)
        assert ":" not in openapi_path(spec.path), spec.path
        if spec.public:
            assert op["security"] == [], spec.path
        else:
            assert "401" in op["responses"], spec.path
        for status, response in op["responses"].items():
            if int(status) >= 400:
                ref = response["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorBody", (spec.path, status)
    load = doc["paths"]["/api/models/{model_id}/load"]["post"]["responses"]
    assert {"200", "202", "400", "404", "409"} <= set(load)
    # ``slotctl up`` answers readyz only once state is recovered: a controller that is
    # not ready yet answers 503 with the typed body (asserted in-process: the window is
    # too short to catch over TCP).


async def test_readyz_503_while_recovering(tmp_path: Path) -> None:
    from controller.api.server import ApiServer

    ctx = ApiContext(
        manager=None,
        reconciler=None,
        config_dir=tmp_path,
        state_dir=tmp_path,
        token="t0ken",
        events=EventBus(),
    )
    server = ApiServer(ctx, "127.0.0.1", 0)
    await server.start()
    try:
        api = Api("127.0.0.1", server.port, "t0ken")
        reply = await asyncio.to_thread(api.call, "GET", "/readyz")
        assert_typed(reply, 503, "controller.starting")
        ctx.ready.set()
        reply = await asyncio.to_thread(api.call, "GET", "/readyz")
        assert reply.status == 200
    finally:
        await server.stop()


# ============================================================================ slots: reads


def test_list_and_get_slots(api: Api) -> None:
    slots = {s["name"]: s for s in api.ok("GET", "/api/slots")["slots"]}
    assert {"a", "b", "big", "anchor", "spare", "slash"} <= set(slots)
    a = slots["a"]
    assert a["state"] == "offline" and a["dispatchable"] is False
    assert a["model_id"] == "m-a" and a["device"] == "cpu" and a["stack"] == "api"
    assert slots["anchor"]["pinned"] is True
    one = api.slot("a")
    assert one["name"] == "a" and one["spec"]["model"]["default"] == "m-a"
    assert_typed(api.call("GET", "/api/slots/nope"), 404, "slot.not_found")


# ============================================================================ slots: writes


def test_create_slot(api: Api, static: tuple[Api, Slotctl]) -> None:
    ctl = static[1]
    payload = {"name": "created", "provider": "demo", "port": free_port(), "device": "cpu"}
    reply = api.call("POST", "/api/slots", payload)
    assert reply.status == 201, reply
    assert reply.body["created"] == "created"
    assert reply.body["spec"]["autoload"] is False  # created through the API: explicit
    assert "autoload = false" in (ctl.config / "slots" / "created.toml").read_text()
    wait_until(
        lambda: api.call("GET", "/api/slots/created").status == 200, "the manager to know it"
    )
    # again: exists
    error = assert_typed(api.call("POST", "/api/slots", payload), 400, "slot.config_error")
    assert error["keys"] == ["name"]
    # a port another slot has
    port = api.slot("a")["spec"]["port"]
    dup = {**payload, "name": "dup-port", "port": port}
    error = assert_typed(api.call("POST", "/api/slots", dup), 400, "slot.config_error")
    assert "port" in json.dumps(error)
    # schema: unknown key, wrong type, bad name; a body that is no JSON at all
    bad = {**payload, "name": "bad", "colour": "red"}
    assert_typed(api.call("POST", "/api/slots", bad), 400, "slot.config_error")
    bad = {**payload, "name": "bad", "port": "8080"}
    assert_typed(api.call("POST", "/api/slots", bad), 400, "slot.config_error")
    bad = {**payload, "name": "Bad_Name"}
    assert_typed(api.call("POST", "/api/slots", bad), 400, "slot.config_error")
    reply = api.call("POST", "/api/slots", raw=b"{nope", headers={"Content-Type": "x"})
    assert_typed(reply, 400, "request.invalid")
    assert not (ctl.config / "slots" / "bad.toml").exists()
    # NPU exclusivity: a second activated llm slot on the npu
    npu = {"provider": "demo", "device": "npu", "model": {"default": "m-a"}, "autoload": False}
    first = {**npu, "name": "npu-one", "port": free_port()}
    assert api.call("POST", "/api/slots", first).status == 201
    second = {**npu, "name": "npu-two", "port": free_port()}
    assert_typed(api.call("POST", "/api/slots", second), 409, "slot.npu_exclusive")
    assert not (ctl.config / "slots" / "npu-two.toml").exists()


def test_put_config(api: Api, static: tuple[Api, Slotctl]) -> None:
    ctl = static[1]
    spec = api.slot("b")["spec"]
    port = spec["port"]
    base = {"provider": "demo", "port": port, "device": "cpu", "model": {"default": "m-b"}}
    reply = api.call("PUT", "/api/slots/b/config", {**base, "priority": 33, "autoload": False})
    assert reply.status == 200, reply
    assert reply.body["written"] == "b" and reply.body["spec"]["priority"] == 33
    assert "priority = 33" in (ctl.config / "slots" / "b.toml").read_text()
    # a model-owned key: refused, naming the key and the model that owns it
    owned = {**base, "context_length": 8192}
    error = assert_typed(api.call("PUT", "/api/slots/b/config", owned), 400, "slot.config_error")
    assert "context_length" in error["keys"]
    assert "model-owned" in error["message"] and "'m-b'" in error["message"]
    assert error["problems"][0]["code"] == "slot.model_owned_key"
    # hardware/placement flags and env are refused
    for server in (
        {"extra_args": ["--n-gpu-layers", "99"]},
        {"extra_args": ["--device=cuda:0"]},
        {"env": {"CUDA_VISIBLE_DEVICES": "0"}},
    ):
        reply = api.call("PUT", "/api/slots/b/config", {**base, "server": server})
        error = assert_typed(reply, 400, "slot.config_error")
        assert error["problems"][0]["code"] == "slot.hardware_flag", reply
    # the body names another slot; an unknown slot; not JSON
    reply = api.call("PUT", "/api/slots/b/config", {**base, "name": "a"})
    assert_typed(reply, 400, "request.invalid")
    assert_typed(api.call("PUT", "/api/slots/nope/config", base), 404, "slot.not_found")
    reply = api.call("PUT", "/api/slots/b/config", raw=b"[1,", headers={"Content-Type": "x"})
    assert_typed(reply, 400, "request.invalid")
    assert "priority = 33" in (ctl.config / "slots" / "b.toml").read_text()  # unchanged


def test_patch_defaults(api: Api, static: tuple[Api, Slotctl]) -> None:
    ctl = static[1]
    reply = api.call("PATCH", "/api/slots/a/defaults", {"priority": 77, "ttl_s": 5.0})
    assert reply.status == 200, reply
    assert reply.body["spec"]["priority"] == 77 and reply.body["spec"]["ttl_s"] == 5.0
    text = (ctl.config / "slots" / "a.toml").read_text()
    assert "priority = 77" in text and "m-a" in text  # merged, not replaced
    wait_until(lambda: api.slot("a")["priority"] == 77, "the new priority to apply in place")
    # model-owned keys are reported as such, with the model that owns them
    for key, value in (("context_length", 2048), ("temperature", 0.2)):
        reply = api.call("PATCH", "/api/slots/a/defaults", {key: value})
        error = assert_typed(reply, 400, "slot.config_error")
        assert error["keys"] == [key]
        assert "model-owned" in error["message"] and "'m-a'" in error["message"], error
    # defaults are scheduling knobs: the server, the port or the provider are not
    for key, value in (("server", {"extra_args": ["-ngl", "9"]}), ("port", 9999)):
        reply = api.call("PATCH", "/api/slots/a/defaults", {key: value})
        error = assert_typed(reply, 400, "slot.config_error")
        assert error["keys"] == [key] and "not slot defaults" in error["message"], error
    # ... and through PUT /config a hardware flag is refused by the guard
    current = api.call("GET", "/api/slots/a").body["spec"]
    current["server"] = {"extra_args": ["-ngl", "9"]}
    reply = api.call("PUT", "/api/slots/a/config", current)
    error = assert_typed(reply, 400, "slot.config_error")
    assert error["problems"][0]["code"] == "slot.hardware_flag"
    reply = api.call("PATCH", "/api/slots/a/defaults", {"priority": 101})
    assert_typed(reply, 400, "slot.config_error")
    assert_typed(api.call("PATCH", "/api/slots/nope/defaults", {}), 404, "slot.not_found")
    assert "priority = 77" in (ctl.config / "slots" / "a.toml").read_text()


def test_delete_slot(api: Api, static: tuple[Api, Slotctl]) -> None:
    ctl = static[1]
    for name, pinned in (("gone", False), ("gone-pinned", True)):
        payload = {
            "name": name,
            "provider": "demo",
            "port": free_port(),
            "device": "cpu",
            "pinned": pinned,
        }
        assert api.call("POST", "/api/slots", payload).status == 201
    reply = api.call("DELETE", "/api/slots/gone")
    assert reply.status == 202 and reply.body["status"] == "deleting", reply
    assert not (ctl.config / "slots" / "gone.toml").exists()
    error = assert_typed(api.call("DELETE", "/api/slots/gone-pinned"), 409, "slot.pinned")
    assert "force=true" in error["message"]
    assert (ctl.config / "slots" / "gone-pinned.toml").exists()
    assert_typed(api.call("DELETE", "/api/slots/gone-pinned?force=maybe"), 400, "request.invalid")
    assert api.call("DELETE", "/api/slots/gone-pinned?force=true").status == 202
    assert not (ctl.config / "slots" / "gone-pinned.toml").exists()
    assert_typed(api.call("DELETE", "/api/slots/gone"), 404, "slot.not_found")
    wait_until(lambda: api.call("GET", "/api/slots/gone").status == 404, "the manager to forget it")


# ============================================================================ slots: actions


def test_slot_action_refusals(api: Api) -> None:
    """Every refusal of the slot actions, none of which starts anything."""
    for action in ("load", "unload", "reset"):
        assert_typed(api.call("POST", f"/api/slots/nope/{action}"), 404, "slot.not_found")
    for verb in ("hold", "lease"):  # /lease: SPEC §7's name for the same batch lease
        reply = api.call("POST", f"/api/slots/nope/{verb}", {"ttl_s": 5})
        assert_typed(reply, 404, "slot.not_found")
    reply = api.call("POST", "/api/slots/nope/swap", {"model": "m-a"})
    assert_typed(reply, 404, "slot.not_found")
    # a slot that is not activated (empty model.default): 400, disabled
    error = assert_typed(api.call("POST", "/api/slots/spare/load"), 400, "slot.config_error")
    assert error["disabled"] is True and error["keys"] == ["model.default"]
    # too big for the budget: 409 with the byte figures, nothing started
    error = assert_typed(api.call("POST", "/api/slots/big/load"), 409, "model.insufficient_memory")
    assert error["needed_bytes"] == 4 * GIB
    assert isinstance(error["free_bytes"], int) and isinstance(error["evictable_bytes"], int)
    assert api.slot("big")["state"] == "offline"
    # a refused swap of a slot that was not activated leaves it not activated
    assert_typed(
        api.call("POST", "/api/slots/spare/swap", {"model": "m-big"}),
        409,
        "model.insufficient_memory",
    )
    assert api.slot("spare")["model_id"] == "" and api.slot("spare")["state"] == "offline"
    error = assert_typed(api.call("POST", "/api/slots/spare/load"), 400, "slot.config_error")
    assert error["disabled"] is True
    # a pinned slot: unload needs force
    assert_typed(api.call("POST", "/api/slots/anchor/unload"), 409, "slot.pinned")
    reply = api.call("POST", "/api/slots/anchor/unload?force=true")
    assert reply.status == 200 and reply.body["slot"]["state"] == "offline", reply
    # malformed bodies and parameters
    assert_typed(api.call("POST", "/api/slots/a/hold", {"ttl_s": -1}), 400, "request.invalid")
    assert_typed(api.call("POST", "/api/slots/a/hold", {}), 400, "request.invalid")
    assert_typed(api.call("POST", "/api/slots/a/lease", {}), 400, "request.invalid")
    assert_typed(api.call("POST", "/api/slots/a/swap", {"model": ""}), 400, "request.invalid")
    reply = api.call("POST", "/api/slots/a/swap", {"model": "m-a", "x": 1})
    assert_typed(reply, 400, "request.invalid")
    reply = api.call("POST", "/api/slots/a/swap", {"model": "m-nope"})
    assert_typed(reply, 404, "model.not_found")
    assert_typed(api.call("POST", "/api/slots/a/load?dry_run=perhaps"), 400, "request.invalid")
    # reset of a healthy slot: nothing to clear, still 200
    reply = api.call("POST", "/api/slots/a/reset")
    assert reply.status == 200 and reply.body["status"] == "reset", reply
    assert reply.body["slot"]["failures"] == 0


def test_load_dry_run_plans(api: Api) -> None:
    reply = api.call("POST", "/api/slots/a/load?dry_run=true")
    assert reply.status == 200, reply
    plan = reply.body["plan"]
    assert reply.body["status"] == "dry run"
    assert plan["action"] == "load" and plan["evict"] == []
    assert plan["needed_bytes"] == int(0.05 * GIB) and plan["budget_bytes"] == GIB
    reply = api.call("POST", "/api/slots/big/load?dry_run=true")
    assert reply.status == 200 and reply.body["plan"]["action"] == "refuse", reply
    assert "insufficient_memory" in json.dumps(reply.body["plan"]["error"])
    reply = api.call("POST", "/api/slots/spare/load?dry_run=1")
    assert reply.status == 200 and reply.body["plan"]["action"] == "refuse", reply
    assert_typed(api.call("POST", "/api/slots/nope/load?dry_run=true"), 404, "slot.not_found")
    assert api.slot("a")["state"] == "offline"  # a dry run changes nothing


def test_slot_load_unload_swap_hold_reset(live: tuple[Api, Slotctl]) -> None:
    api, ctl = live
    # 202 loading, then 200 already
    reply = api.call("POST", "/api/slots/one/load")
    assert reply.status == 202, reply
    assert reply.body["status"] == "loading"
    assert reply.body["slot"]["state"] in ("pulling", "starting", "warming")
    api.wait_state("one", "ready")
    reply = api.call("POST", "/api/slots/one/load")
    assert reply.status == 200 and reply.body["status"] == "already loaded", reply
    assert reply.body["slot"]["resident"] is True
    api.ok("POST", "/api/slots/two/load", status=202)
    api.wait_state("two", "ready")

    # one + two hold 0.8 of the 1 GiB budget: three only fits by evicting the lowest
    # priority (one, 10); the dry run says so and changes nothing
    plan = api.ok("POST", "/api/slots/three/load?dry_run=true")["plan"]
    assert plan["action"] == "evict-then-load", plan
    assert [v["slot"] for v in plan["evict"]] == ["one"]
    victim = plan["evict"][0]
    assert victim["priority"] == 10 and victim["bytes"] == int(0.4 * GIB) and victim["reason"]
    assert api.slot("one")["state"] == "ready"

    # a batch lease keeps two loaded and unevictable
    held = api.ok("POST", "/api/slots/two/hold", {"ttl_s": 60})
    assert held["slot"] == "two" and held["expires_in_s"] == 60 and held["lease"] > 0
    assert api.slot("two")["state"] == "serving"
    plan = api.ok("POST", "/api/slots/three/load?dry_run=true")["plan"]
    assert [v["slot"] for v in plan["evict"]] == ["one"]

    # swap one to another catalogue model: unloaded, rebound (config too), loaded
    swapped = api.ok("POST", "/api/slots/one/swap", {"model": "m-alt"})
    assert swapped["status"] == "swapped"
    assert swapped["slot"]["model_id"] == "m-alt" and swapped["slot"]["state"] == "ready"
    assert 'default = "m-alt"' in (ctl.config / "slots" / "one.toml").read_text()
    # a swap the budget refuses leaves the declared binding as it was
    error = assert_typed(
        api.call("POST", "/api/slots/one/swap", {"model": "m-big"}),
        409,
        "model.insufficient_memory",
    )
    assert error["needed_bytes"] == 4 * GIB
    assert 'default = "m-alt"' in (ctl.config / "slots" / "one.toml").read_text()
    # ... and the manager serves what is declared at once (one writer of the binding)
    assert api.slot("one")["model_id"] == "m-alt"

    # unload: 200 with the offline view; reset leaves an offline slot offline
    reply = api.call("POST", "/api/slots/one/unload")
    assert reply.status == 200 and reply.body["slot"]["state"] == "offline", reply
    assert reply.body["slot"]["resident"] is False
    reset = api.ok("POST", "/api/slots/one/reset")
    assert reset["slot"]["state"] == "offline" and reset["slot"]["failures"] == 0
    # unloading the held slot drains it (drain_timeout_s = 1), then stops it
    started = time.monotonic()
    reply = api.call("POST", "/api/slots/two/unload")
    assert reply.status == 200 and reply.body["slot"]["state"] == "offline", reply
    assert time.monotonic() - started >= 0.9


def test_model_routes(api: Api) -> None:
    models = {m["id"]: m for m in api.ok("GET", "/api/models")["models"]}
    assert {"m-a", "m-b", "m-big", "m-unserved", "org/m-slash:q4"} <= set(models)
    assert models["m-a"]["state"] == "unloaded" and models["m-a"]["loadable"] is True
    assert "a" in models["m-a"]["slots"]
    assert models["m-unserved"]["loadable"] is False and models["m-unserved"]["slots"] == []
    state = api.ok("GET", "/api/models/m-b/state")
    assert state["id"] == "m-b" and state["state"] == "unloaded"
    # ids with "/" and ":" travel in the path, quoted or not
    for path in ("org/m-slash:q4", quote("org/m-slash:q4", safe="")):
        assert api.ok("GET", f"/api/models/{path}/state")["id"] == "org/m-slash:q4"
    assert_typed(api.call("GET", "/api/models/m-nope/state"), 404, "model.not_found")
    # 404 unknown, 400 disabled (no activated slot serves it), 409 insufficient memory
    for action in ("load", "unload"):
        assert_typed(api.call("POST", f"/api/models/m-nope/{action}"), 404, "model.not_found")
    error = assert_typed(api.call("POST", "/api/models/m-unserved/load"), 400, "slot.config_error")
    assert error["disabled"] is True
    reply = api.call("POST", "/api/models/m-big/load")
    error = assert_typed(reply, 409, "model.insufficient_memory")
    assert error["needed_bytes"] == 4 * GIB
    assert {"free_bytes", "evictable_bytes"} <= set(error)
    assert error["budget_bytes"] == GIB and "Retry-After" not in reply.headers
    # nothing loaded: unload is 200 "already unloaded"
    reply = api.call("POST", "/api/models/m-b/unload")
    assert reply.status == 200 and reply.body["status"] == "already unloaded", reply


def test_model_load_unload_status_codes(live: tuple[Api, Slotctl]) -> None:
    api, _ = live
    reply = api.call("POST", "/api/models/m-three/load")
    assert reply.status == 202 and reply.body["status"] == "loading", reply
    assert reply.body["slot"]["name"] == "three"
    assert api.ok("GET", "/api/models/m-three/state")["state"] in ("loading", "loaded")
    api.wait_state("three", "ready")
    reply = api.call("POST", "/api/models/m-three/load")
    assert reply.status == 200 and reply.body["status"] == "already loaded", reply
    model_state = api.ok("GET", "/api/models/m-three/state")
    assert model_state["state"] == "loaded" and model_state["resident"] is True
    reply = api.call("POST", "/api/models/m-three/unload")
    assert reply.status == 202 and reply.body["status"] == "unloading", reply
    api.wait_state("three", "offline")
    reply = api.call("POST", "/api/models/m-three/unload")
    assert reply.status == 200 and reply.body["status"] == "already unloaded", reply
    assert api.ok("GET", "/api/models/m-three/state")["resident"] is False
    # a model loaded on a pinned slot: unloading it needs the slot's force
    api.ok("POST", "/api/models/m-pin/load", status=202)
    api.wait_state("pin", "ready")
    assert_typed(api.call("POST", "/api/models/m-pin/unload"), 409, "slot.pinned")
    assert api.slot("pin")["state"] == "ready"
    assert api.ok("POST", "/api/slots/pin/unload?force=true")["slot"]["state"] == "offline"


# ============================================================================ stacks


def test_stacks_diff_and_apply(api: Api, static: tuple[Api, Slotctl]) -> None:
    ctl = static[1]
    current = (ctl.tmp / "api.toml").read_text()
    # the stack as applied, against a host whose files were changed through the API since
    diff = api.ok("POST", "/api/stacks/diff", {"stack": current, "name": "api.toml"})
    assert set(diff) >= {"in_sync", "actions", "config_diffs", "drift", "json_patch"}
    assert {a["slot"] for a in diff["actions"]} >= {"a", "b", "big"}

    extra = '[stack]\nname = "extra"\n' + slot("extra-one", "")
    body = {"stack": extra, "name": "extra.toml"}
    before = api.ok("POST", "/api/stacks/diff", body)
    assert before["in_sync"] is False
    assert [(a["slot"], a["kind"]) for a in before["actions"]] == [("extra-one", "create")]
    planned = api.ok("POST", "/api/stacks/apply", {**body, "dry_run": True})
    assert set(planned) == {
        "plan",
        "aliases_changed",
        "adapters_changed",
        "changed",
        "dry_run",
        "left_behind",
    }
    assert planned["changed"] == [] and planned["dry_run"] is True
    assert planned["aliases_changed"] == [] and planned["adapters_changed"] == []
    assert [(a["slot"], a["kind"]) for a in planned["plan"]] == [("extra-one", "create")]
    assert not (ctl.config / "slots" / "extra-one.toml").exists()
    applied = api.ok("POST", "/api/stacks/apply", body)
    assert applied["changed"] == ["extra-one"] and applied["dry_run"] is False
    assert (ctl.config / "slots" / "extra-one.toml").exists()
    after = api.ok("POST", "/api/stacks/diff", body)
    assert after["in_sync"] is True and after["json_patch"] == []
    # several files form one desired state (a model in one, its slot in the other)
    files = [
        {"name": "m.toml", "text": '[stack]\nname = "extra"\n' + model("m-extra", 0.01)},
        {"name": "s.toml", "text": '[stack]\nname = "extra"\n' + slot("extra-one", "m-extra")},
    ]
    diff = api.ok("POST", "/api/stacks/diff", {"files": files})
    assert diff["in_sync"] is False and "extra-one" in diff["config_diffs"]
    # pruning is explicit on apply, the default of diff
    other = '[stack]\nname = "extra"\n' + slot("extra-two", "")
    diff = api.ok("POST", "/api/stacks/diff", {"stack": other})
    assert ("extra-one", "delete") in {(a["slot"], a["kind"]) for a in diff["actions"]}
    diff = api.ok("POST", "/api/stacks/diff", {"stack": other, "prune": False})
    assert ("extra-one", "delete") not in {(a["slot"], a["kind"]) for a in diff["actions"]}
    applied = api.ok("POST", "/api/stacks/apply", {"stack": other, "prune": True})
    assert sorted(applied["changed"]) == ["extra-one", "extra-two"]
    assert not (ctl.config / "slots" / "extra-one.toml").exists()


def test_stacks_invalid(api: Api, static: tuple[Api, Slotctl]) -> None:
    ctl = static[1]
    before = sorted(p.name for p in (ctl.config / "slots").iterdir())
    bad = '[stack]\nname = "bad"\n[[slot]]\nname = "x"\nprovider = "demo"\nport = "80"\n'
    for path in ("/api/stacks/apply", "/api/stacks/diff"):
        reply = api.call("POST", path, {"stack": bad, "name": "bad.toml"})
        error = assert_typed(reply, 400, "slot.config_error")
        assert error["problems"] and error["problems"][0]["file"] == "bad.toml"
        reply = api.call("POST", path, {"stack": "[stack\n", "name": "syntax.toml"})
        error = assert_typed(reply, 400, "slot.config_error")
        assert "syntax.toml" in json.dumps(error["problems"])
        assert_typed(api.call("POST", path, {}), 400, "request.invalid")
        assert_typed(api.call("POST", path, {"stack": 5}), 400, "request.invalid")
        reply = api.call("POST", path, {"stack": "", "prune": "yes please"})
        assert_typed(reply, 400, "request.invalid")
    assert sorted(p.name for p in (ctl.config / "slots").iterdir()) == before
