"""The guard writes slot config through tomlkit: a hand-written, commented slot file keeps
every byte outside the edited value, refused writes touch nothing, and the ``autoload``
migration / explicit default behave as SPEC §2 says.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.model.errors import NpuExclusivityViolation, SlotConfigError, SlotctlError
from controller.spec.configdir import read_config_dir
from controller.spec.guard import delete_slot_config, write_catalogue, write_slot_config
from controller.spec.loader import normalise
from controller.spec.schema import ModelSpec

CATALOGUE_TEXT = """\
# The model catalogue for this host.
# Edited by hand and by `slotctl model ...`.

[[model]]
id = "m1"                     # the everyday chat model
source = "/models/m1.gguf"
memory_gb = 5.2               # weights + 8k KV cache
context_length = 8192

[[model]]
# a second model for swaps
id = "m2"
source = "demo://m2"
memory_gb = 1.5
"""

CHAT_TEXT = """\
# chat: the everyday assistant (hand edited, keep the comments!)

[origin]
stack = "workstation"   # the stack that owns this slot

[slot]
name = "chat"           # DNS label
provider = "llamacpp"
model.default = "m1"    # dotted key style, not an inline table
port = 8081
autoload = true

# eviction: chat goes last
priority = 70           # 0..100
idle_timeout_s = 600
[slot.server]
image = "ghcr.io/ggml-org/llama.cpp:server"
extra_args = [
    "--parallel", "2",  # two requests at once
    "--flash-attn",
]
env = { OMP_NUM_THREADS = "8" }   # inline table style
"""

# CHAT_TEXT as a full PUT payload (what `slotctl stack apply` or the API would send).
CHAT_PAYLOAD: dict[str, Any] = {
    "name": "chat",
    "provider": "llamacpp",
    "model": {"default": "m1"},
    "port": 8081,
    "autoload": True,
    "priority": 70,
    "idle_timeout_s": 600,
    "server": {
        "image": "ghcr.io/ggml-org/llama.cpp:server",
        "extra_args": ["--parallel", "2", "--flash-attn"],
        "env": {"OMP_NUM_THREADS": "8"},
    },
}


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    root = tmp_path / "config"
    (root / "slots").mkdir(parents=True)
    (root / "models.toml").write_text(CATALOGUE_TEXT)
    (root / "slots" / "chat.toml").write_text(CHAT_TEXT)
    return root


def chat_file(config_dir: Path) -> Path:
    return config_dir / "slots" / "chat.toml"


def listing(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (the lock file is not config)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".slotctl.lock"
    }


def substituted(old: str, new: str) -> str:
    assert CHAT_TEXT.count(old) == 1, f"{old!r} must be unique in the fixture"
    return CHAT_TEXT.replace(old, new)


def test_fixture_loads_as_written(config_dir: Path) -> None:
    snap = read_config_dir(config_dir)
    assert snap.errors == [] and snap.warnings == []
    assert set(snap.models) == {"m1", "m2"}
    chat = snap.slots["chat"]
    assert chat.stack == "workstation"
    assert chat.spec.model_id == "m1"
    assert chat.autoload is True
    assert chat.spec.server.extra_args == ["--parallel", "2", "--flash-attn"]
    assert chat.file == str(chat_file(config_dir))
    assert chat.line == 6  # the [slot] header


def test_put_of_unchanged_payload_is_byte_identical(config_dir: Path) -> None:
    write_slot_config(config_dir, CHAT_PAYLOAD)
    assert chat_file(config_dir).read_text() == CHAT_TEXT


@pytest.mark.parametrize(
    ("change", "old", "new"),
    [
        pytest.param({"priority": 80}, "priority = 70 ", "priority = 80 ", id="priority"),
        pytest.param({"port": 8090}, "port = 8081", "port = 8090", id="port"),
        pytest.param(
            {"model": {"default": "m2"}},
            'model.default = "m1"',
            'model.default = "m2"',
            id="dotted-model-default",
        ),
        pytest.param(
            {"idle_timeout_s": 900}, "idle_timeout_s = 600", "idle_timeout_s = 900", id="timeout"
        ),
        pytest.param({"autoload": False}, "autoload = true", "autoload = false", id="autoload"),
        pytest.param(
            {"server": {"image": "ghcr.io/ggml-org/llama.cpp:server-cuda"}},
            'image = "ghcr.io/ggml-org/llama.cpp:server"',
            'image = "ghcr.io/ggml-org/llama.cpp:server-cuda"',
            id="server-image",
        ),
        pytest.param(
            {"server": {"env": {"OMP_NUM_THREADS": "4"}}},
            'OMP_NUM_THREADS = "8"',
            'OMP_NUM_THREADS = "4"',
            id="inline-env",
        ),
    ],
)
@pytest.mark.parametrize("merge", [False, True], ids=["put", "patch"])
def test_one_edit_changes_only_that_value(
    config_dir: Path, change: dict[str, Any], old: str, new: str, merge: bool
) -> None:
    if merge:
        payload: dict[str, Any] = {"name": "chat", **change}
    else:
        payload = copy.deepcopy(CHAT_PAYLOAD)
        for key, value in change.items():
            if isinstance(value, dict):
                payload[key] = {**payload.get(key, {}), **value}
            else:
                payload[key] = value
    spec = write_slot_config(config_dir, payload, merge=merge)
    assert chat_file(config_dir).read_text() == substituted(old, new)
    # and the written file reads back to what the guard returned
    snap = read_config_dir(config_dir)
    assert snap.errors == []
    assert snap.slots["chat"].spec == normalise(spec, snap.settings)
    assert snap.slots["chat"].stack == "workstation"


def test_removing_a_key_with_put_deletes_only_its_line(config_dir: Path) -> None:
    payload = {k: v for k, v in CHAT_PAYLOAD.items() if k != "idle_timeout_s"}
    write_slot_config(config_dir, payload)
    assert chat_file(config_dir).read_text() == substituted("idle_timeout_s = 600\n", "")
    assert read_config_dir(config_dir).slots["chat"].spec.idle_timeout_s == 300.0


def test_patch_of_a_list_keeps_the_rest(config_dir: Path) -> None:
    write_slot_config(
        config_dir, {"name": "chat", "server": {"extra_args": ["--parallel", "4"]}}, merge=True
    )
    text = chat_file(config_dir).read_text()
    start = CHAT_TEXT.index("extra_args = [")
    end = CHAT_TEXT.index("env = {")
    # Outside the edited array every byte is the same.
    assert text.startswith(CHAT_TEXT[:start])
    assert text.endswith(CHAT_TEXT[end:])
    assert read_config_dir(config_dir).slots["chat"].spec.server.extra_args == ["--parallel", "4"]


def test_two_patches_in_a_row(config_dir: Path) -> None:
    write_slot_config(config_dir, {"name": "chat", "priority": 10}, merge=True)
    write_slot_config(config_dir, {"name": "chat", "port": 9999}, merge=True)
    expected = substituted("priority = 70 ", "priority = 10 ").replace("port = 8081", "port = 9999")
    assert chat_file(config_dir).read_text() == expected


def test_stack_argument_changes_only_the_origin(config_dir: Path) -> None:
    write_slot_config(config_dir, CHAT_PAYLOAD, stack="other")
    assert chat_file(config_dir).read_text() == substituted(
        'stack = "workstation"', 'stack = "other"'
    )
    assert read_config_dir(config_dir).slots["chat"].stack == "other"


# ---------------------------------------------------------------------- autoload


def test_new_slot_without_autoload_persists_explicit_false(config_dir: Path) -> None:
    spec = write_slot_config(
        config_dir,
        {"name": "code", "provider": "llamacpp", "port": 8082, "model": {"default": "m2"}},
    )
    assert spec.autoload is False
    text = (config_dir / "slots" / "code.toml").read_text()
    assert "autoload = false" in text.splitlines()
    snap = read_config_dir(config_dir)
    assert snap.errors == []
    assert snap.slots["code"].autoload is False  # not migrated to true: it is explicit
    assert snap.slots["code"].stack == ""


def test_new_slot_records_its_stack(config_dir: Path) -> None:
    write_slot_config(config_dir, {"name": "tts", "provider": "kokoro", "port": 8085}, stack="ws")
    snap = read_config_dir(config_dir)
    assert snap.slots["tts"].stack == "ws"
    assert snap.slots["tts"].autoload is False


def test_new_slot_keeps_an_explicit_autoload(config_dir: Path) -> None:
    write_slot_config(
        config_dir, {"name": "emb", "provider": "demo", "port": 8084, "autoload": True}
    )
    assert read_config_dir(config_dir).slots["emb"].autoload is True


@pytest.mark.parametrize(
    ("slot_table", "expected"),
    [
        pytest.param('provider = "llamacpp"\nmodel.default = "m1"\n', True, id="bound-model"),
        pytest.param('provider = "llamacpp"\n', False, id="no-model"),
        pytest.param('provider = "llamacpp"\nmodel.default = ""\n', False, id="empty-default"),
        pytest.param('provider = "kokoro"\n', False, id="self-managed-without-model"),
        pytest.param(
            'provider = "llamacpp"\nmodel.default = "m1"\nautoload = false\n', False, id="explicit"
        ),
    ],
)
def test_autoload_migration_on_read(config_dir: Path, slot_table: str, expected: bool) -> None:
    (config_dir / "slots" / "old.toml").write_text(
        f'[slot]\nname = "old"\nport = 9100\n{slot_table}'
    )
    snap = read_config_dir(config_dir)
    assert snap.errors == []
    assert snap.slots["old"].autoload is expected


def test_patch_of_a_slot_without_autoload_keeps_the_migrated_value(config_dir: Path) -> None:
    # A hand-written file from before `autoload` existed: migrated to true (model bound).
    old = (
        '# legacy\n[slot]\nname = "old"\nprovider = "llamacpp"\nmodel.default = "m1"\nport = 9100\n'
    )
    path = config_dir / "slots" / "old.toml"
    path.write_text(old)
    assert read_config_dir(config_dir).slots["old"].autoload is True
    write_slot_config(config_dir, {"name": "old", "priority": 10}, merge=True)
    slot = read_config_dir(config_dir).slots["old"]
    assert slot.spec.priority == 10
    assert slot.autoload is True  # a PATCH of priority must not switch autoload off
    assert path.read_text().startswith("# legacy\n[slot]\n")


# --------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("payload", "merge", "exc"),
    [
        pytest.param(
            {"name": "chat", "server": {"extra_args": ["-ngl", "99"]}},
            True,
            SlotConfigError,
            id="patch-hardware-flag",
        ),
        pytest.param(
            {**CHAT_PAYLOAD, "context_length": 4096}, False, SlotConfigError, id="put-model-owned"
        ),
        pytest.param({**CHAT_PAYLOAD, "port": "8081"}, False, SlotConfigError, id="put-bad-type"),
        pytest.param(
            {"name": "chat", "model": {"default": "nope"}},
            True,
            SlotConfigError,
            id="patch-unknown-model",
        ),
        pytest.param({"name": "chat", "bogus": 1}, True, SlotConfigError, id="patch-unknown-key"),
        pytest.param({"name": "chat"}, False, SlotConfigError, id="put-partial"),
    ],
)
def test_refused_write_leaves_the_file_untouched(
    config_dir: Path, payload: dict[str, Any], merge: bool, exc: type[SlotctlError]
) -> None:
    before = listing(config_dir)
    with pytest.raises(exc):
        write_slot_config(config_dir, payload, merge=merge)
    assert listing(config_dir) == before
    assert chat_file(config_dir).read_text() == CHAT_TEXT


@pytest.mark.parametrize(
    ("payload", "exc"),
    [
        pytest.param(
            {"name": "code", "provider": "demo", "port": 8081}, SlotConfigError, id="duplicate-port"
        ),
        pytest.param(
            {
                "name": "npu2",
                "provider": "demo",
                "port": 9002,
                "device": "npu",
                "model": {"default": "m2"},
            },
            NpuExclusivityViolation,
            id="second-npu-llm",
        ),
        pytest.param(
            {"name": "../evil", "provider": "demo", "port": 9003}, SlotConfigError, id="path-name"
        ),
        pytest.param(
            {"name": "Bad", "provider": "demo", "port": 9003}, SlotConfigError, id="upper"
        ),
        pytest.param({"provider": "demo", "port": 9003}, SlotConfigError, id="no-name"),
        pytest.param(["not", "a", "table"], SlotConfigError, id="not-a-mapping"),
        pytest.param(
            {"name": "code", "provider": "demo", "port": 9003, "model": {"default": "m9"}},
            SlotConfigError,
            id="unknown-model",
        ),
    ],
)
def test_refused_new_slot_creates_nothing(
    config_dir: Path, payload: Any, exc: type[SlotctlError]
) -> None:
    (config_dir / "slots" / "npu1.toml").write_text(
        '[slot]\nname = "npu1"\nprovider = "demo"\nport = 9001\ndevice = "npu"\n'
        'model.default = "m1"\nautoload = false\n'
    )
    before = listing(config_dir)
    siblings = set(config_dir.parent.iterdir())
    with pytest.raises(exc) as info:
        write_slot_config(config_dir, payload)
    assert type(info.value) is exc
    assert listing(config_dir) == before
    assert set(config_dir.parent.iterdir()) == siblings


def test_hand_broken_origin_is_repaired_not_a_crash(config_dir: Path) -> None:
    path = chat_file(config_dir)
    path.write_text(CHAT_TEXT.replace('[origin]\nstack = "workstation"', 'origin = "x"\n[origin2]'))
    path.write_text(path.read_text().replace("[origin2]\n", ""))
    write_slot_config(config_dir, CHAT_PAYLOAD, stack="ws")
    snap = read_config_dir(config_dir)
    assert snap.errors == []
    assert snap.slots["chat"].stack == "ws"


def test_unparseable_file_is_replaced_by_a_valid_one(config_dir: Path) -> None:
    # A duplicated key (tomlkit raises KeyAlreadyPresent, not ParseError).
    chat_file(config_dir).write_text('[slot]\nname = "chat"\nname = "chat"\n')
    assert read_config_dir(config_dir).errors[0].code == "stack.toml_syntax"
    write_slot_config(config_dir, CHAT_PAYLOAD)
    snap = read_config_dir(config_dir)
    assert snap.errors == []
    assert snap.slots["chat"].spec.priority == 70


# ------------------------------------------------------------------------ delete


def test_delete_slot_config(config_dir: Path) -> None:
    assert delete_slot_config(config_dir, "chat") is True
    assert not chat_file(config_dir).exists()
    assert "chat" not in read_config_dir(config_dir).slots
    assert delete_slot_config(config_dir, "chat") is False
    assert (config_dir / "models.toml").read_text() == CATALOGUE_TEXT


@pytest.mark.parametrize("name", ["../models", "", "A", "slots/../../x"])
def test_delete_refuses_names_that_are_not_labels(config_dir: Path, name: str) -> None:
    before = listing(config_dir)
    with pytest.raises(SlotConfigError):
        delete_slot_config(config_dir, name)
    assert listing(config_dir) == before


# --------------------------------------------------------------------- catalogue


def _catalogue(config_dir: Path) -> list[ModelSpec]:
    return list(read_config_dir(config_dir).models.values())


def test_catalogue_rewrite_is_byte_identical_and_idempotent(config_dir: Path) -> None:
    models = _catalogue(config_dir)
    for _ in range(3):  # repeated writes must not accumulate blank lines
        write_catalogue(config_dir, models)
        assert (config_dir / "models.toml").read_text() == CATALOGUE_TEXT


def test_catalogue_edit_keeps_comments_of_unchanged_entries(config_dir: Path) -> None:
    m1, m2 = _catalogue(config_dir)
    write_catalogue(config_dir, [m1, m2.model_copy(update={"memory_gb": 2.0})])
    expected = CATALOGUE_TEXT.replace("memory_gb = 1.5", "memory_gb = 2.0")
    assert (config_dir / "models.toml").read_text() == expected


def test_catalogue_add_and_remove(config_dir: Path) -> None:
    m1, _m2 = _catalogue(config_dir)
    write_catalogue(config_dir, [m1, ModelSpec(id="m3", source="demo://m3", memory_gb=0.5)])
    text = (config_dir / "models.toml").read_text()
    head = CATALOGUE_TEXT[: CATALOGUE_TEXT.index("[[model]]\n# a second")]
    assert text.startswith(head)  # header comments and m1 with its comments, verbatim
    assert "m2" not in text and "# a second model" not in text
    assert set(read_config_dir(config_dir).models) == {"m1", "m3"}
    write_catalogue(config_dir, [])
    assert read_config_dir(config_dir).models == {}
    assert (config_dir / "models.toml").read_text().startswith("# The model catalogue")


def test_catalogue_in_a_new_config_dir(tmp_path: Path) -> None:
    write_catalogue(tmp_path, [ModelSpec(id="a"), ModelSpec(id="b", kind="embedding")])
    snap = read_config_dir(tmp_path)
    assert list(snap.models) == ["a", "b"]
    assert snap.models["b"].kind == "embedding"


def test_catalogue_refuses_duplicate_ids(config_dir: Path) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        write_catalogue(config_dir, [ModelSpec(id="x"), ModelSpec(id="x")])
    assert (config_dir / "models.toml").read_text() == CATALOGUE_TEXT


# -------------------------------------------------------------------- hypothesis

_edits = st.fixed_dictionaries(
    {},
    optional={
        "priority": st.integers(min_value=-5, max_value=105),
        "port": st.integers(min_value=-1, max_value=70000) | st.text(max_size=5),
        "autoload": st.booleans() | st.none() | st.integers(),
        "idle_timeout_s": st.floats(allow_nan=True) | st.integers(-10, 10_000),
        "model": st.fixed_dictionaries(
            {"default": st.sampled_from(["m1", "m2", "", "nope"]) | st.integers()}
        ),
        "server": st.fixed_dictionaries(
            {},
            optional={
                "extra_args": st.lists(
                    st.sampled_from(["--parallel", "2", "-ngl", "99", "--ctx-size=1", "-t"])
                ),
                "env": st.dictionaries(
                    st.sampled_from(["OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "1BAD"]),
                    st.text(max_size=3) | st.integers(),
                ),
            },
        ),
        "lru": st.booleans(),
        "bogus": st.integers(),
        "temperature": st.floats(0, 2),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edit=_edits)
def test_any_patch_is_written_whole_or_not_at_all(edit: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "slots").mkdir()
        (root / "models.toml").write_text(CATALOGUE_TEXT)
        chat_file(root).write_text(CHAT_TEXT)
        before = listing(root)
        try:
            spec = write_slot_config(root, {"name": "chat", **edit}, merge=True)
        except SlotctlError:
            assert listing(root) == before
            return
        snap = read_config_dir(root)
        assert snap.errors == []
        assert snap.slots["chat"].spec == normalise(spec, snap.settings)
        text = chat_file(root).read_text()
        # the header comment and the owner survive every accepted write
        assert text.startswith(CHAT_TEXT.split("\n\n", 1)[0])
        assert snap.slots["chat"].stack == "workstation"


@pytest.mark.parametrize("filename", ["my_slot.toml", "Chat.toml", "-x.toml"])
def test_slot_file_with_an_invalid_name_is_ignored_with_a_warning(
    config_dir: Path, filename: str
) -> None:
    path = config_dir / "slots" / filename
    path.write_text('[slot]\nname = "x"\nprovider = "demo"\nport = 9\n')
    (config_dir / "slots" / ".chat.toml.swp.toml").write_text("editor junk")
    snap = read_config_dir(config_dir)
    assert set(snap.slots) == {"chat"}
    assert snap.errors == []
    assert [(w.code, w.file) for w in snap.warnings] == [("slot.ignored_file", str(path))]


def test_slot_file_must_be_named_after_its_slot(config_dir: Path) -> None:
    path = config_dir / "slots" / "code.toml"
    path.write_text('[slot]\nname = "coder"\nprovider = "demo"\nport = 9\n')
    snap = read_config_dir(config_dir)
    assert "coder" not in snap.slots and "code" not in snap.slots
    [problem] = snap.errors
    assert (problem.file, problem.line, problem.key, problem.slot) == (
        str(path),
        2,
        "name",
        "coder",
    )
    assert problem.hint == "rename the file to coder.toml"
