"""LoRA adapters end to end (issue 37): ``stack validate`` refuses a bad ``[[adapter]]``,
``stack apply`` writes them, ``stack diff`` shows ``=== adapters``, and ``slotctl up``
routes a request for an adapter (by its id, or ``base:adapter``) to a slot of its base
model whose server — the demo server's vLLM and SGLang adapter APIs, real processes —
loads it on demand, evicts the least recently used one when full, and never answers with
the base model or another adapter. Through the real CLI as subprocesses.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.test_api import model, slot, start_api, write_settings


def adapter(adapter_id: str, path: Path, **extra: Any) -> str:
    lines = [f'[[adapter]]\nid = "{adapter_id}"\nbase = "base"\nsource = "{path}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def stack_text(tmp: Path, *parts: str, **slot_extra: Any) -> str:
    files = {}
    for name in ("a1", "a2", "a3"):
        files[name] = tmp / f"{name}.safetensors"
        files[name].write_bytes(b"lora " + name.encode())
    slot_extra.setdefault("max_loras", 2)
    return (
        '[stack]\nname = "ad"\n'
        + model("base", 0.05)
        + slot("lora", "base", **slot_extra)
        + adapter("a1", files["a1"], rank=8, memory_gb=0.01)
        + adapter("a2", files["a2"], rank=8, memory_gb=0.01)
        + adapter("a3", files["a3"], rank=8, memory_gb=0.01, priority=60)
        + "".join(parts)
    )


def ask(api: Any, name: str) -> Any:
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return api.call("POST", "/v1/chat/completions", body)


def text_of(reply: Any) -> str:
    return str(reply.body["choices"][0]["message"]["content"])


def test_adapters_from_validate_to_routed_requests(ctl: Slotctl) -> None:
    write_settings(ctl.config, cpu_budget_gb=4.0)
    path = ctl.tmp / "ad.toml"
    path.write_text(stack_text(ctl.tmp, max_lora_rank=4))
    result = ctl.run("stack", "validate", path)
    assert result.returncode != 0 and "adapter.rank_over_limit" in result.stdout + result.stderr

    path.write_text(stack_text(ctl.tmp).replace('base = "base"', 'base = "bsae"', 1))
    result = ctl.run("stack", "validate", path)
    assert "adapter.unknown_base" in result.stdout + result.stderr, ctl.explain(result)

    lonely = model("other", 0.05) + (  # an adapter of a model no slot serves adapters of
        f'[[adapter]]\nid = "lonely"\nbase = "other"\nsource = "{ctl.tmp / "a1.safetensors"}"\n'
    )
    path.write_text(stack_text(ctl.tmp, lonely))
    ctl.ok("stack", "validate", path)
    api = start_api(ctl)
    diff = ctl.run("stack", "diff", path)
    assert "=== adapters" in diff.stdout and "+ a1 -> base (rank 8" in diff.stdout, diff.stdout
    planned = ctl.ok("stack", "apply", path, "--dry-run")
    assert "create    adapter a1 -> base (rank 8, scale 1, priority 50)" in planned, planned
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")
    assert json.loads(ctl.ok("stack", "diff", path, "-o", "json", "--exit-code"))["in_sync"]
    shown = json.loads(ctl.ok("stack", "show", path, "-o", "json"))
    assert [a["id"] for a in shown["adapters"]] == ["a1", "a2", "a3", "lonely"]
    assert "[[adapter]]" in ctl.ok("stack", "show", path)
    assert "[[adapter]]" in (ctl.config / "models.toml").read_text()
    dry = ctl.run("slot", "load", "lora", "--dry-run")
    # the two largest adapters' memory counted with the model's (0.05 + 2 x 0.01 GiB)
    assert "needs 0.07 GiB" in dry.stdout, dry.stdout
    assert "adapters (vllm): 2 places, 0.02 GiB reserved, serves a1, a2, a3" in dry.stdout

    def listed() -> dict[str, Any] | None:
        data = api.call("GET", "/v1/models").body["data"]
        return next((e for e in data if e["id"] == "a1"), None)

    assert wait_until(listed, "the adapter in /v1/models")["parent"] == "base"

    base = ask(api, "base")
    assert base.status == 200, base.raw
    assert "[" not in text_of(base)  # the base model: no adapter's weights
    one = ask(api, "a1")  # the slot loads, then a1 loads into it: the request waits
    assert one.status == 200, one.raw
    assert text_of(one).startswith("[a1]") and one.body["model"] == "a1"
    two = ask(api, "base:a2")  # SGLang's spelling of an adapter
    assert two.status == 200 and text_of(two).startswith("[a2]"), two.raw
    assert ask(api, "a1").status == 200  # a1 used last: a2 is the least recently used
    three = ask(api, "a3")  # full (max_loras = 2): a2 is evicted for it
    assert three.status == 200 and text_of(three).startswith("[a3]"), three.raw
    listing = api.call("GET", "/api/adapters").body["adapters"]
    assert {a["id"] for a in listing[0]["resident"]} == {"a1", "a3"}, listing  # a2 evicted

    # a key's model patterns cover adapter ids: this one may use a1 (by either name) only
    key = ctl.ok("key", "create", "lora-a1", "--models", "a1").strip()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for name, status in (("a1", 200), ("base:a1", 200), ("a2", 403), ("base", 403)):
        reply = api.call("POST", "/v1/chat/completions", {**body, "model": name}, token=key)
        assert reply.status == status, (name, reply.raw)

    nowhere = ask(api, "lonely")
    assert nowhere.status == 404 and nowhere.code == "adapter.not_found", nowhere.raw
    unknown = ask(api, "base:nope")
    assert unknown.status == 404 and unknown.body["error"]["code"] == "adapter.not_found"

    # concurrent requests for an adapter not loaded join one load; each answered by it
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(ask(api, "a2"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status == 200 and text_of(r).startswith("[a2]") for r in results), [
        r.raw for r in results
    ]
    listing = api.call("GET", "/api/adapters").body["adapters"]
    held = {a["id"] for s in listing for a in s["resident"]}
    assert "a2" in held and len(held) == 2, listing


def _resident(api: Any) -> dict[str, dict[str, Any]]:
    listing = api.call("GET", "/api/adapters").body["adapters"]
    return {a["id"]: a for s in listing for a in s["resident"]}


def _demo_pid(port: int) -> int:
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "controller.demo" in argv and str(port) in argv:
            return int(proc.pid)
    raise AssertionError(f"no demo server on port {port}")


def test_in_flight_pinned_drained_and_reapplied_adapters(ctl: Slotctl) -> None:
    write_settings(ctl.config, cpu_budget_gb=4.0)
    path = ctl.tmp / "ad.toml"
    text = stack_text(ctl.tmp, max_loras=1).replace("priority = 60", "pinned = true")
    text = text.replace(
        '"--load-seconds", "0.3"', '"--load-seconds", "0.3", "--tokens-per-second", "8"'
    )
    port = int(re.search(r"port = (\d+)", text).group(1))  # type: ignore[union-attr]
    path.write_text(text)
    api = start_api(ctl)
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")

    refused = ctl.run("adapter", "load", "a1")  # no ready slot of the base model yet
    assert refused.returncode != 0 and "slot.not_ready" in refused.stdout + refused.stderr
    assert ask(api, "base").status == 200  # the base model's slot is up
    assert "loaded in lora" in ctl.ok("adapter", "load", "a1")
    listed = ctl.ok("adapter", "list")
    assert re.search(r"a1\s+base\s+8\s+50\s+no\s+lora", listed), listed

    # a request in flight keeps its adapter: another adapter waits for the one place
    done: dict[str, Any] = {}

    def long_ask(name: str) -> None:
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        done[name] = (api.call("POST", "/v1/chat/completions", body), time.monotonic())

    first = threading.Thread(target=long_ask, args=("a1",))
    first.start()
    wait_until(lambda: _resident(api).get("a1", {}).get("in_flight") == 1, "a1 in flight")
    second = threading.Thread(target=long_ask, args=("a2",))
    second.start()
    first.join()
    second.join()
    (one, one_at), (two, two_at) = done["a1"], done["a2"]
    assert one.status == 200 and text_of(one).startswith("[a1]"), one.raw
    assert two.status == 200 and text_of(two).startswith("[a2]"), two.raw
    assert one_at < two_at and set(_resident(api)) == {"a2"}  # a1 evicted once it was free

    # an unload drains: the request in flight is answered by a2, then a2 goes
    third = threading.Thread(target=long_ask, args=("a2",))
    third.start()
    wait_until(lambda: _resident(api).get("a2", {}).get("in_flight") == 1, "a2 in flight")
    unloaded = ctl.ok("adapter", "unload", "a2", timeout=60)
    third.join()
    assert done["a2"][0].status == 200 and text_of(done["a2"][0]).startswith("[a2]")
    assert "resident nowhere" in unloaded and "a2" not in _resident(api)

    # a pinned adapter is never evicted: the next one is refused, not answered by it
    assert text_of(ask(api, "a3")).startswith("[a3]")
    pinned = ask(api, "a2")  # refused at once: no place can free
    assert pinned.status == 503 and pinned.code == "adapter.unavailable", pinned.raw
    assert "1 pinned" in pinned.error["message"] and int(pinned.headers["Retry-After"]) >= 1

    # the engine restarts: a3 is loaded into the new server before the slot is ready
    psutil.Process(_demo_pid(port)).kill()
    wait_until(lambda: ctl.states()["lora"] in ("offline", "error"), "the slot to go down")
    # the slot loads again (once the crash-loop breaker's first backoff has passed)
    wait_until(lambda: ask(api, "base").status == 200, "the base model served again")

    def served_by_server() -> set[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            return {m["id"] for m in json.loads(r.read())["data"]}

    assert "a3" in served_by_server()  # re-applied, with no request for a3 since
    assert set(_resident(api)) == {"a3"}
    metrics = api.call("GET", "/metrics").raw.decode()
    assert 'slotctl_adapter_events_total{action="reapplied",adapter="a3",slot="lora"}' in metrics
    assert re.search(r'slotctl_requests_total\{[^}]*model="a1"', metrics), metrics[:2000]


def test_an_adapter_from_the_hub_is_pulled_before_its_load(ctl: Slotctl) -> None:
    from tests.e2e.test_model_pull_e2e import use_hub
    from tests.integration.hubserver import HubServer

    with HubServer() as hub:
        models = ctl.tmp / "models"
        use_hub(ctl, hub, models)
        hub.add_repo("org/lora", {"a1.safetensors": b"lora a1 weights"})
        write_settings(ctl.config, cpu_budget_gb=4.0)
        path = ctl.tmp / "hub.toml"
        path.write_text(
            '[stack]\nname = "hub"\n'
            + model("base", 0.05)
            + slot("lora", "base", max_loras=1)
            + '[[adapter]]\nid = "a1"\nbase = "base"\nsource = "hf://org/lora/a1.safetensors"\n'
        )
        api = start_api(ctl)
        ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")
        reply = ask(api, "a1")  # the file pulled first, then loaded into the server
        assert reply.status == 200 and text_of(reply).startswith("[a1]"), reply.raw
        assert (models / "org" / "lora" / "a1.safetensors").read_bytes() == b"lora a1 weights"
        hub.release()


def _demo_ports(ctl: Slotctl) -> set[int]:
    """The ports of the demo servers this test's controller runs (labelled with its state
    dir as their owner: other tests' servers run on the same machine)."""
    owner = str(ctl.state.resolve())
    ports = set()
    for proc in psutil.process_iter(["cmdline", "environ"]):
        argv = proc.info["cmdline"] or []
        ours = (proc.info["environ"] or {}).get("SLOTCTL_OWNER") == owner
        if ours and "controller.demo" in argv and "--max-loras" in argv:
            ports.add(int(argv[argv.index("--port") + 1]))
    return ports


