"""``[[alias]]`` (issue 25, item 3): the schema and its problems, the router's pure choice,
the body rewrite, and the guard's write of aliases into ``models.toml`` (apply replaces a
stack's own aliases, keeps the others', and refuses an invalid set changing nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.model.errors import SlotConfigError
from controller.reconcile.apply import alias_changes, apply_to_config
from controller.router.aliases import Seat, choose
from controller.router.body import model_of, with_model
from controller.spec.configdir import read_config_dir
from controller.spec.loader import DesiredState, LoadReport, load_stack_texts

MODELS = '[[model]]\nid = "big"\nsource = "demo://big"\n\n[[model]]\nid = "small"\nsource = "demo://small"\n'


def stack(body: str, name: str = "s", models: str = MODELS) -> str:
    return f'[stack]\nname = "{name}"\n\n{models}\n{body}'


def load(*texts: str) -> LoadReport:
    return load_stack_texts([(f"f{i}.toml", t) for i, t in enumerate(texts)])


def state(*texts: str) -> DesiredState:
    report = load(*texts)
    assert report.ok and report.state is not None, report.errors
    return report.state


ALIAS = '[[alias]]\nid = "chat"\nmodels = ["big", "small"]\n'

# ------------------------------------------------------------------ schema and problems


def test_an_alias_loads_with_warm_by_default() -> None:
    loaded = state(stack(ALIAS))
    entry = loaded.aliases["chat"]
    assert entry.spec.models == ["big", "small"]
    assert entry.spec.prefer == "warm"
    assert entry.stack == "s"


@pytest.mark.parametrize(
    ("body", "code", "key", "line"),
    [
        # [[alias]] is line 12 of stack(): [stack] 3 lines, MODELS 7, a blank, a blank
        (
            '[[alias]]\nid = "chat"\nmodels = ["big", "nope"]\n',
            "alias.unknown_member",
            "models.1",
            14,
        ),
        ('[[alias]]\nid = "big"\nmodels = ["small"]\n', "alias.id_taken", "id", 13),
        (
            '[[alias]]\nid = "chat"\nmodels = ["big"]\nprefer = "fast"\n',
            "alias.invalid_value",
            "prefer",
            15,
        ),
        ('[[alias]]\nid = "chat"\nmodels = []\n', "alias.invalid_value", "models", 14),
        ('[[alias]]\nid = "chat"\nmodels = ["big", "big"]\n', "alias.invalid_value", "models", 14),
        ('[[alias]]\nid = "chat"\nmodels = "big"\n', "alias.invalid_value", "models", 14),
        (
            '[[alias]]\nid = "chat"\nmodels = ["big"]\nmodel = "x"\n',
            "alias.unknown_key",
            "model",
            15,
        ),
        ('[[alias]]\nmodels = ["big"]\n', "alias.missing_key", "id", 12),
        (
            '[[alias]]\nid = "chat"\nmodels = ["big"]\nstack = "x"\n',
            "alias.unknown_key",
            "stack",
            15,
        ),
    ],
)
def test_alias_problems_are_typed_and_located(body: str, code: str, key: str, line: int) -> None:
    report = load(stack(body))
    assert not report.ok and report.state is None
    assert [(p.code, p.key, p.file, p.line) for p in report.errors] == [
        (code, key, "f0.toml", line)
    ], report.errors


def test_an_alias_id_that_is_a_slot_name_is_taken() -> None:
    slot = '[[slot]]\nname = "chat"\nprovider = "demo"\nport = 18001\nmodel.default = "big"\n'
    report = load(stack(ALIAS + "\n" + slot))
    assert [p.code for p in report.errors] == ["alias.id_taken"]


def test_an_alias_declared_in_two_files_is_a_duplicate() -> None:
    other = stack(ALIAS, name="t", models="")
    report = load(stack(ALIAS), other)
    assert [(p.code, p.file) for p in report.errors] == [("alias.duplicate_id", "f1.toml")]


def test_alias_must_be_an_array_of_tables() -> None:
    report = load(stack('[alias]\nid = "chat"\nmodels = ["big"]\n'))
    assert [p.code for p in report.errors] == ["alias.invalid_value"]


# ------------------------------------------------------------------ choose()


def seats(*spec: tuple[str, str, bool, int]) -> list[Seat]:
    return [Seat(slot, model, warm, busy) for slot, model, warm, busy in spec]


NONE_FIT = lambda slot: False  # noqa: E731
ALL_FIT = lambda slot: True  # noqa: E731


def test_warm_takes_the_first_resident_member() -> None:
    got = choose("warm", seats(("a", "big", False, 0), ("b", "small", True, 3)), ALL_FIT)
    assert got is not None and (got.model, got.candidates) == ("small", ["b"])


def test_warm_cold_loads_the_first_member_that_fits() -> None:
    fits = {"b": True}.get
    got = choose(
        "warm", seats(("a", "big", False, 0), ("b", "small", False, 0)), lambda s: bool(fits(s))
    )
    assert got is not None and got.model == "small"


def test_warm_takes_the_slot_that_fits_first() -> None:
    two = seats(("a1", "big", False, 0), ("a2", "big", False, 0), ("b", "small", False, 0))
    got = choose("warm", two, {"a2"}.__contains__)
    assert got is not None and (got.model, got.candidates) == ("big", ["a2", "a1"])


def test_warm_with_nothing_that_fits_goes_to_the_first_member() -> None:
    got = choose("warm", seats(("a", "big", False, 0), ("b", "small", False, 0)), NONE_FIT)
    assert got is not None and got.model == "big"


def test_warm_joins_a_load_in_flight() -> None:
    loading = [Seat("a", "big", False), Seat("b", "small", False, loading=True)]
    got = choose("warm", loading, NONE_FIT)
    assert got is not None and got.model == "small"


def test_first_is_always_the_first_member() -> None:
    got = choose("first", seats(("a", "big", False, 0), ("b", "small", True, 0)), NONE_FIT)
    assert got is not None and (got.model, got.candidates) == ("big", ["a"])


def test_spread_takes_the_least_busy_resident_slot() -> None:
    two = seats(("a1", "big", True, 2), ("a2", "big", True, 0), ("b", "small", True, 1))
    got = choose("spread", two, NONE_FIT)
    assert got is not None and (got.model, got.candidates) == ("big", ["a2", "a1"])
    tie = seats(("a1", "big", True, 1), ("a2", "big", True, 1))
    got = choose("spread", tie, NONE_FIT)
    assert got is not None and got.candidates == ["a1", "a2"]


def test_spread_with_nothing_resident_is_warm() -> None:
    got = choose(
        "spread", seats(("a", "big", False, 0), ("b", "small", False, 0)), {"b": 1}.__contains__
    )
    assert got is not None and got.model == "small"


def test_no_member_served_is_no_choice() -> None:
    assert choose("warm", [], ALL_FIT) is None


# ------------------------------------------------------------------ the body rewrite


def test_a_json_body_names_the_member_and_keeps_the_rest() -> None:
    body = json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "héllo"}], "n": 1.5}
    )
    out = with_model("application/json", body.encode(), "small")
    assert json.loads(out) == {**json.loads(body), "model": "small"}
    assert model_of("application/json", out) == "small"


def test_a_multipart_body_names_the_member() -> None:
    ctype = "multipart/form-data; boundary=XyZ"
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        b"RIFF....\r\n"
        b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nchat\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="language"\r\n\r\nen\r\n--XyZ--\r\n'
    )
    out = with_model(ctype, body, "whisper-small")
    assert model_of(ctype, out) == "whisper-small"
    assert out == body.replace(b"\r\n\r\nchat\r\n", b"\r\n\r\nwhisper-small\r\n")


# ------------------------------------------------------------------ the guard's write


def test_apply_writes_aliases_and_removes_the_ones_dropped(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    changed = apply_to_config(state(stack(ALIAS)), config, prune=True)
    assert "aliases" in changed
    snap = read_config_dir(config)
    assert not snap.errors, snap.errors
    assert snap.aliases["chat"].spec.models == ["big", "small"]
    assert snap.aliases["chat"].stack == "s"
    assert 'stack = "s"' in (config / "models.toml").read_text()
    # Another stack's alias is kept when stack s is applied again without its own.
    other = '[[alias]]\nid = "quick"\nmodels = ["small"]\nprefer = "first"\n'
    apply_to_config(state(stack(other, name="t")), config, prune=True)
    assert set(read_config_dir(config).aliases) == {"chat", "quick"}
    again = state(stack(""))
    assert alias_changes(again, read_config_dir(config)) == ["- chat"]
    assert "aliases" in apply_to_config(again, config, prune=True)
    snap = read_config_dir(config)
    assert set(snap.aliases) == {"quick"} and snap.aliases["quick"].spec.prefer == "first"
    assert alias_changes(again, snap) == []
    assert "aliases" not in apply_to_config(again, config, prune=True)


def test_a_hand_comment_on_an_unchanged_alias_survives(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    apply_to_config(state(stack(ALIAS)), config, prune=True)
    path = config / "models.toml"
    path.write_text(path.read_text().replace('id = "chat"', 'id = "chat"  # the chat alias'))
    changed_alias = ALIAS.replace('["big", "small"]', '["small", "big"]')
    apply_to_config(state(stack(changed_alias)), config, prune=True)
    text = path.read_text()
    assert "# the chat alias" in text
    assert read_config_dir(config).aliases["chat"].spec.models == ["small", "big"]


def test_an_alias_set_that_clashes_is_refused_changing_nothing(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    apply_to_config(state(stack(ALIAS)), config, prune=True)
    before = (config / "models.toml").read_bytes()
    # Stack w declares a model whose id is stack s's alias: each file is valid alone,
    # the resulting set is not (judged as a set before anything is written).
    clash = stack("", name="w", models='[[model]]\nid = "chat"\nsource = "demo://chat"\n')
    with pytest.raises(SlotConfigError) as err:
        apply_to_config(state(clash), config, prune=True)
    assert [p["code"] for p in err.value.details["problems"]] == ["alias.id_taken"]
    assert (config / "models.toml").read_bytes() == before


def test_a_hand_edited_models_toml_reports_alias_problems(tmp_path: Path) -> None:
    config = tmp_path / "config"
    (config / "slots").mkdir(parents=True)
    (config / "models.toml").write_text(
        MODELS
        + '\n[[alias]]\nid = "chat"\nmodels = ["big", "nope"]\nstack = "s"\n'
        + '\n[[alias]]\nid = "chat"\nmodels = ["small"]\n'
        + '\n[[alias]]\nid = "bad"\nmodels = []\n'
    )
    snap = read_config_dir(config)
    codes = sorted(p.code for p in snap.errors)
    assert codes == ["alias.duplicate_id", "alias.invalid_value", "alias.unknown_member"]
    assert snap.aliases["chat"].spec.models == ["big", "nope"]  # the first kept
    assert snap.aliases["chat"].stack == "s"
    assert snap.desired().aliases == snap.aliases
