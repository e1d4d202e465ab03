"""API keys (issue 23): created once, stored as hashes (0600), scoped, expiring, revoked,
seen by a running controller within a second without a restart."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from controller.access.keys import (
    KEY_PREFIX,
    TOKEN_PRINCIPAL,
    KeyHold,
    KeyRing,
    Scope,
    create_key,
    hash_key,
    parse_duration,
    revoke_key,
)
from controller.model.errors import InvalidRequest, KeyNotFound, SlotctlError


def test_a_key_is_shown_once_and_stored_as_its_hash_only(tmp_path: Path) -> None:
    key, entry = create_key(tmp_path, "chat-ui", scope=Scope.INFERENCE, models=["qwen-*"])
    assert key.startswith(KEY_PREFIX) and len(key) > len(KEY_PREFIX) + 40
    path = tmp_path / "keys.json"
    text = path.read_text()
    assert key not in text and key[len(KEY_PREFIX) :] not in text
    assert json.loads(text)["keys"][0]["sha256"] == hash_key(key) == entry.sha256
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other, _ = create_key(tmp_path, "ci", scope=Scope.READ)
    assert other != key  # random, not derived from the name


def test_identify_scopes_models_and_the_token(tmp_path: Path) -> None:
    key, _ = create_key(
        tmp_path, "ui", scope=Scope.INFERENCE, models=["qwen-*"], priority="interactive"
    )
    ring = KeyRing(tmp_path, token="the-token")
    admin = ring.identify("the-token", now=0.0, wall=100.0)
    assert admin is not None and admin.scope is Scope.ADMIN and admin.is_token
    who = ring.identify(key, now=0.0, wall=100.0)
    assert who is not None and who.name == "ui" and who.scope is Scope.INFERENCE
    assert who.priority == "interactive"
    assert who.may_use("qwen-7b") and not who.may_use("llama-3")
    assert ring.identify(key + "x", now=0.0, wall=100.0) is None
    assert ring.identify("", now=0.0, wall=100.0) is None
    assert ring.last_used == {"ui": 100.0}


def test_new_and_revoked_keys_are_seen_within_a_second(tmp_path: Path) -> None:
    ring = KeyRing(tmp_path, token="t")
    assert ring.current(0.0) == {}
    key, _ = create_key(tmp_path, "late", scope=Scope.READ)
    assert ring.identify(key, now=0.5, wall=1.0) is None  # not looked at again yet
    assert ring.identify(key, now=1.5, wall=2.0) is not None
    revoke_key(tmp_path, "late")
    assert ring.identify(key, now=3.0, wall=3.0) is None
    with pytest.raises(KeyNotFound, match="no key named"):
        revoke_key(tmp_path, "late")


def test_an_expired_key_is_refused(tmp_path: Path) -> None:
    key, entry = create_key(tmp_path, "temp", scope=Scope.ADMIN, expires_in_s=60, now=1000.0)
    assert entry.expires_at == 1060.0
    ring = KeyRing(tmp_path, token="t")
    assert ring.identify(key, now=0.0, wall=1059.0) is not None
    assert ring.identify(key, now=0.0, wall=1060.0) is None
    (listed,) = ring.describe(wall=1061.0)
    assert listed["expired"] is True and "sha256" not in listed


def test_a_held_key_is_recognised_again_as_identify_would_say(tmp_path: Path) -> None:
    """KeyRing.again (a kept-alive client's key, issue 41 item 4): identify's answer without
    hashing the secret again — the same principal, marked used — while keys.json holds the
    same keys; None (look again) once it changed or the key expired."""
    key, _ = create_key(tmp_path, "ui", scope=Scope.INFERENCE, expires_in_s=60, now=1000.0)
    ring = KeyRing(tmp_path, token="t")
    assert ring.hold("t", now=0.0, wall=1000.0) is TOKEN_PRINCIPAL
    held = ring.hold(key, now=0.0, wall=1001.0)
    assert isinstance(held, KeyHold)
    assert held.principal == ring.identify(key, now=0.0, wall=1001.0)
    assert ring.again(held, now=0.5, wall=1002.0) is held.principal
    assert ring.last_used == {"ui": 1002.0}
    assert ring.again(held, now=0.5, wall=1060.0) is None  # expired, as identify says
    assert ring.identify(key, now=0.5, wall=1060.0) is None
    create_key(tmp_path, "ci", scope=Scope.READ)  # keys.json changed
    assert ring.again(held, now=0.9, wall=1003.0) is held.principal  # not looked at yet
    assert ring.again(held, now=1.5, wall=1003.0) is None  # looked at: identify again
    again = ring.hold(key, now=1.5, wall=1003.0)
    assert isinstance(again, KeyHold) and again.principal == held.principal
    revoke_key(tmp_path, "ui")
    assert ring.again(again, now=3.0, wall=1004.0) is None
    assert ring.identify(key, now=3.0, wall=1004.0) is None


def test_a_broken_keys_file_fails_closed_and_says_why(tmp_path: Path) -> None:
    key, _ = create_key(tmp_path, "ui", scope=Scope.INFERENCE)
    ring = KeyRing(tmp_path, token="t")
    assert ring.identify(key, now=0.0, wall=0.0) is not None
    (tmp_path / "keys.json").write_text("{not json")
    assert ring.identify(key, now=2.0, wall=0.0) is None
    assert ring.error is not None and "not a valid keys file" in ring.error
    assert ring.identify("t", now=3.0, wall=0.0) is not None  # the token still works
    with pytest.raises(SlotctlError):
        create_key(tmp_path, "more", scope=Scope.READ)  # never overwrites what it cannot read


def test_names_durations_and_scopes_are_checked() -> None:
    assert parse_duration("90s") == 90 and parse_duration("2h") == 7200
    assert parse_duration("1.5d") == 129600 and parse_duration("2w") == 1209600
    for bad in ("", "10", "5y", "-1h", "h"):
        with pytest.raises(InvalidRequest):
            parse_duration(bad)
    assert Scope.parse("Read") is Scope.READ
    with pytest.raises(InvalidRequest, match="unknown scope"):
        Scope.parse("root")
    assert Scope.ADMIN > Scope.READ > Scope.INFERENCE


def test_duplicate_and_bad_names_are_refused(tmp_path: Path) -> None:
    create_key(tmp_path, "a", scope=Scope.READ)
    with pytest.raises(InvalidRequest, match="exists"):
        create_key(tmp_path, "a", scope=Scope.READ)
    for bad in ("", "A", "has space", "x" * 70, "../etc"):
        with pytest.raises(InvalidRequest, match="invalid key name"):
            create_key(tmp_path, bad, scope=Scope.READ)
