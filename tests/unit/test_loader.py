"""Stack files -> desired state: good stacks load, and every problem is located with file,
line, slot, key and code (SPEC §2: "a clear error naming file, slot and key (line number
when the parser gives one)").

Inline fixtures are small on purpose: the line numbers asserted are the lines in the text.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from controller.spec.loader import LoadReport, load_stacks
from controller.spec.problems import Problem
from controller.spec.schema import (
    SELF_MANAGED_PROVIDERS,
    ControllerSettings,
    provider_requires_model,
)

REPO = Path(__file__).resolve().parents[2]

HEAD = '[stack]\nname = "s"\n'  # lines 1-2 of most fixtures


def slot(name: str, port: int, *extra: str) -> str:
    """A ``[[slot]]`` table: header, name, provider, port, then ``extra`` lines."""
    lines = ["[[slot]]", f'name = "{name}"', 'provider = "demo"', f"port = {port}", *extra]
    return "\n".join(lines) + "\n"


def write(directory: Path, text: str, name: str = "stack.toml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def load(directory: Path, text: str, name: str = "stack.toml") -> tuple[LoadReport, str]:
    path = write(directory, text, name)
    return load_stacks([path]), str(path)


def only_error(report: LoadReport, code: str | None = None) -> Problem:
    assert not report.ok
    assert report.state is None
    assert len(report.errors) == 1, report.errors
    problem = report.errors[0]
    if code is not None:
        assert problem.code == code
    return problem


def located(problem: Problem) -> tuple[str | None, int | None, str | None, str | None, str]:
    return problem.file, problem.line, problem.slot, problem.key, problem.code


# ------------------------------------------------------------------- good stacks


def test_workstation_stack_loads() -> None:
    report = load_stacks([REPO / "stacks"])
    assert report.ok, report.errors
    assert report.errors == [] and report.warnings == []
    assert report.files == [str(REPO / "stacks" / "workstation.toml")]
    state = report.state
    assert state is not None
    assert state.stacks == ("workstation",)
    assert list(state.models) == [
        "qwen2.5-14b-instruct-q4",
        "qwq-32b-q4",
        "qwen2.5-coder-7b-q4",
        "nomic-embed-text-v1.5",
    ]
    assert list(state.slots) == ["chat", "reasoning", "code", "embed", "tts", "stt"]
    chat = state.slots["chat"]
    assert (chat.spec.model_id, chat.spec.port, chat.autoload, chat.pinned) == (
        "qwen2.5-14b-instruct-q4",
        8081,
        True,
        False,
    )
    assert chat.stack == "workstation"
    assert chat.file == str(REPO / "stacks" / "workstation.toml")
    assert state.slots["reasoning"].autoload is False
    assert state.slots["reasoning"].spec.ttl_s == 900
    assert state.slots["embed"].pinned is True
    assert state.slots["embed"].spec.type == "embedding"
    tts = state.slots["tts"]
    assert tts.spec.model_id == "" and tts.spec.activated and tts.spec.memory_gb == 1.2
    assert state.slots["stt"].spec.device == "cpu"
    assert state.models["qwq-32b-q4"].exclusive_group == "big"
    assert state.models["qwen2.5-14b-instruct-q4"].context_length == 16384
    # every slot's line is its [[slot]] header
    text = (REPO / "stacks" / "workstation.toml").read_text().splitlines()
    for slot in state.slots.values():
        assert slot.line is not None
        assert text[slot.line - 1].startswith("[[slot]]")
        assert f'name = "{slot.name}"' in text[slot.line]


def test_quickstart_loads() -> None:
    report = load_stacks([REPO / "examples" / "quickstart" / "quickstart.toml"])
    assert report.ok, report.errors
    state = report.state
    assert state is not None
    assert state.stacks == ("quickstart",)
    assert set(state.models) == {"demo-chat", "demo-coder", "demo-embed"}
    # ports left to the controller (None): a second demo on the same box never collides
    assert {n: (s.spec.port, s.autoload, s.pinned) for n, s in state.slots.items()} == {
        "chat": (None, True, False),
        "coder": (None, False, False),
        "embed": (None, True, True),
    }
    assert all(s.spec.provider == "demo" and s.spec.device == "cpu" for s in state.slots.values())
    assert state.slots["coder"].spec.ttl_s == 120


def test_the_two_example_stacks_conflict_when_loaded_together() -> None:
    # Both declare `chat` and `embed`: a directory of both would be refused, and says where.
    report = load_stacks([REPO / "stacks", REPO / "examples" / "quickstart"])
    assert {(p.code, p.slot) for p in report.errors} == {
        ("slot.duplicate_name", "chat"),
        ("slot.duplicate_name", "embed"),
    }
    assert all("workstation.toml:" in p.message for p in report.errors)


# ------------------------------------------------------------------ TOML syntax


def test_toml_syntax_error_line(tmp_path: Path) -> None:
    report, file = load(
        tmp_path,
        HEAD + '[[slot]]\nname = "a\nprovider = "demo"\n',  # unterminated string on line 4
    )
    problem = only_error(report, "stack.toml_syntax")
    assert (problem.file, problem.line) == (file, 4)
    assert problem.hint


@pytest.mark.parametrize(
    ("text", "line"),
    [
        pytest.param(HEAD + "port = 1\nport = 2\n", 4, id="duplicate-key"),
        pytest.param(HEAD + "[a]\nb = 1\n[a.b]\nc = 1\n", 5, id="key-then-table"),
        pytest.param(
            HEAD + '[[slot]]\nname = "a"\nserver.image = "x"\n[slot.server]\nextra_args = []\n',
            6,
            id="dotted-then-table",
        ),
        pytest.param(
            HEAD + '[[slot]]\nmodel.default = "m"\nmodel = { default = "n" }\n', 5, id="dotted"
        ),
        # tomllib refuses line 3 (a newline in an inline table), tomlkit accepts it and
        # refuses the key defined twice: the error told is tomlkit's, at its line.
        pytest.param(HEAD + "a = { b = 1,\n c = 2 }\nz = 1\nz = 2\n", 6, id="two-errors"),
    ],
)
def test_toml_redefinitions_are_syntax_errors_not_crashes(
    tmp_path: Path, text: str, line: int
) -> None:
    # tomlkit raises KeyAlreadyPresent / TOMLKitError (not ParseError) for these.
    report, file = load(tmp_path, text)
    problem = only_error(report, "stack.toml_syntax")
    assert (problem.file, problem.line) == (file, line)
    # tomlkit >= 0.15.3 appends where it noticed ("at line 6 col 0", past the table):
    # the message must not name a second, different line.
    named = re.findall(r" at line (\d+)", problem.message)
    assert named in ([], [str(line)]), problem.message


_EVERY_KIND = """\
# a comment
[stack]
name = "kinds"  # trailing comment
[[model]]
id = "m"
source = 'hf://org/repo/file.gguf'
memory_gb = 1.5e0
[[slot]]
name = "a"
port = 0x1F90
model = { default = "m", "alias" = "x" }
when = 1979-05-27T07:32:00-08:00
day = 1979-05-27
at = 07:32:00
local = 1979-05-27T07:32:00.999
big = 1_000_000
neg = -inf
flags = [true, false]
nested = [[1, 2], ["a"]]
text = \"\"\"
two \\
  lines\"\"\"
