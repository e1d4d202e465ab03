"""The write boundary: ``guard_slot_write_payload`` refuses every bad slot payload with a
typed error naming the offending key, accepts good ones, and never crashes.

SPEC §2 "The write boundary". The table below is the contract: each row is one payload a
writer (stack apply, API PUT/PATCH, in-process create) might send, and what must happen.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.model.errors import NpuExclusivityViolation, SlotConfigError, SlotctlError
from controller.spec.guard import guard_slot_write_payload
from controller.spec.loader import load_stacks
from controller.spec.rules import check_slot_payload
from controller.spec.schema import (
    DEVICES,
    HARDWARE_ENV_VARS,
    HARDWARE_FLAGS,
    KINDS,
    MODEL_OWNED_FLAGS,
    MODEL_OWNED_KEYS,
    PROVIDERS,
    ModelSpec,
    ServerSpec,
    SlotSpec,
)

BASE: dict[str, Any] = {"name": "chat", "provider": "llamacpp", "port": 8081}
CATALOGUE = {m.id: m for m in (ModelSpec(id="m1"), ModelSpec(id="m2"), ModelSpec(id="npu-7b"))}
NPU_ACTIVE = SlotSpec(
    name="npu-chat", provider="llamacpp", device="npu", port=9001, model={"default": "npu-7b"}
)
OTHER = SlotSpec(name="other", provider="demo", port=9000)


@dataclass(frozen=True)
class Case:
    id: str
    payload: Mapping[str, Any]
    key: str  # must appear in err.keys and as the key of a problem with `problem`
    problem: str  # the problem code
    exc: type[SlotConfigError] = SlotConfigError
    mentions: str | None = None  # text that some problem message must contain
    others: Sequence[SlotSpec] = ()
    catalogue: Mapping[str, ModelSpec] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _with(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


def _args(*args: str) -> dict[str, Any]:
    # Two harmless args first so the offending index is 2, not a lucky 0.
    return _with(server={"extra_args": ["--parallel", "2", *args]})


def _flag_forms(flag: str) -> list[tuple[str, list[str]]]:
    forms = [("sep", [flag, "1"]), ("eq", [f"{flag}=1"])]
    if flag.startswith("--") and "-" in flag[2:]:
        forms.append(("underscore", ["--" + flag[2:].replace("-", "_"), "1"]))
        forms.append(("underscore-eq", ["--" + flag[2:].replace("-", "_") + "=1"]))
    return forms


def _hardware_flag_cases() -> list[Case]:
    return [
        Case(
            id=f"hw-flag{flag}-{form}",
            payload=_args(*args),
            key="server.extra_args[2]",
            problem="slot.hardware_flag",
            mentions=repr(flag),
        )
        for flag in sorted(HARDWARE_FLAGS)
        for form, args in _flag_forms(flag)
    ]


def _hardware_env_cases() -> list[Case]:
    return [
        Case(
            id=f"hw-env-{var}",
            payload=_with(server={"env": {"OMP_NUM_THREADS": "4", var: "0"}}),
            key=f"server.env.{var}",
            problem="slot.hardware_flag",
            mentions=var,
        )
        for var in sorted(HARDWARE_ENV_VARS)
    ]


_OWNED_VALUES: dict[str, Any] = {"stop": ["</s>"], "chat_template": "chatml", "mmproj": "/m.gguf"}


def _model_owned_cases() -> list[Case]:
    bound = {"default": "m1"}
    cases = []
    for key in sorted(MODEL_OWNED_KEYS):
        value = _OWNED_VALUES.get(key, 1)
        cases.append(
            Case(
                id=f"model-owned-top-{key}",
                payload=_with(model=bound, **{key: value}),
                key=key,
                problem="slot.model_owned_key",
                mentions="'m1'",  # names the model that owns it
                catalogue=CATALOGUE,
            )
        )
        cases.append(
            Case(
                id=f"model-owned-in-model-{key}",
                payload=_with(model={**bound, key: value}),
                key=f"model.{key}",
                problem="slot.model_owned_key",
                mentions="'m1'",
                catalogue=CATALOGUE,
            )
        )
    for flag, owned in sorted(MODEL_OWNED_FLAGS.items()):
        for form, args in _flag_forms(flag):
            cases.append(
                Case(
                    id=f"model-owned-flag{flag}-{form}",
                    payload=_args(*args),
                    key="server.extra_args[2]",
                    problem="slot.model_owned_key",
                    mentions=repr(owned),
                )
            )
    return cases


def _invalid(case_id: str, key: str, **changes: Any) -> Case:
    return Case(id=case_id, payload=_with(**changes), key=key, problem="slot.invalid_value")


_TIMEOUTS = ("idle_timeout_s", "ttl_s", "warmup_timeout_s", "drain_timeout_s")

CASES: list[Case] = [
    *_hardware_flag_cases(),
    *_hardware_env_cases(),
    *_model_owned_cases(),
    Case(
        id="duplicate-port",
        payload=_with(port=9000),
        key="port",
        problem="slot.duplicate_port",
        mentions="'other'",
        others=[OTHER],
    ),
    Case(
        id="duplicate-name",
        payload=_with(name="other", port=9100),
        key="name",
        problem="slot.duplicate_name",
        mentions="'other'",
        others=[OTHER],
    ),
    Case(
        id="npu-second-activated-llm",
        payload=_with(device="npu", model={"default": "m1"}),
        key="device",
        problem="slot.npu_exclusive",
        exc=NpuExclusivityViolation,
        mentions="'npu-chat'",
        others=[NPU_ACTIVE],
        catalogue=CATALOGUE,
    ),
    Case(
        id="npu-second-self-managed-llm",  # self-managed providers are always activated
        payload=_with(provider="kokoro", device="npu"),
        key="device",
        problem="slot.npu_exclusive",
        exc=NpuExclusivityViolation,
        others=[NPU_ACTIVE],
    ),
    *[
        _invalid(f"name-{label}", "name", name=name)
        for label, name in [
            ("dotdot", "../x"),
            ("upper", "A"),
            ("64-chars", "a" * 64),
            ("leading-dash", "-a"),
            ("trailing-dash", "a-"),
            ("empty", ""),
            ("slash", "a/b"),
            ("nul", "a\x00"),
            ("int", 7),
        ]
    ],
    _invalid("port-0", "port", port=0),
    _invalid("port-65536", "port", port=65536),
    _invalid("port-string", "port", port="8081"),  # strict: no silent casts
    _invalid("port-float", "port", port=8081.0),
    _invalid("port-bool", "port", port=True),
    _invalid("priority-101", "priority", priority=101),
    _invalid("priority--1", "priority", priority=-1),
    *[_invalid(f"negative-{key}", key, **{key: -1}) for key in _TIMEOUTS],
    *[_invalid(f"negative-float-{key}", key, **{key: -0.5}) for key in _TIMEOUTS],
    _invalid("warmup-zero", "warmup_timeout_s", warmup_timeout_s=0),
    _invalid("liveness-interval-zero", "liveness_interval_s", liveness_interval_s=0),
    _invalid("ttl-inf", "ttl_s", ttl_s=math.inf),
    _invalid("idle-nan", "idle_timeout_s", idle_timeout_s=math.nan),
    _invalid("memory-inf", "memory_gb", memory_gb=math.inf),
    _invalid("autoload-string", "autoload", autoload="yes"),
    _invalid("provider-unknown", "provider", provider="ollama"),
    _invalid("device-unknown", "device", device="tpu"),
    _invalid("type-unknown", "type", type="chat"),
    _invalid("model-not-table", "model", model="m1"),
    _invalid("model-default-int", "model.default", model={"default": 5}),
    _invalid("extra-args-string", "server.extra_args", server={"extra_args": "--parallel 2"}),
    _invalid("extra-args-int", "server.extra_args[0]", server={"extra_args": [2]}),
    _invalid("env-bad-name", "server.env", server={"env": {"1X": "a"}}),
    _invalid("env-int-value", "server.env.OMP_NUM_THREADS", server={"env": {"OMP_NUM_THREADS": 4}}),
    _invalid("port-not-auto", "port", port="automatic"),
    # its bytes would be infinite (int() of it raised OverflowError in admission: a 500)
    _invalid("memory-gb-absurd", "memory_gb", memory_gb=1e308),
    _invalid("port-zero", "port", port=0),
    Case(
        id="missing-provider",
        payload={"name": "a", "port": 1},
        key="provider",
        problem="slot.missing_key",
    ),
    Case(
        id="missing-name",
        payload={"provider": "demo", "port": 1},
        key="name",
        problem="slot.missing_key",
    ),
    Case(id="unknown-key", payload=_with(bogus=1), key="bogus", problem="slot.unknown_key"),
    Case(
        id="unknown-key-typo",
        payload=_with(prioirty=1),
        key="prioirty",
        problem="slot.unknown_key",
        extra={"hint": "did you mean 'priority'?"},
    ),
    Case(
        id="enabled-is-not-a-field",
        payload=_with(enabled=True),
        key="enabled",
        problem="slot.unknown_key",
    ),
    Case(
        id="unknown-server-key",
        payload=_with(server={"imag": "x"}),
        key="server.imag",
        problem="slot.unknown_key",
    ),
    Case(
        id="unknown-model-key",
        payload=_with(model={"id": "m1"}),
        key="model.id",
        problem="slot.unknown_key",
    ),
    Case(
        id="model-not-in-catalogue",
        payload=_with(model={"default": "m3"}),
        key="model.default",
        problem="slot.unknown_model",
        mentions="'m3'",
        catalogue=CATALOGUE,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_payload(case: Case) -> None:
    before = repr(case.payload)
    with pytest.raises(SlotConfigError) as info:
        guard_slot_write_payload(case.payload, others=case.others, catalogue=case.catalogue)
    err = info.value
    assert type(err) is case.exc
    assert err.code == case.exc.code
    assert err.http_status == case.exc.http_status
    assert case.key in err.keys, err.keys
    matching = [p for p in err.problems if p["key"] == case.key and p["code"] == case.problem]
    assert matching, err.problems
    if case.mentions is not None:
        assert any(case.mentions in p["message"] for p in matching), matching
    for name, value in case.extra.items():
        assert matching[0][name] == value
    if isinstance(case.payload.get("name"), str) and case.key != "name":
        assert matching[0]["slot"] == case.payload["name"]
    # The error renders for the API (code, message, keys, problems) and the payload is not
    # mutated (the guard strips model-owned keys from its own copy only).
    body = err.to_dict()["error"]
    assert body["code"] == case.exc.code
    assert body["keys"] == err.keys
    assert body["problems"] == err.problems
    assert repr(case.payload) == before


def test_table_covers_every_flag_env_var_and_model_key() -> None:
    ids = {c.id for c in CASES}
    for flag in HARDWARE_FLAGS:
        assert f"hw-flag{flag}-sep" in ids and f"hw-flag{flag}-eq" in ids
    for var in HARDWARE_ENV_VARS:
        assert f"hw-env-{var}" in ids
    for key in MODEL_OWNED_KEYS:
        assert {f"model-owned-top-{key}", f"model-owned-in-model-{key}"} <= ids
    # the spec's list of owned flags is covered by the schema's table
    spec_flags = {"--device", "-ngl", "--n-gpu-layers", "--main-gpu", "--tensor-split"}
    spec_flags |= {"--split-mode", "--gpu-memory-utilization", "--tensor-parallel-size"}
    spec_flags |= {"--port", "--host"}
    assert spec_flags <= HARDWARE_FLAGS
    spec_env = {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
    assert spec_env <= HARDWARE_ENV_VARS
    assert {"context_length", "chat_template", "mmproj", "temperature"} <= MODEL_OWNED_KEYS


def test_every_offending_key_is_named_at_once() -> None:
    payload = _with(
        temperature=0.2,
        model={"default": "m1", "context_length": 4096},
        server={
            "extra_args": ["-ngl", "99", "--ctx-size", "8192"],
            "env": {"HIP_VISIBLE_DEVICES": "1"},
        },
        port=0,
    )
    with pytest.raises(SlotConfigError) as info:
        guard_slot_write_payload(payload, catalogue=CATALOGUE)
    assert info.value.keys == sorted(
        [
            "model.context_length",
            "port",
            "server.env.HIP_VISIBLE_DEVICES",
            "server.extra_args[0]",
            "server.extra_args[2]",
            "temperature",
        ]
    )
    assert "(+5 more)" in info.value.message


def test_npu_rule_mixed_with_other_problems_is_a_config_error() -> None:
    # NpuExclusivityViolation only when the NPU rule is the whole story.
    with pytest.raises(SlotConfigError) as info:
        guard_slot_write_payload(
            _with(device="npu", port=9001, model={"default": "m1"}),
            others=[NPU_ACTIVE],
            catalogue=CATALOGUE,
        )
    assert type(info.value) is SlotConfigError
    assert {p["code"] for p in info.value.problems} == {"slot.duplicate_port", "slot.npu_exclusive"}


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(_with(device="npu"), id="npu-llm-not-activated"),
        pytest.param(_with(device="npu", model={"default": ""}), id="npu-llm-empty-default"),
        pytest.param(
            _with(device="npu", type="embedding", model={"default": "m1"}), id="npu-embedding"
        ),
        pytest.param(_with(device="gpu", model={"default": "m1"}), id="gpu-llm"),
    ],
)
def test_npu_rule_only_counts_activated_llm_slots(payload: dict[str, Any]) -> None:
    spec = guard_slot_write_payload(payload, others=[NPU_ACTIVE], catalogue=CATALOGUE)
    assert spec.name == "chat"


def test_first_npu_llm_is_accepted_when_the_other_is_not_activated() -> None:
    idle = SlotSpec(name="npu-idle", provider="llamacpp", device="npu", port=9001)
    spec = guard_slot_write_payload(
        _with(device="npu", model={"default": "m1"}), others=[idle], catalogue=CATALOGUE
    )
    assert spec.activated and spec.device == "npu"


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(BASE, id="minimal"),
        pytest.param(_with(name="a"), id="one-char-name"),
        pytest.param(_with(name="a" * 63), id="63-char-name"),
        pytest.param(_with(name="0-9"), id="digits-and-dash"),
        pytest.param(_with(port=1), id="port-1"),
        pytest.param(_with(port=65535), id="port-65535"),
        pytest.param(_with(priority=0, pinned=True, autoload=False), id="priority-0"),
        pytest.param(_with(priority=100), id="priority-100"),
        pytest.param(_with(idle_timeout_s=0, ttl_s=0, drain_timeout_s=0), id="zero-timeouts"),
        pytest.param(_with(idle_timeout_s=600, ttl_s=1.5), id="int-and-float-timeouts"),
        pytest.param(_with(model={"default": "m2"}), id="bound-model"),
        pytest.param(
            _with(
                server={
                    "image": "ghcr.io/ggml-org/llama.cpp:server",
                    "extra_args": ["--parallel", "2", "--flash-attn", "-"],
                    "env": {"OMP_NUM_THREADS": "4"},
                }
            ),
            id="harmless-server-args",
        ),
        pytest.param(_with(provider="kokoro", type="tts"), id="self-managed-no-model"),
    ],
)
def test_accepted_payload(payload: dict[str, Any]) -> None:
    spec = guard_slot_write_payload(payload, others=[OTHER], catalogue=CATALOGUE)
    assert isinstance(spec, SlotSpec)
    assert spec.name == payload["name"]
    assert spec.port == payload["port"]


def test_a_port_left_out_or_auto_is_the_controllers_to_choose() -> None:
    """Issue 24: no port (or ``"auto"``) is no error, and two such slots do not clash
    (the controller gives each its own); a declared port is still unique."""
    auto = SlotSpec(name="auto-a", provider="demo")
    for payload in ({"name": "a", "provider": "demo"}, _with(port="auto")):
        spec = guard_slot_write_payload(payload, others=[OTHER, auto], catalogue=CATALOGUE)
        assert spec.port is None
    fixed = guard_slot_write_payload(_with(port=9002), others=[auto], catalogue=CATALOGUE)
    assert fixed.port == 9002


def test_every_provider_device_and_type_is_accepted() -> None:
    for provider in PROVIDERS:
        for device in DEVICES:
            for kind in KINDS:
                spec = guard_slot_write_payload(_with(provider=provider, device=device, type=kind))
                assert (spec.provider, spec.device, spec.type) == (provider, device, kind)


def test_model_reference_is_not_checked_without_a_catalogue() -> None:
    spec = guard_slot_write_payload(_with(model={"default": "anything"}))
    assert spec.model_id == "anything"


def test_guard_changes_nothing_and_is_idempotent() -> None:
    payload = _with(model={"default": "m1"}, autoload=True, server={"extra_args": ["-t", "8"]})
    spec = guard_slot_write_payload(payload, catalogue=CATALOGUE)
    again = guard_slot_write_payload(spec.model_dump(mode="json"), catalogue=CATALOGUE)
    assert again == spec


# ---------------------------------------------------------------------------- lru key


def test_retired_lru_key_is_ignored_with_one_warning() -> None:
    check = check_slot_payload(_with(lru=True))
    assert check.errors == []
    assert check.spec is not None
    assert [(p.code, p.key, p.slot, p.severity) for p, _ in check.warnings] == [
        ("slot.lru_flag_retired", "lru", "chat", "warning")
    ]
    assert check.spec == guard_slot_write_payload(BASE)  # ignored: same spec as without it
    assert "lru" not in check.spec.model_dump()


def test_retired_lru_key_does_not_hide_real_errors() -> None:
    check = check_slot_payload(_with(lru=False, port=0))
    assert check.spec is None
    assert [p.code for p, _ in check.errors] == ["slot.invalid_value"]
    assert [p.code for p, _ in check.warnings] == ["slot.lru_flag_retired"]


def test_guard_accepts_lru() -> None:
    assert guard_slot_write_payload(_with(lru=True)).name == "chat"


def test_lru_warns_once_per_slot_through_the_loader(tmp_path: Any) -> None:
    stack = tmp_path / "s.toml"
    stack.write_text(
        '[stack]\nname = "s"\n\n'
        '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\nlru = true\n\n'
        '[[slot]]\nname = "b"\nprovider = "demo"\nport = 2\nlru = false\n\n'
        '[[slot]]\nname = "c"\nprovider = "demo"\nport = 3\n'
    )
    report = load_stacks([stack])
    assert report.ok, report.errors
    assert [(w.code, w.slot, w.line) for w in report.warnings] == [
        ("slot.lru_flag_retired", "a", 8),
        ("slot.lru_flag_retired", "b", 14),
    ]
    assert report.state is not None and set(report.state.slots) == {"a", "b", "c"}


# ------------------------------------------------------------------------- hypothesis

_KNOWN_KEYS = sorted(
    {*SlotSpec.model_fields, *MODEL_OWNED_KEYS, "lru", "default", "image", "extra_args", "env"}
)
_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16)
    | st.sampled_from([*HARDWARE_FLAGS, *MODEL_OWNED_FLAGS, *HARDWARE_ENV_VARS, "8081", "m1"])
)
_keys = st.sampled_from(_KNOWN_KEYS) | st.text(max_size=12)
_values = st.recursive(
    _leaves,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(_keys | st.integers(), kids, max_size=4)
    ),
    max_leaves=16,
)
_VALID_BASE: dict[str, Any] = {
    "name": "chat",
    "provider": "llamacpp",
    "model": {"default": "m1"},
    "device": "gpu",
    "type": "llm",
    "port": 8081,
    "autoload": True,
    "priority": 70,
    "pinned": False,
    "idle_timeout_s": 300,
    "ttl_s": 0,
    "server": {"image": "x", "extra_args": ["--parallel", "2"], "env": {"A": "1"}},
}


_SECTION_KEYS: dict[str | None, list[str]] = {
    None: sorted({*SlotSpec.model_fields, *MODEL_OWNED_KEYS, "lru"}),
    "model": sorted({"default", *MODEL_OWNED_KEYS}),
    "server": sorted(ServerSpec.model_fields),
}


@st.composite
def _mutated(draw: st.DrawFn) -> dict[str, Any]:
    """A valid payload with 1..4 random edits, biased towards the keys the guard inspects."""
    payload = copy.deepcopy(_VALID_BASE)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["set", "delete", "append-arg", "set-env"]))
        server = payload.get("server")
        if (
            op == "append-arg"
            and isinstance(server, dict)
            and isinstance(server.get("extra_args"), list)
        ):
            server["extra_args"].append(draw(_leaves))
            continue
        if op == "set-env" and isinstance(server, dict) and isinstance(server.get("env"), dict):
            server["env"][draw(_keys | st.sampled_from(sorted(HARDWARE_ENV_VARS)))] = draw(_leaves)
            continue
        section = draw(st.sampled_from([None, "model", "server"]))
        target = payload.get(section) if section else payload
        if not isinstance(target, dict):
            target, section = payload, None
        key = draw(st.sampled_from(_SECTION_KEYS[section]) | _keys)
        if op == "delete":
            target.pop(key, None)
        else:
            target[key] = draw(_values)
    return payload


_payloads = _values | st.dictionaries(_keys, _values, max_size=8) | _mutated()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=_payloads, with_context=st.booleans())
def test_any_payload_is_accepted_or_refused_with_a_typed_error(
    payload: Any, with_context: bool
) -> None:
    others = [OTHER, NPU_ACTIVE] if with_context else []
    catalogue = CATALOGUE if with_context else None
    try:
        spec = guard_slot_write_payload(payload, others=others, catalogue=catalogue)
    except SlotctlError as err:
        assert isinstance(err, SlotConfigError)
        assert err.problems, "a refusal names at least one problem"
        for problem in err.problems:
            assert problem["code"] and problem["message"]
        return
    assert isinstance(spec, SlotSpec)
    # What the guard accepts, it accepts again (dumped as JSON, as the API would store it).
    assert (
        guard_slot_write_payload(spec.model_dump(mode="json"), others=others, catalogue=catalogue)
        == spec
    )


@settings(max_examples=200, deadline=None)
@given(payload=_mutated())
def test_check_slot_payload_never_raises(payload: dict[str, Any]) -> None:
    check = check_slot_payload(payload)
    assert (check.spec is None) == bool(check.errors)


def test_create_refuses_an_existing_slot_file_under_the_lock(tmp_path: Path) -> None:
    from controller.spec.guard import write_slot_config

    payload = {"name": "dup", "provider": "demo", "port": 9100, "model": {"default": ""}}
    write_slot_config(tmp_path, payload, create=True)
    with pytest.raises(SlotConfigError, match="already exists"):
        write_slot_config(tmp_path, {**payload, "port": 9101}, create=True)
    assert "9100" in (tmp_path / "slots" / "dup.toml").read_text()
