"""The config dir reader parses a slot file again only when the file changed (issue 28: an
operator with 1,000 Slots re-read every file on every CR change, half its CPU). What it
parsed is kept by the caller's :class:`ParseCache` (the desired-state cache's files source
owns one: issue 41), not by a process-wide store."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from controller.spec import configdir
from controller.spec.configdir import ParseCache, read_config_dir


def slot_file(name: str, priority: int) -> str:
    return (
        '[origin]\nstack = "s"\n[slot]\n'
        f'name = "{name}"\nprovider = "demo"\nmodel.default = "m"\ndevice = "cpu"\n'
        f"autoload = false\npriority = {priority}\n"
    )


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The slot files the reader parsed (the real parser runs)."""
    seen: list[Path] = []
    real = configdir._read_slot_file

    def counted(path: Path) -> configdir.SlotFileRead:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(configdir, "_read_slot_file", counted)
    monkeypatch.setattr(configdir, "RACY_S", 0.3)
    return seen


def make_dir(root: Path, count: int) -> Path:
    slots = root / "slots"
    slots.mkdir(parents=True)
    (root / "models.toml").write_text('[[model]]\nid = "m"\nsource = "demo://m"\n')
    for i in range(count):
        (slots / f"s{i}.toml").write_text(slot_file(f"s{i}", 10 + i))
    return root


def test_unchanged_files_are_not_parsed_again(tmp_path: Path, parses: list[Path]) -> None:
    root = make_dir(tmp_path, 5)
    cache = ParseCache()
    first = read_config_dir(root, cache)
    assert len(parses) == 5 and not first.errors, first.errors
    # Just written: inside the racy window, read again (a same-size edit could hide).
    read_config_dir(root, cache)
    assert len(parses) == 10
    time.sleep(0.4)
    read_config_dir(root, cache)
    parses.clear()
    again = read_config_dir(root, cache)
    assert parses == []
    read_config_dir(root)  # no cache of its own: the caller parses every file
    assert len(parses) == 5
    parses.clear()
    assert read_config_dir(root, ParseCache()) is not None and len(parses) == 5  # another
    assert again.slots == first.slots
    assert {n: s.spec.priority for n, s in again.slots.items()} == {
        f"s{i}": 10 + i for i in range(5)
    }


def test_every_kind_of_change_is_seen(tmp_path: Path, parses: list[Path]) -> None:
    root = make_dir(tmp_path, 3)
    slots = root / "slots"
    cache = ParseCache()
    read_config_dir(root, cache)
    time.sleep(0.4)
    read_config_dir(root, cache)
    parses.clear()
    # In place, the same size (priority 10 -> 99): the inode and size stay.
    path = slots / "s0.toml"
    with path.open("r+") as f:
        f.write(slot_file("s0", 99))
    # Replaced by a rename (the guard's way), and one deleted, one added.
    tmp = slots / ".s1.tmp"
    tmp.write_text(slot_file("s1", 42))
    tmp.replace(slots / "s1.toml")
    (slots / "s2.toml").unlink()
    (slots / "s3.toml").write_text(slot_file("s3", 7))
    snap = read_config_dir(root, cache)
    assert {n: s.spec.priority for n, s in snap.slots.items()} == {"s0": 99, "s1": 42, "s3": 7}
    assert sorted(p.name for p in parses) == ["s0.toml", "s1.toml", "s3.toml"]
    assert slots / "s2.toml" not in cache
    # A file that became invalid is reported again each read, and valid again when fixed.
    path.write_text(slot_file("s0", 500))
    assert any(p.file == str(path) for p in read_config_dir(root, cache).errors)
    path.write_text(slot_file("s0", 1))
    assert read_config_dir(root, cache).slots["s0"].spec.priority == 1
