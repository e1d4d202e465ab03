"""Observed-state persistence: atomic writes, the state store and the residency store."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from controller.model.errors import SlotConfigError, SlotctlError
from controller.model.lifecycle import SlotState
from controller.store.files import atomic_write_bytes, atomic_write_json, check_slot_name, utcnow
from controller.store.lock import ensure_token
from controller.store.residency import ResidencyEntry, ResidencyStore
from controller.store.state import SlotStateRecord, StateExtra, StateStore

INVALID_NAMES = ["../x", "A", "a" * 64, "", "a/b", "-a", "a-", "a_b", ".", "..", "a b", "/abs"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- atomic writes --------------------------------------------------------------------------


def test_atomic_write_bytes_content_and_default_mode(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"\x00hello\xff")
    assert target.read_bytes() == b"\x00hello\xff"
    assert _mode(target) == 0o644
    assert _entries(tmp_path) == ["f.bin"]


def test_atomic_write_bytes_mode_and_replace(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    atomic_write_bytes(target, b"one", mode=0o600)
    assert _mode(target) == 0o600
    inode_before = target.stat().st_ino
    atomic_write_bytes(target, b"two", mode=0o640)
    assert target.read_bytes() == b"two"
    assert _mode(target) == 0o640
    # Replaced by rename, not rewritten in place.
    assert target.stat().st_ino != inode_before
    assert _entries(tmp_path) == ["secret"]


def test_a_temp_file_left_by_a_killed_writer_is_reused_with_the_right_mode(
    tmp_path: Path,
) -> None:
    # The temp name is per process and thread: a writer killed between its temp write
    # and its rename (a pid reused later) leaves one that the next write truncates,
    # with the mode set again, and renames; nothing of the old content survives.
    import threading

    target = tmp_path / "token"
    stale = tmp_path / f".token.{os.getpid()}.{threading.get_ident()}.tmp"
    stale.write_bytes(b"x" * 10_000)
    stale.chmod(0o666)
    atomic_write_bytes(target, b"secret\n", mode=0o600)
    assert target.read_bytes() == b"secret\n"
    assert _mode(target) == 0o600
    assert _entries(tmp_path) == ["token"]


def test_a_symlink_in_place_of_the_temp_file_is_not_followed(tmp_path: Path) -> None:
    import threading

    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    state = tmp_path / "state"
    state.mkdir()
    (state / f".s.json.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(outside)
    with pytest.raises(OSError):
        atomic_write_bytes(state / "s.json", b"data")
    assert outside.read_bytes() == b"keep"
    assert not (state / "s.json").exists()


def test_threads_writing_one_file_at_once_never_tear_it(tmp_path: Path) -> None:
    # Each thread has a temp file of its own: concurrent writers of one path (the lag
    # writer and the loop are serialised by the table, the aux records are not) leave
    # one whole payload and no temp file.
    import threading

    target = tmp_path / "state.json"
    payloads = [json.dumps({"t": t, "pad": "x" * (t * 5_000)}).encode() for t in range(4)]

    def writer(data: bytes) -> None:
        for _ in range(50):
            atomic_write_bytes(target, data, durable=False)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert target.read_bytes() in payloads
    assert _entries(tmp_path) == ["state.json"]


def test_atomic_write_creates_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c.json"
    atomic_write_json(target, {"x": 1})
    assert json.loads(target.read_text()) == {"x": 1}


def test_atomic_write_recreates_a_parent_removed_between_writes(tmp_path: Path) -> None:
    """The parent is made only when missing (not at every write): a slot dir removed by
    hand between two writes is made again by the second."""
    target = tmp_path / "slots" / "a" / "state.json"
    atomic_write_bytes(target, b"one")
    target.unlink()
    target.parent.rmdir()
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert _entries(target.parent) == ["state.json"]


def test_atomic_write_json_content(tmp_path: Path) -> None:
    target = tmp_path / "d.json"
    data = {"b": [1, 2, {"c": None}], "a": "é", "n": 1.5}
    atomic_write_json(target, data)
    text = target.read_text()
    assert json.loads(text) == data
    assert text.endswith("\n")
    assert _mode(target) == 0o644
    assert _entries(tmp_path) == ["d.json"]


def test_state_and_process_records_are_one_line_through_the_c_encoder(tmp_path: Path) -> None:
    """state.json and the runtime records are written at every transition: one line,
    keys sorted (json's C encoder; an indented dump takes the pure-Python encoder), and
    read back as written. Files written rarely (residency.json) stay indented."""
    assert json.encoder.c_make_encoder is not None  # this interpreter has it
    store = StateStore(tmp_path)
    rec = _record("llm-a", SlotState.WARMING, model_id="m", port=8081, message="é")
    store.write(rec)
    store.write_aux("llm-a", "process.json", {"pid": 7, "argv": ["a", "b"]})
    for name in ("state.json", "process.json"):
        text = (tmp_path / "slots" / "llm-a" / name).read_text()
        assert text.count("\n") == 1 and text.endswith("\n"), name
        data = json.loads(text)
        assert text == json.dumps(data, sort_keys=True) + "\n", name
    assert store.read("llm-a") == rec
    assert store.read_aux("llm-a", "process.json") == {"pid": 7, "argv": ["a", "b"]}
    residency = ResidencyStore(tmp_path / "config")
    residency.set("llm-a", "m")
    assert residency.path.read_text().count("\n") > 1


def test_atomic_write_json_unserialisable_leaves_old_file(tmp_path: Path) -> None:
    target = tmp_path / "d.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(TypeError):
        atomic_write_json(target, {"v": object()})
    assert json.loads(target.read_text()) == {"v": 1}
    assert _entries(tmp_path) == ["d.json"]


def test_many_writes_leave_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    for i in range(50):
        atomic_write_json(target, {"i": i, "pad": "x" * (i * 100)})
    assert json.loads(target.read_text())["i"] == 49
    assert _entries(tmp_path) == ["state.json"]


def test_parent_is_a_file_fails_and_leaves_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"i am a file")
    with pytest.raises(OSError):
        atomic_write_bytes(blocker / "state.json", b"data")
    assert blocker.read_bytes() == b"i am a file"
    assert _entries(tmp_path) == ["blocker"]


def test_temp_file_is_removed_when_replace_fails(tmp_path: Path) -> None:
    # The temp file is created and written, then os.replace fails (the target is a
    # non-empty directory): the temp file must not be left behind.
    target = tmp_path / "state.json"
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"data")
    assert _entries(tmp_path) == ["state.json"]
    assert _entries(target) == ["keep"]


def test_temp_file_is_removed_when_write_fails(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        atomic_write_bytes(tmp_path / "x", "not bytes")  # type: ignore[arg-type]
    assert _entries(tmp_path) == []


# --- slot names -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "llm-a", "0", "a" * 63, "x-1-y"])
def test_check_slot_name_accepts_dns_labels(name: str) -> None:
    assert check_slot_name(name) == name


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_check_slot_name_refuses(name: str) -> None:
    with pytest.raises(SlotConfigError) as info:
        check_slot_name(name)
    assert info.value.keys == ["name"]
    assert info.value.http_status == 400


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_state_store_refuses_invalid_names_before_touching_paths(tmp_path: Path, name: str) -> None:
    state_dir = tmp_path / "state"
    store = StateStore(state_dir)
    with pytest.raises(SlotConfigError):
        store.path_for(name)
    with pytest.raises(SlotConfigError):
        store.write(SlotStateRecord(name=name, state=SlotState.OFFLINE))
    with pytest.raises(SlotConfigError):
        store.read(name)
    with pytest.raises(SlotConfigError):
        store.delete(name)
    assert not state_dir.exists()
    assert _entries(tmp_path) == []


def test_traversal_name_does_not_escape(tmp_path: Path) -> None:
    # A file one level up that "../x" would have reached is untouched.
    state_dir = tmp_path / "state"
    (state_dir / "slots").mkdir(parents=True)
    victim = state_dir / "x" / "state.json"
    victim.parent.mkdir()
    victim.write_text("{}")
    store = StateStore(state_dir)
    with pytest.raises(SlotConfigError):
        store.delete("../x")
    with pytest.raises(SlotConfigError):
        store.write(SlotStateRecord(name="../x", state=SlotState.ERROR))
    assert victim.read_text() == "{}"


# --- StateStore -----------------------------------------------------------------------------


def _record(name: str, state: SlotState = SlotState.READY, **kw: Any) -> SlotStateRecord:
    return SlotStateRecord(name=name, state=state, **kw)


def test_write_then_read_round_trip(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    rec = _record(
        "llm-a",
        SlotState.IDLE,
        model_id="qwen2.5-7b:q4",
        port=8081,
        message="idle after 300s",
        extra={"idle_reason": "timeout", "n": [1, 2]},
    )
    store.write(rec)
    path = tmp_path / "slots" / "llm-a" / "state.json"
    assert store.path_for("llm-a") == path
    on_disk = json.loads(path.read_text())
    assert on_disk["state"] == "idle"  # lower-case on the wire
    assert set(on_disk) == {"name", "state", "model_id", "port", "updated_at", "message", "extra"}
    assert store.read("llm-a") == rec
    assert _entries(path.parent) == ["state.json"]


def test_record_defaults() -> None:
    rec = SlotStateRecord(name="a", state=SlotState.OFFLINE)
    assert rec.model_id == ""
    assert rec.port is None
    assert rec.message == ""
    assert rec.extra == StateExtra() and rec.to_json()["extra"] == {}
    assert rec.updated_at.endswith("Z")
    assert utcnow().endswith("Z")


def test_record_accepts_wire_strings_and_ignores_unknown_keys() -> None:
    rec = SlotStateRecord.model_validate({"name": "a", "state": "serving", "future": 1})
    assert rec.state is SlotState.SERVING


def test_read_missing_returns_none(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    assert store.read("nope") is None
    assert store.names() == []
    assert list(store.read_all()) == []


def test_overwrite_keeps_latest(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    for state in (SlotState.OFFLINE, SlotState.STARTING, SlotState.WARMING, SlotState.READY):
        store.write(_record("s", state))
    got = store.read("s")
    assert got is not None
    assert got.state is SlotState.READY


def test_names_and_read_all(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    for name in ("c", "a", "b"):
        store.write(_record(name, model_id=f"m-{name}"))
    # Junk in slots/: an invalid dir name, a stray file, a valid dir with no state.json.
    (tmp_path / "slots" / "Not_Valid").mkdir()
    (tmp_path / "slots" / "stray-file").write_text("x")
    (tmp_path / "slots" / "empty").mkdir()
    assert store.names() == ["a", "b", "c", "empty"]
    records = list(store.read_all())
    assert [r.name for r in records] == ["a", "b", "c"]
    assert [r.model_id for r in records] == ["m-a", "m-b", "m-c"]


def test_delete(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.write(_record("a"))
    store.write(_record("b"))
    store.delete("a")
    assert store.read("a") is None
    assert not (tmp_path / "slots" / "a").exists()
    assert store.names() == ["b"]
    store.delete("a")  # idempotent
    store.delete("never-existed")
    assert store.names() == ["b"]


def test_delete_keeps_a_dir_with_other_files(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.write(_record("a"))
    (tmp_path / "slots" / "a" / "server.log").write_text("log")
    store.delete("a")
    assert store.read("a") is None
    assert (tmp_path / "slots" / "a" / "server.log").read_text() == "log"


def test_sweep_removes_only_temp_files(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    assert store.sweep() == 0  # no slots dir yet
    store.write(_record("a"))
    store.write(_record("b"))
    left_a = tmp_path / "slots" / "a" / ".state.json.abc123.tmp"
    left_b = tmp_path / "slots" / "b" / ".state.json.zzz.tmp"
    left_a.write_text('{"partial"')
    left_b.write_text("")
    keep = tmp_path / "slots" / "a" / "notes.tmp"  # not a dot-file: not ours
    keep.write_text("keep")
    assert store.sweep() == 2
    assert not left_a.exists()
    assert not left_b.exists()
    assert keep.exists()
    assert _entries(tmp_path / "slots" / "a") == ["notes.tmp", "state.json"]
    assert store.read("a") is not None
    assert store.sweep() == 0


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b'{"name": "a", "state": "ready"',  # torn
        b"\xff\xfe\x00garbage",  # not UTF-8
        b"[]",
        b"null",
        b'"ready"',
        b'{"name": "a"}',  # missing state
        b'{"name": "a", "state": "exploded"}',  # unknown state
        b'{"name": "a", "state": "ready", "port": "not-a-port"}',
        b'{"name": "a", "state": "ready", "extra": [1]}',
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the JSON parser's recursion limit
    ],
    ids=[
        "empty",
        "brace",
        "torn",
        "binary",
        "list",
        "null",
        "string",
        "no-state",
        "bad-state",
        "bad-port",
        "bad-extra",
        "deep",
    ],
)
def test_corrupt_state_file_raises_typed_error(tmp_path: Path, content: bytes) -> None:
    store = StateStore(tmp_path)
    path = tmp_path / "slots" / "a" / "state.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(SlotctlError) as info:
        store.read("a")
    assert type(info.value) is SlotctlError
    assert str(path) in str(info.value)
    assert info.value.details["path"] == str(path)
    # read_all surfaces it too rather than silently skipping a corrupt slot.
    with pytest.raises(SlotctlError):
        list(store.read_all())


def test_state_file_that_is_a_directory_raises_typed_error(tmp_path: Path) -> None:
    (tmp_path / "slots" / "a" / "state.json").mkdir(parents=True)
    with pytest.raises(SlotctlError):
        StateStore(tmp_path).read("a")


# --- ResidencyStore -------------------------------------------------------------------------


def test_residency_empty(tmp_path: Path) -> None:
    store = ResidencyStore(tmp_path)
    assert store.path == tmp_path / "residency.json"
    assert store.read() == {}
    assert store.clear("a") is False
    assert not store.path.exists()


def test_residency_set_read_clear(tmp_path: Path) -> None:
    store = ResidencyStore(tmp_path)
    store.set("llm-b", "qwen2.5-7b:q4")
    store.set("llm-a", "org/repo")
    got = store.read()
    assert sorted(got) == ["llm-a", "llm-b"]
    assert got["llm-a"].model_id == "org/repo"
    assert got["llm-b"].model_id == "qwen2.5-7b:q4"
    assert got["llm-a"].since.endswith("Z")
    on_disk = json.loads(store.path.read_text())
    assert list(on_disk["slots"]) == ["llm-a", "llm-b"]

    store.set("llm-a", "other-model")  # overwrite
    assert store.read()["llm-a"].model_id == "other-model"

    assert store.clear("llm-b") is True
    assert sorted(store.read()) == ["llm-a"]
    assert store.clear("llm-b") is False
    assert _entries(tmp_path) == ["residency.json"]  # no temp files left


def test_residency_survives_a_new_instance(tmp_path: Path) -> None:
    ResidencyStore(tmp_path).set("a", "m1")
    assert ResidencyStore(tmp_path).read() == {
        "a": ResidencyEntry(model_id="m1", since=_since(tmp_path))
    }


def _since(config_dir: Path) -> str:
    return str(json.loads((config_dir / "residency.json").read_text())["slots"]["a"]["since"])


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_residency_refuses_invalid_names(tmp_path: Path, name: str) -> None:
    config_dir = tmp_path / "cfg"
    store = ResidencyStore(config_dir)
    with pytest.raises(SlotConfigError):
        store.set(name, "m")
    with pytest.raises(SlotConfigError):
        store.clear(name)
    assert not config_dir.exists()


def test_residency_skips_invalid_entries(tmp_path: Path) -> None:
    path = tmp_path / "residency.json"
    path.write_text(
        json.dumps(
            {
                "slots": {
                    "good": {"model_id": "m", "since": "2024-01-01T00:00:00.000Z"},
                    "../evil": {"model_id": "m"},
                    "no-model": {"since": "x"},
                    "not-a-dict": "m",
                }
            }
        )
    )
    got = ResidencyStore(tmp_path).read()
    assert list(got) == ["good"]
    assert got["good"].since == "2024-01-01T00:00:00.000Z"


@pytest.mark.parametrize(
    "content",
    [b"[]", b"null", b"{}", b'{"slots": null}', b'{"slots": []}', b'{"slots": "x"}'],
)
def test_residency_wrong_shape_reads_as_empty(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "residency.json").write_bytes(content)
    assert ResidencyStore(tmp_path).read() == {}


@pytest.mark.parametrize("content", [b"{", b"\xff\xfe", b"[" * 100_000])
def test_residency_corrupt_file_raises_typed_error(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "residency.json").write_bytes(content)
    store = ResidencyStore(tmp_path)
    with pytest.raises(SlotctlError) as info:
        store.read()
    assert type(info.value) is SlotctlError
    # A write must not silently replace a file it could not read.
    with pytest.raises(SlotctlError):
        store.set("a", "m")
    assert (tmp_path / "residency.json").read_bytes() == content


def test_state_dir_files_are_not_world_writable(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.write(_record("a"))
    assert _mode(store.path_for("a")) & 0o022 == 0
    assert os.access(store.path_for("a"), os.R_OK)


def test_a_refused_state_write_is_typed_and_keeps_the_old_file(tmp_path: Path) -> None:
    """Issue 13: the filesystem says no (here ENOTDIR: the slot dir is a file) -> a typed
    ``state.write_failed`` naming path and errno, never a bare OSError."""
    import errno

    from controller.model.errors import StateWriteFailed

    store = StateStore(tmp_path)
    store.write(SlotStateRecord(name="a", state=SlotState.READY))
    (tmp_path / "slots" / "b").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "slots" / "b").write_text("not a directory\n")
    with pytest.raises(StateWriteFailed) as refused:
        store.write(SlotStateRecord(name="b", state=SlotState.STARTING))
    assert refused.value.errno in (errno.ENOTDIR, errno.EEXIST)
    assert refused.value.details["path"] == str(tmp_path / "slots" / "b" / "state.json")
    with pytest.raises(StateWriteFailed):
        store.write_aux("b", "process.json", {"pid": 1})
    record = store.read("a")
    assert record is not None and record.state is SlotState.READY


def test_generated_token_never_reads_as_a_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one urlsafe token in 64 starts with "-": `slotctl --token -Xy…` then fails in argparse
    import secrets

    drawn = iter(["-starts-with-a-dash", "_fine-token"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(drawn))
    assert ensure_token(tmp_path) == "_fine-token"
    assert (tmp_path / "token").read_text() == "_fine-token\n"
    assert _mode(tmp_path / "token") == 0o600
    assert ensure_token(tmp_path) == "_fine-token"  # read back, not drawn again


def test_utcnow_says_what_datetime_says() -> None:
    """``utcnow`` (a slot's ``since``, two a routed request) formats its second once: the
    same text as ``datetime.now(UTC).isoformat(timespec="milliseconds")``, whose clock it
    floors the same way (nanoseconds to microseconds to milliseconds)."""
    import random
    from datetime import UTC, datetime, timedelta

    from controller.store.files import iso_of, utcnow

    rng = random.Random(41)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    edges = [0, 999_999_999, 1_000_000_000, 1_700_000_000_999_999_999, 1_700_000_000_000_999_999]
    for ns in [*edges, *(rng.randrange(0, 4_000_000_000 * 10**9) for _ in range(20_000))]:
        told = (epoch + timedelta(microseconds=ns // 1000)).isoformat(timespec="milliseconds")
        assert iso_of(ns) == told.replace("+00:00", "Z"), ns
    before = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    now = utcnow()
    after = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    assert before <= now <= after