def _served_by(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


def test_a_surge_rollout_gives_the_new_server_its_adapters_before_the_switch(
    ctl: Slotctl,
) -> None:
    write_settings(ctl.config, cpu_budget_gb=4.0)
    path = ctl.tmp / "surge.toml"
    text = re.sub(r"port = \d+", 'port = "auto"', stack_text(ctl.tmp))  # surge needs it
    path.write_text(text)
    api = start_api(ctl)
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")
    assert text_of(ask(api, "a1")).startswith("[a1]")
    (old,) = _demo_ports(ctl)
    assert "a1" in _served_by(old)
    # a changed server: surged (the new one beside the old one, then switched to)
    path.write_text(text.replace('"--load-seconds", "0.3"', '"--load-seconds", "0.2"'))
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")

    def switched() -> int | None:
        ports = _demo_ports(ctl) - {old}
        return next(iter(ports)) if len(ports) == 1 and old not in _demo_ports(ctl) else None

    new = wait_until(switched, "the surge to switch and retire the old server")
    assert "a1" in _served_by(new)  # given before the switch: no request loaded it
    assert set(_resident(api)) == {"a1"}
    loaded = api.call("GET", "/metrics").raw.decode()
    assert 'slotctl_adapter_events_total{action="reapplied",adapter="a1",slot="lora"}' in loaded
    assert text_of(ask(api, "a1")).startswith("[a1]")


def test_the_router_prefers_the_slot_holding_the_adapter_unless_it_is_saturated(
    ctl: Slotctl,
) -> None:
    write_settings(ctl.config, cpu_budget_gb=4.0)
    path = ctl.tmp / "two.toml"
    a1 = ctl.tmp / "a1.safetensors"
    a1.write_bytes(b"lora a1")
    both = {"max_loras": 1, "max_concurrency": 1, "autoload": True}
    text = (
        '[stack]\nname = "two"\n'
        + model("base", 0.05)
        + slot("lora", "base", **both)
        + slot("lora2", "base", **both)
        + adapter("a1", a1, rank=8)
    ).replace('"--load-seconds", "0.3"', '"--load-seconds", "0.3", "--tokens-per-second", "8"')
    path.write_text(text)
    api = start_api(ctl)
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")
    ctl.ok("adapter", "load", "a1", "--slot", "lora2")
    for _ in range(3):  # the holder serves it: the other slot loads nothing
        assert text_of(ask(api, "a1")).startswith("[a1]")
    where = {
        s["slot"]: {a["id"] for a in s["resident"]}
        for s in api.call("GET", "/api/adapters").body["adapters"]
    }
    assert where == {"lora": set(), "lora2": {"a1"}}, where

    done: list[Any] = []

    def long_ask() -> None:
        body = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        done.append(api.call("POST", "/v1/chat/completions", body))

    runner = threading.Thread(target=long_ask)
    runner.start()
    wait_until(lambda: _resident(api).get("a1", {}).get("in_flight") == 1, "a1 busy in lora2")
    began = time.monotonic()
    quick = ask(api, "a1")  # lora2 is saturated (max_concurrency 1): lora1 takes it
    assert quick.status == 200 and text_of(quick).startswith("[a1]"), quick.raw
    runner.join()
    assert done[0].status == 200 and done[0].body is not None
    assert time.monotonic() - began < 10
    where = {
        s["slot"]: {a["id"] for a in s["resident"]}
        for s in api.call("GET", "/api/adapters").body["adapters"]
    }
    assert where == {"lora": {"a1"}, "lora2": {"a1"}}, where


def test_an_adapter_that_cannot_load_is_a_typed_error_never_the_base_answer(
    ctl: Slotctl,
) -> None:
    write_settings(ctl.config, cpu_budget_gb=4.0)
    path = ctl.tmp / "ghost.toml"
    path.write_text(
        '[stack]\nname = "ghost"\n'
        + model("base", 0.05)
        + slot("lora", "base", max_loras=1, autoload=True)
        + adapter("ghost", ctl.tmp / "no-such-adapter")
    )
    api = start_api(ctl)
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")
    reply = ask(api, "ghost")
    assert reply.status == 502 and reply.code == "adapter.load_failed", reply.raw
    assert "no-such-adapter" in reply.error["message"]
    assert ask(api, "base").status == 200  # the slot itself is fine
    assert _resident(api) == {}
