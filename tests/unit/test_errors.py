"""Typed errors: the SPEC §1 table of codes and HTTP statuses, and the JSON body shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

import controller.model.errors as errors_module
from controller.model.errors import (
    IllegalSlotTransition,
    InsufficientMemory,
    ModelNotFound,
    NpuExclusivityViolation,
    SlotConfigError,
    SlotCrashLooping,
    SlotctlError,
    SlotHealthFailed,
    SlotLoadStopped,
    SlotNotFound,
    SlotNotReady,
    SlotPinned,
    SlotSpawnFailed,
    SlotTerminateTimeout,
)

# SPEC §1 "Typed errors", literally: class name -> (code, HTTP status).
SPEC_ERRORS: dict[str, tuple[str, int]] = {
    "SlotNotFound": ("slot.not_found", 404),
    "IllegalSlotTransition": ("slot.illegal_transition", 409),
    "SlotNotReady": ("slot.not_ready", 503),
    "SlotLoadStopped": ("slot.load_stopped", 503),
    "SlotSpawnFailed": ("slot.spawn_failed", 500),
    "SlotHealthFailed": ("slot.health_failed", 503),
    "SlotCrashLooping": ("slot.crash_looping", 503),
    "SlotTerminateTimeout": ("slot.terminate_timeout", 504),
    "SlotConfigError": ("slot.config_error", 400),
    "NpuExclusivityViolation": ("slot.npu_exclusive", 409),
    "SlotPinned": ("slot.pinned", 409),
    "InsufficientMemory": ("model.insufficient_memory", 409),
    "ModelNotFound": ("model.not_found", 404),
}
# Beyond the SPEC §1 table: the router's bounded wait queue (SPEC §7: 429 + Retry-After).
EXTRA_ERRORS: dict[str, tuple[str, int]] = {
    "SlotQueueFull": ("slot.queue_full", 429),
    "DockerEngineError": ("runtime.engine_error", 502),
    "DockerUnavailable": ("runtime.unavailable", 503),
    "ControllerAlreadyRunning": ("controller.already_running", 409),
    "ListenUnavailable": ("controller.listen_unavailable", 409),
    "InvalidRequest": ("request.invalid", 400),
    "ImportSourceError": ("import.invalid_source", 400),
    "Unauthorized": ("auth.unauthorized", 401),
    "SlotOwnedByStack": ("slot.owned_by_stack", 409),
    "StateWriteFailed": ("state.write_failed", 503),
    "DeviceUnavailable": ("device.unavailable", 409),
    # Issue 26: a hung server, the allowlists, DNS rebinding.
    "SlotUpstreamTimeout": ("slot.upstream_timeout", 504),
    "ServerNotAllowed": ("slot.server_not_allowed", 403),
    "HostNotAllowed": ("request.host_not_allowed", 421),
    # Issue 22: a wake that failed (the server is restarted instead).
    "SlotWakeFailed": ("slot.wake_failed", 503),
    # Issue 23: keys, their scopes and limits.
    "Forbidden": ("auth.forbidden", 403),
    "KeyNotFound": ("key.not_found", 404),
    "KeyLimited": ("key.rate_limited", 429),
    "KeyConcurrencyLimited": ("key.concurrency_limit", 429),
    # Issue 35: model files pulled, verified and admitted on disk.
    "ModelFileMissing": ("model.file_missing", 409),
    "InsufficientDisk": ("model.insufficient_disk", 507),
    "ModelPullFailed": ("model.pull_failed", 502),
    "ModelAccessDenied": ("model.access_denied", 403),
    "ModelVerifyFailed": ("model.verify_failed", 502),
    "ModelInUse": ("model.in_use", 409),
    # Issue 37: LoRA adapters inside slots.
    "AdapterNotFound": ("adapter.not_found", 404),
    "AdapterUnavailable": ("adapter.unavailable", 503),
    "AdapterLoadFailed": ("adapter.load_failed", 502),
}
ALL_ERRORS = {**SPEC_ERRORS, **EXTRA_ERRORS}


def _make(name: str) -> SlotctlError:
    """One instance of each class, built the way callers build it."""
    builders: dict[str, Any] = {
        "SlotNotFound": lambda: SlotNotFound("llm-a"),
        "IllegalSlotTransition": lambda: IllegalSlotTransition(
            "illegal", from_state="offline", to_state="ready", legal=["pulling", "starting"]
        ),
        "SlotNotReady": lambda: SlotNotReady("slot llm-a is warming", slot="llm-a"),
        "SlotLoadStopped": lambda: SlotLoadStopped(
            "slot 'llm-a': its load was stopped", retry_after_s=5.0, slot="llm-a"
        ),
        "SlotSpawnFailed": lambda: SlotSpawnFailed("exec failed", slot="llm-a"),
        "SlotHealthFailed": lambda: SlotHealthFailed("warmup timeout", slot="llm-a"),
        "SlotCrashLooping": lambda: SlotCrashLooping("backing off", retry_after_s=4.0),
        "SlotTerminateTimeout": lambda: SlotTerminateTimeout("still running", slot="llm-a"),
        "SlotConfigError": lambda: SlotConfigError("bad port", keys=["port"]),
        "NpuExclusivityViolation": lambda: NpuExclusivityViolation(
            "two slots on npu0", keys=["device"]
        ),
        "SlotPinned": lambda: SlotPinned("llm-a", "unload"),
        "InsufficientMemory": lambda: InsufficientMemory(
            "does not fit", needed_bytes=10, free_bytes=3, evictable_bytes=4
        ),
        "ModelNotFound": lambda: ModelNotFound("qwen2.5-7b:q4"),
        "SlotQueueFull": lambda: errors_module.SlotQueueFull("64 waiting", retry_after_s=1.0),
        "DockerEngineError": lambda: errors_module.DockerEngineError("no such image"),
        "DockerUnavailable": lambda: errors_module.DockerUnavailable("no socket"),
        "ControllerAlreadyRunning": lambda: errors_module.ControllerAlreadyRunning("pid 1"),
        "ListenUnavailable": lambda: errors_module.ListenUnavailable("in use", listen="x:1"),
        "InvalidRequest": lambda: errors_module.InvalidRequest("body is not JSON"),
        "ImportSourceError": lambda: errors_module.ImportSourceError(
            "config.yaml: not YAML", source="config.yaml"
        ),
        "Unauthorized": lambda: errors_module.Unauthorized("missing bearer token"),
        "Forbidden": lambda: errors_module.Forbidden("read scope", key="k", needs="admin"),
        "KeyNotFound": lambda: errors_module.KeyNotFound("no key named 'k'", name="k"),
        "KeyLimited": lambda: errors_module.KeyLimited("2 a minute", retry_after_s=30.0, key="k"),
        "KeyConcurrencyLimited": lambda: errors_module.KeyConcurrencyLimited(
            "1 at once", retry_after_s=1.0, key="k"
        ),
        "SlotOwnedByStack": lambda: errors_module.SlotOwnedByStack(
            "llm-a", "prod", "/srv/stacks", "remove"
        ),
        "DeviceUnavailable": lambda: errors_module.DeviceUnavailable(
            "slot 'chat' is pinned to GPU 3, which this host does not have",
            slot="chat",
            device="3",
            reason="not_found",
            gpus=[],
        ),
        "SlotUpstreamTimeout": lambda: errors_module.SlotUpstreamTimeout(
            "no byte for 120s", slot="llm-a", idle_s=120.0
        ),
        "ServerNotAllowed": lambda: errors_module.ServerNotAllowed(
            "binary not allowed", keys=["server.binary"]
        ),
        "HostNotAllowed": lambda: errors_module.HostNotAllowed("Host 'evil.example'"),
        "SlotWakeFailed": lambda: errors_module.SlotWakeFailed("no wake", slot="llm-a"),
        "ModelInUse": lambda: errors_module.ModelInUse("qwen", ["chat"]),
        "ModelFileMissing": lambda: errors_module.ModelFileMissing(
            "chat", "/models/chat.gguf", "chat.gguf"
        ),
        "InsufficientDisk": lambda: errors_module.InsufficientDisk(
            "needs 4 GiB", needed_bytes=4 << 30, free_bytes=1 << 30, margin_bytes=1 << 29
        ),
        "ModelPullFailed": lambda: errors_module.ModelPullFailed(
            "connection reset", source="hf://o/r/f.gguf", reason="network"
        ),
        "ModelAccessDenied": lambda: errors_module.ModelAccessDenied(
            "gated", source="hf://o/r/f.gguf", reason="gated", token_sent=False
        ),
        "ModelVerifyFailed": lambda: errors_module.ModelVerifyFailed(
            "sha256 mismatch", model="chat", quarantined="/models/.slotctl/quarantine/x"
        ),
        "AdapterNotFound": lambda: errors_module.AdapterNotFound(
            "adapter 'sql' is not declared", adapter="sql"
        ),
        "AdapterUnavailable": lambda: errors_module.AdapterUnavailable(
            "no place", retry_after_s=1, adapter="sql", slot="chat", waitable=False
        ),
        "AdapterLoadFailed": lambda: errors_module.AdapterLoadFailed(
            "HTTP 400", adapter="sql", slot="chat"
        ),
        "StateWriteFailed": lambda: errors_module.StateWriteFailed(
            "/var/lib/slotctl/slots/llm-a/state.json", OSError(28, "No space left on device")
        ),
    }
    err: SlotctlError = builders[name]()
    return err


@pytest.mark.parametrize("name", sorted(ALL_ERRORS))
def test_code_and_status_match_spec(name: str) -> None:
    code, status = ALL_ERRORS[name]
    cls = getattr(errors_module, name)
    assert issubclass(cls, SlotctlError)
    assert cls.code == code
    assert cls.http_status == status
    err = _make(name)
    assert type(err) is cls
    assert err.code == code
    assert err.http_status == status


@pytest.mark.parametrize("name", sorted(ALL_ERRORS))
def test_to_dict_shape(name: str) -> None:
    err = _make(name)
    body = err.to_dict()
    assert list(body) == ["error"]
    inner = body["error"]
    assert inner["code"] == ALL_ERRORS[name][0]
    assert inner["message"] == str(err) == err.message
    assert isinstance(inner["message"], str)
    assert inner["message"]
    for key, value in err.details.items():
        assert inner[key] == value
    assert set(inner) == {"code", "message", *err.details}
    # The body is what the API sends: it must be JSON as-is.
    assert json.loads(json.dumps(body)) == body


def test_every_public_error_is_in_the_spec_table() -> None:
    public = {n for n in errors_module.__all__ if n != "SlotctlError"}
    assert public == set(ALL_ERRORS)


def test_codes_are_unique() -> None:
    codes = [code for code, _ in ALL_ERRORS.values()]
    assert len(set(codes)) == len(codes)
    assert "internal" not in codes


def test_base_error_is_internal_500() -> None:
    err = SlotctlError("boom", where="x")
    assert err.code == "internal"
    assert err.http_status == 500
    assert err.to_dict() == {"error": {"code": "internal", "message": "boom", "where": "x"}}
    assert isinstance(err, Exception)
    assert repr(err) == "SlotctlError('boom')"


def test_details_can_not_override_code_or_message() -> None:
    # A detail that happens to be called "code" (an exit code, say) must not replace the
    # stable error code in the body.
    err = SlotSpawnFailed("llama-server exited", code=127)
    body = err.to_dict()["error"]
    assert body["code"] == "slot.spawn_failed"
    assert body["message"] == "llama-server exited"


def test_slot_crash_looping_carries_retry_after() -> None:
    err = SlotCrashLooping("slot llm-a failed 3 times", retry_after_s=8.0, failures=3)
    assert err.retry_after_s == 8.0
    assert err.to_dict() == {
        "error": {
            "code": "slot.crash_looping",
            "message": "slot llm-a failed 3 times",
            "retry_after_s": 8.0,
            "failures": 3,
        }
    }


def test_slot_crash_looping_requires_retry_after() -> None:
    with pytest.raises(TypeError):
        SlotCrashLooping("no retry")  # type: ignore[call-arg]


def test_insufficient_memory_details() -> None:
    err = InsufficientMemory(
        "model needs 8 GiB", needed_bytes=8 << 30, free_bytes=2 << 30, evictable_bytes=4 << 30
    )
    inner = err.to_dict()["error"]
    assert inner["code"] == "model.insufficient_memory"
    assert inner["needed_bytes"] == 8 << 30
    assert inner["free_bytes"] == 2 << 30
    assert inner["evictable_bytes"] == 4 << 30
    assert err.http_status == 409
    with pytest.raises(TypeError):
        InsufficientMemory("x", needed_bytes=1, free_bytes=0)  # type: ignore[call-arg]


def test_slot_config_error_keys_and_problems() -> None:
    problems = [{"path": "slots.a.port", "message": "must be 1..65535"}]
    err = SlotConfigError("bad config", keys=["port", "ctx"], problems=problems)
    assert err.keys == ["port", "ctx"]
    assert err.problems == problems
    inner = err.to_dict()["error"]
    assert inner["keys"] == ["port", "ctx"]
    assert inner["problems"] == problems
    assert inner["code"] == "slot.config_error"
    assert err.http_status == 400


def test_slot_config_error_defaults_to_empty_lists() -> None:
    err = SlotConfigError("bad")
    assert err.keys == []
    assert err.problems == []
    assert err.to_dict()["error"] == {
        "code": "slot.config_error",
        "message": "bad",
        "keys": [],
        "problems": [],
    }


def test_npu_exclusivity_is_a_config_error_with_its_own_code() -> None:
    err = NpuExclusivityViolation("npu0 is exclusive", keys=["device"], slots=["a", "b"])
    assert isinstance(err, SlotConfigError)
    assert issubclass(NpuExclusivityViolation, SlotConfigError)
    assert err.code == "slot.npu_exclusive"
    assert err.http_status == 409
    inner = err.to_dict()["error"]
    assert inner["code"] == "slot.npu_exclusive"
    assert inner["keys"] == ["device"]
    assert inner["slots"] == ["a", "b"]
    # Catchable as the parent, which is how the spec loader reports config problems.
    with pytest.raises(SlotConfigError):
        raise err


def test_slot_not_found_and_model_not_found_name_the_thing() -> None:
    slot = SlotNotFound("llm-a")
    assert "llm-a" in str(slot)
    assert slot.to_dict()["error"]["slot"] == "llm-a"
    model = ModelNotFound("org/repo")
    assert "org/repo" in str(model)
    assert model.to_dict()["error"]["model"] == "org/repo"


def test_slot_pinned_says_force() -> None:
    err = SlotPinned("llm-a", "evict")
    assert "force=true" in str(err)  # the API's query parameter
    assert "--force" in str(err)  # the CLI's flag
    assert "llm-a" in str(err)
    assert err.to_dict()["error"]["action"] == "evict"
    assert err.to_dict()["error"]["slot"] == "llm-a"


def test_errors_are_raisable_and_caught_by_base() -> None:
    for name in SPEC_ERRORS:
        with pytest.raises(SlotctlError) as info:
            raise _make(name)
        assert info.value.code == SPEC_ERRORS[name][0]


def test_state_write_failed_names_path_and_errno_and_asks_to_retry() -> None:
    """Issue 13: a full (or read-only) state dir is a typed 503 with Retry-After."""
    import errno

    from controller.api.app import error_response

    err = errors_module.StateWriteFailed("/s/slots/a/state.json", OSError(errno.EROFS, "RO"))
    inner = err.to_dict()["error"]
    assert inner["path"] == "/s/slots/a/state.json"
    assert inner["errno"] == errno.EROFS
    assert inner["errno_name"] == "EROFS"
    assert "EROFS" in err.message and "/s/slots/a/state.json" in err.message
    response = error_response(err)
    assert response.status == 503
    assert response.headers["Retry-After"] == "5"


def test_slot_owned_by_stack_names_the_stack() -> None:
    err = errors_module.SlotOwnedByStack("llm-a", "prod", "/srv/stacks", "remove")
    inner = err.to_dict()["error"]
    assert (inner["slot"], inner["stack"], inner["stack_dir"]) == ("llm-a", "prod", "/srv/stacks")
    assert "prod" in err.message and "/srv/stacks" in err.message