raw = \'\'\'C:\\no\\escape\'\'\'
esc = "tab\\tquote\\"\\u00e9"
[slot.server.env]
"KEY.WITH.DOTS" = "1"
"""


def test_toml_fast_path_reads_what_tomlkit_reads() -> None:
    # parse_toml_text parses with tomllib first (cheaper); the data must be what
    # tomlkit gave for every kind of TOML value and key.
    import tomlkit

    from controller.spec.loader import parse_toml_text

    data, index, problems = parse_toml_text(_EVERY_KIND, "kinds.toml")
    assert problems == [] and index is not None
    assert data == tomlkit.parse(_EVERY_KIND).unwrap()
    assert data["slot"][0]["text"] == "two lines"
    assert index.line_of(("slot", 0, "port")) == 10


def test_toml_syntax_error_reads_as_tomlkit_says_it() -> None:
    # What tomllib refuses goes through tomlkit: the message is tomlkit's, as before.
    import tomlkit

    from controller.spec.loader import parse_toml_text

    text = HEAD + "[[slot]]\nname = = 1\n"
    data, _, problems = parse_toml_text(text, "bad.toml")
    assert data is None and len(problems) == 1
    with pytest.raises(tomlkit.exceptions.TOMLKitError) as raised:
        tomlkit.parse(text)
    assert problems[0].message == f"TOML syntax error: {raised.value}"


def test_unreadable_and_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_bytes(b'[stack]\nname = "\xff"\n')
    (tmp_path / "empty").mkdir()
    report = load_stacks([tmp_path / "bad.toml", tmp_path / "nope.toml", tmp_path / "empty"])
    assert [(p.code, p.file) for p in report.errors] == [
        ("stack.unreadable", str(tmp_path / "nope.toml")),
        ("stack.empty_dir", str(tmp_path / "empty")),
        ("stack.unreadable", str(tmp_path / "bad.toml")),
    ]
    assert not report.ok


# --------------------------------------------------------------- slot problems

SLOT = HEAD + '\n[[slot]]\nname = "chat"\nprovider = "demo"\nport = 8081\n'  # slot on line 4


def test_unknown_slot_key_with_hint(tmp_path: Path) -> None:
    report, file = load(tmp_path, SLOT + "prority = 3\n")
    problem = only_error(report)
    assert located(problem) == (file, 8, "chat", "prority", "slot.unknown_key")
    assert problem.hint == "did you mean 'priority'?"


def test_unknown_key_without_a_close_match(tmp_path: Path) -> None:
    report, _ = load(tmp_path, SLOT + "zzz = 3\n")
    problem = only_error(report, "slot.unknown_key")
    assert problem.hint is not None and "remove the key" in problem.hint


def test_enabled_is_not_a_key(tmp_path: Path) -> None:
    report, file = load(tmp_path, SLOT + "enabled = true\n")
    assert located(only_error(report)) == (file, 8, "chat", "enabled", "slot.unknown_key")


def test_a_port_left_out_or_auto_is_chosen_by_the_controller(tmp_path: Path) -> None:
    """Issue 24: no ``port`` (or ``port = "auto"``) is no error, and two such slots do
    not clash; another string is still refused, located."""
    text = HEAD + '\n[[slot]]\nname = "a"\nprovider = "demo"\n'
    text += '\n[[slot]]\nname = "b"\nprovider = "demo"\nport = "auto"\n'
    report, _ = load(tmp_path, text)
    assert report.ok and report.state is not None, report.errors
    assert [s.spec.port for s in report.state.slots.values()] == [None, None]
    report, _ = load(tmp_path, HEAD + '\n[[slot]]\nname = "c"\nprovider = "demo"\nport = "any"\n')
    assert located(only_error(report))[1:] == (7, "c", "port", "slot.invalid_value")


@pytest.mark.parametrize(
    ("line_text", "key"),
    [
        pytest.param('port = "8081"', "port", id="port-string"),
        pytest.param("port = 8081.0", "port", id="port-float"),
        pytest.param("port = 0", "port", id="port-0"),
        pytest.param("priority = 1.5", "priority", id="priority-float"),
        pytest.param("priority = 101", "priority", id="priority-101"),
        pytest.param('autoload = "yes"', "autoload", id="autoload-string"),
        pytest.param("pinned = 1", "pinned", id="pinned-int"),
        pytest.param("ttl_s = -1", "ttl_s", id="ttl-negative"),
        pytest.param("ttl_s = inf", "ttl_s", id="ttl-inf"),
        pytest.param("idle_timeout_s = nan", "idle_timeout_s", id="idle-nan"),
        pytest.param('device = "tpu"', "device", id="device"),
        pytest.param('type = "chat"', "type", id="type"),
        pytest.param("model.default = 5", "model.default", id="model-default-int"),
        pytest.param('model = "m"', "model", id="model-string"),
    ],
)
def test_wrong_types_are_located(tmp_path: Path, line_text: str, key: str) -> None:
    text = HEAD + f'\n[[slot]]\nname = "chat"\nprovider = "demo"\n{line_text}\n'
    if not line_text.startswith("port"):
        text += "port = 8081\n"
    report, file = load(tmp_path, text)
    problem = only_error(report)
    assert located(problem) == (file, 7, "chat", key, "slot.invalid_value")


def test_unknown_provider_is_located(tmp_path: Path) -> None:
    report, file = load(tmp_path, HEAD + '[[slot]]\nname = "a"\nprovider = "ollama"\nport = 1\n')
    assert located(only_error(report)) == (file, 5, "a", "provider", "slot.invalid_value")


def test_bad_name_is_located(tmp_path: Path) -> None:
    report, file = load(tmp_path, HEAD + '[[slot]]\nname = "Chat_1"\nprovider = "demo"\nport = 1\n')
    problem = only_error(report)
    assert located(problem) == (file, 4, "Chat_1", "name", "slot.invalid_value")
    assert "Chat_1" in problem.message


def test_second_slot_server_table_is_attributed_to_the_second_slot(tmp_path: Path) -> None:
    text = (
        HEAD
        + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n'  # 3-6
        + '[slot.server]\nextra_args = ["--parallel", "2"]\n'  # 7-8
        + '[[slot]]\nname = "b"\nprovider = "demo"\nport = 2\n'  # 9-12
        + "[slot.server]\nextra_args = [\n"  # 13-14
        + '  "--parallel", "2",\n'  # 15
        + '  "-ngl", "99",\n'  # 16
        + "]\n"  # 17
        + "[slot.server.env]\n"  # 18
        + 'OMP_NUM_THREADS = "4"\n'  # 19
        + 'CUDA_VISIBLE_DEVICES = "1"\n'  # 20
    )
    report, file = load(tmp_path, text)
    assert [located(p) for p in report.errors] == [
        # elements of a multi-line array resolve to the line of the key
        (file, 14, "b", "server.extra_args[2]", "slot.hardware_flag"),
        (file, 20, "b", "server.env.CUDA_VISIBLE_DEVICES", "slot.hardware_flag"),
    ]
    assert report.errors[0].hint is not None and "-ngl" in report.errors[0].hint


def test_model_owned_keys_are_located_and_name_the_model(tmp_path: Path) -> None:
    text = (
        HEAD
        + '[[model]]\nid = "m1"\n'  # 3-4
        + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n'  # 5-8
        + 'model = { default = "m1", context_length = 4096 }\n'  # 9
        + "temperature = 0.1\n"  # 10
        + 'server.extra_args = ["--ctx-size", "4096"]\n'  # 11
    )
    report, file = load(tmp_path, text)
    assert sorted(located(p) for p in report.errors) == [
        (file, 9, "a", "model.context_length", "slot.model_owned_key"),
        (file, 10, "a", "temperature", "slot.model_owned_key"),
        (file, 11, "a", "server.extra_args[0]", "slot.model_owned_key"),
    ]
    assert all("'m1'" in p.message for p in report.errors)


# ------------------------------------------------------------- stack structure


def test_missing_stack_table(tmp_path: Path) -> None:
    report, file = load(tmp_path, '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n')
    problem = only_error(report)
    assert located(problem) == (file, 1, None, "stack.name", "stack.missing_key")
    assert problem.hint is not None and "[stack]" in problem.hint


def test_bad_stack_name(tmp_path: Path) -> None:
    report, file = load(tmp_path, '# my stack\n[stack]\nname = "My Stack"\n')
    assert located(only_error(report)) == (file, 3, None, "name", "stack.invalid_value")


def test_single_bracket_slot_table(tmp_path: Path) -> None:
    report, file = load(tmp_path, HEAD + '\n[slot]\nname = "a"\nprovider = "demo"\nport = 1\n')
    problem = only_error(report)
    assert located(problem) == (file, 4, None, "slot", "stack.invalid_value")
    assert problem.hint is not None and "[[slot]]" in problem.hint


def test_single_bracket_model_table(tmp_path: Path) -> None:
    report, file = load(tmp_path, HEAD + '[model]\nid = "m"\n')
    assert located(only_error(report)) == (file, 3, None, "model", "stack.invalid_value")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    report, file = load(tmp_path, HEAD + '[[slots]]\nname = "a"\n')
    problem = only_error(report)
    assert located(problem) == (file, 3, None, "slots", "stack.unknown_key")


def test_model_problems_are_located(tmp_path: Path) -> None:
    text = HEAD + '[[model]]\nid = "ok"\n[[model]]\nid = "bad"\nmemory_gb = -1\nsize = 3\n'
    report, file = load(tmp_path, text)
    assert [(p.line, p.key, p.code) for p in report.errors] == [
        (7, "memory_gb", "model.invalid_value"),
        (8, "size", "model.unknown_key"),
    ]
    assert all(p.file == file for p in report.errors)


@pytest.mark.parametrize(
    "source",
    ["ftp://host/m.gguf", "hf://org", "hf://org/", "", "  "],
)
def test_bad_model_sources(tmp_path: Path, source: str) -> None:
    report, _ = load(tmp_path, HEAD + f'[[model]]\nid = "m"\nsource = "{source}"\n')
    problem = only_error(report, "model.invalid_value")
    assert (problem.line, problem.key) == (5, "source")


# ------------------------------------------------------------ model references


def test_unknown_model_reference(tmp_path: Path) -> None:
    text = (
        HEAD
        + '[[model]]\nid = "qwen2.5-7b"\n'  # 3-4
        + '[[slot]]\nname = "chat"\nprovider = "llamacpp"\n'  # 5-7
        + 'model.default = "qwen2.5-7"\nport = 1\n'  # 8-9
    )
    report, file = load(tmp_path, text)
    problem = only_error(report)
    assert located(problem) == (file, 8, "chat", "model.default", "slot.unknown_model")
    assert problem.hint == "did you mean 'qwen2.5-7b'?"


def test_model_declared_in_a_later_file_resolves(tmp_path: Path) -> None:
    write(
        tmp_path,
        '[stack]\nname = "a"\n' + slot("c", 1, 'model.default = "m"'),
        "a.toml",
    )
    write(tmp_path, '[stack]\nname = "b"\n[[model]]\nid = "m"\n', "b.toml")
    report = load_stacks([tmp_path])
    assert report.ok, report.errors
    assert report.state is not None and report.state.slots["c"].stack == "a"


# --------------------------------------------------- directories and duplicates


def test_duplicate_slot_name_across_two_files(tmp_path: Path) -> None:
    first = write(
        tmp_path,
        '[stack]\nname = "a"\n\n[[slot]]\nname = "chat"\nprovider = "demo"\nport = 1\n',
        "10-a.toml",
    )
    second = write(
        tmp_path,
        '[stack]\nname = "b"\n' + slot("x", 2) + slot("chat", 3),  # chat: lines 7-10
        "20-b.toml",
    )
    report = load_stacks([tmp_path])
    problem = only_error(report)
    assert located(problem) == (str(second), 8, "chat", "name", "slot.duplicate_name")
    assert f"first at {first}:5" in problem.message


def test_duplicate_port_across_two_files(tmp_path: Path) -> None:
    first = write(
        tmp_path,
        '[stack]\nname = "a"\n[[slot]]\nname = "one"\nprovider = "demo"\nport = 8081\n',
        "a.toml",
    )
    second = write(
        tmp_path,
        '[stack]\nname = "b"\n[[slot]]\nname = "two"\nprovider = "demo"\n\nport = 8081\n',
        "b.toml",
    )
    report = load_stacks([tmp_path])
    problem = only_error(report)
    assert located(problem) == (str(second), 7, "two", "port", "slot.duplicate_port")
    assert "'one'" in problem.message and f"{first}:4" in problem.message


def test_duplicate_model_id_across_two_files(tmp_path: Path) -> None:
    first = write(tmp_path, '[stack]\nname = "a"\n[[model]]\nid = "m"\n', "a.toml")
    second = write(
        tmp_path, '[stack]\nname = "b"\n[[model]]\nsource = "demo://m"\nid = "m"\n', "b.toml"
    )
    report = load_stacks([tmp_path])
    problem = only_error(report)
    assert located(problem) == (str(second), 5, None, "id", "model.duplicate_id")
    assert f"first at {first}:4" in problem.message


def test_npu_exclusivity_across_files(tmp_path: Path) -> None:
    write(
        tmp_path,
        HEAD + '[[model]]\nid = "m"\n' + slot("n1", 1, 'device = "npu"', 'model.default = "m"'),
        "a.toml",
    )
    second = write(
        tmp_path,
        '[stack]\nname = "t"\n' + slot("n2", 2, 'device = "npu"', 'model.default = "m"'),
        "b.toml",
    )
    report = load_stacks([tmp_path])
    problem = only_error(report)
    assert located(problem) == (str(second), 7, "n2", "device", "slot.npu_exclusive")


def test_non_activated_npu_slot_is_fine(tmp_path: Path) -> None:
    text = HEAD + '[[model]]\nid = "m"\n'
    text += (
        '[[slot]]\nname = "n1"\nprovider = "demo"\nport = 1\ndevice = "npu"\nmodel.default = "m"\n'
    )
    text += '[[slot]]\nname = "n2"\nprovider = "demo"\nport = 2\ndevice = "npu"\n'
    report, _ = load(tmp_path, text)
    assert report.ok, report.errors


def test_directory_is_merged_in_name_order(tmp_path: Path) -> None:
    write(
        tmp_path,
        '[stack]\nname = "second"\n[[slot]]\nname = "b"\nprovider = "demo"\nport = 2\n',
        "b.toml",
    )
    write(
        tmp_path,
        '[stack]\nname = "first"\n[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n',
        "a.toml",
    )
    write(tmp_path, "not a stack", ".hidden.toml")
    write(tmp_path, "ignored", "notes.txt")
    report = load_stacks([tmp_path])
    assert report.ok, report.errors
    assert report.files == [str(tmp_path / "a.toml"), str(tmp_path / "b.toml")]
    assert report.state is not None
    assert report.state.stacks == ("first", "second")
    assert list(report.state.slots) == ["a", "b"]
    assert report.state.slots["b"].stack == "second"


def test_two_files_of_one_stack_merge(tmp_path: Path) -> None:
    write(tmp_path, HEAD + '[[model]]\nid = "m"\n', "models.toml")
    write(
        tmp_path,
        HEAD + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\nmodel.default = "m"\n',
        "slots.toml",
    )
    report = load_stacks([tmp_path])
    assert report.ok, report.errors
    assert report.state is not None and report.state.stacks == ("s",)


# ------------------------------------------------------------------ migrations


def test_autoload_migration(tmp_path: Path) -> None:
    text = HEAD + '[[model]]\nid = "m"\n'
    text += '[[slot]]\nname = "bound"\nprovider = "demo"\nport = 1\nmodel.default = "m"\n'
    text += '[[slot]]\nname = "unbound"\nprovider = "demo"\nport = 2\n'
    text += slot("explicit", 3, 'model.default = "m"', "autoload = false")
    text += '[[slot]]\nname = "voice"\nprovider = "kokoro"\nport = 4\n'
    report, _ = load(tmp_path, text)
    assert report.ok, report.errors
    assert report.state is not None
    assert {n: s.autoload for n, s in report.state.slots.items()} == {
        "bound": True,
        "unbound": False,
        "explicit": False,
        "voice": False,  # no bound model: the migration looks at model.default only
    }
    assert all(s.spec.autoload is not None for s in report.state.slots.values())


def test_default_pinned_anchor(tmp_path: Path) -> None:
    text = HEAD + '[[slot]]\nname = "agent"\nprovider = "demo"\nport = 1\n'
    text += '[[slot]]\nname = "chat"\nprovider = "demo"\nport = 2\n'
    text += '[[slot]]\nname = "pinned"\nprovider = "demo"\nport = 3\npinned = true\n'
    path = write(tmp_path, text)
    state = load_stacks([path]).state
    assert state is not None
    assert {n: s.pinned for n, s in state.slots.items()} == {
        "agent": True,
        "chat": False,
        "pinned": True,
    }
    custom = load_stacks([path], ControllerSettings(default_pinned=["chat"])).state
    assert custom is not None
    assert {n: s.pinned for n, s in custom.slots.items()} == {
        "agent": False,
        "chat": True,
        "pinned": True,
    }


def test_agent_can_opt_out_of_pinning(tmp_path: Path) -> None:
    text = HEAD + '[[slot]]\nname = "agent"\nprovider = "demo"\nport = 1\npinned = false\n'
    report, _ = load(tmp_path, text)
    assert report.state is not None
    assert report.state.slots["agent"].pinned is False


def test_self_managed_providers(tmp_path: Path) -> None:
    assert {"kokoro", "qwen3tts", "moonshine", "vibevoice"} == SELF_MANAGED_PROVIDERS
    for provider in SELF_MANAGED_PROVIDERS:
        assert provider_requires_model(provider) is False
    for provider in ("llamacpp", "vllm", "openai-compatible", "demo", "llama-cpp-python"):
        assert provider_requires_model(provider) is True
    text = HEAD + '[[slot]]\nname = "tts"\nprovider = "kokoro"\ntype = "tts"\nport = 1\n'
    text += '[[slot]]\nname = "chat"\nprovider = "llamacpp"\nport = 2\n'
    report, _ = load(tmp_path, text)
    assert report.ok, report.errors
    assert report.state is not None
    assert report.state.slots["tts"].spec.activated is True
    assert report.state.slots["chat"].spec.activated is False


def test_retired_lru_is_a_located_warning(tmp_path: Path) -> None:
    report, file = load(tmp_path, SLOT + "lru = true\n")
    assert report.ok
    assert [located(w) for w in report.warnings] == [
        (file, 8, "chat", "lru", "slot.lru_flag_retired")
    ]
    assert report.warnings[0].severity == "warning"


def test_every_error_is_fully_located(tmp_path: Path) -> None:
    # One file with one problem of each slot kind: every error has file, line, slot, key.
    text = (
        HEAD
        + '[[model]]\nid = "m"\n'
        + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\nbogus = 1\n'
        + '[[slot]]\nname = "b"\nprovider = "demo"\n'  # no port: fine (auto)
        + '[[slot]]\nname = "c"\nprovider = "demo"\nport = 3\nmodel.default = "nope"\n'
        + '[[slot]]\nname = "d"\nprovider = "demo"\nport = 3\n'
        + slot("e", 5, 'server.env = { HIP_VISIBLE_DEVICES = "0" }')
    )
    report, file = load(tmp_path, text)
    assert len(report.errors) == 4
    for problem in report.errors:
        assert problem.file == file
        assert problem.line is not None and problem.line > 2
        assert problem.slot is not None and problem.key is not None
        assert problem.code.startswith("slot.")
        assert problem.hint


# A deeply nested file (issue 40, item 5): 400 KB of nested arrays, under the size limit,
# made tomllib raise RecursionError; the watcher crash-looped on it and `stack validate`
# said "internal error" (exit 2). Now it is a located problem naming the file.
DEEP = 200_000


def test_a_deeply_nested_stack_file_is_a_problem_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text('[stack]\nname = "deep"\n[[slot]]\nname = "a"\nx = ' + "[" * DEEP + "]" * DEEP)
    report = load_stacks([path])
    assert not report.ok and report.state is None
    [problem] = report.errors
    assert problem.code == "stack.too_deep" and problem.file == str(path)
    assert "nested" in problem.message and problem.hint


def test_a_deeply_nested_stack_text_is_a_problem_too() -> None:
    from controller.spec.loader import load_stack_texts

    deep = DEEP // 4  # 5 bytes a level: under the size limit
    report = load_stack_texts([("api.toml", "x = " + "{a = " * deep + "1" + "}" * deep)])
    assert [(p.code, p.file) for p in report.errors] == [("stack.too_deep", "api.toml")]
