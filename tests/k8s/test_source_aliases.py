"""Alias CRs as a source (issue 25, item 3), without kopf: the loader's codes, the last
good spec kept, the newcomer of a duplicate id refused, a stack file's alias id taken,
pruning, and the status mapping."""

from __future__ import annotations

from pathlib import Path

from controller.operator.source import STACK
from controller.operator.source_aliases import alias_status
from controller.operator.status import Verdict
from controller.reconcile.apply import apply_to_config
from controller.spec.configdir import read_config_dir
from controller.spec.loader import load_stack_texts
from controller.spec.problems import Problem
from tests.k8s.test_source import cr, slot_spec, source_with

KEY = ("Alias", "default", "assistant")


def test_an_alias_cr_is_written_as_the_kubernetes_stacks_alias(tmp_path: Path) -> None:
    source = source_with(tmp_path, [cr("chat", slot_spec(18081))])
    source.load("Alias", [cr("assistant", {"models": ["m"], "prefer": "first"})])
    result = source.sync()
    assert "aliases" in result.changed
    entry = read_config_dir(tmp_path / "config").aliases["assistant"]
    assert entry.stack == STACK and entry.spec.prefer == "first" and entry.spec.models == ["m"]
    assert result.verdicts[KEY].accepted and not result.verdicts[KEY].problems
    assert source.alias_ids == {KEY: "assistant"}
    assert "aliases" not in source.sync().changed  # level-triggered

    # an invalid edit (a member not in the catalogue): the last good spec stays
    source.load("Alias", [cr("assistant", {"models": ["m", "nosuch"]})])
    result = source.sync()
    assert [p.code for p in result.verdicts[KEY].problems] == ["alias.unknown_member"]
    assert result.verdicts[KEY].accepted and not result.verdicts[KEY].current
    assert read_config_dir(tmp_path / "config").aliases["assistant"].spec.models == ["m"]
    source.load("Alias", [cr("assistant", {"models": ["m"], "prefer": "soon"})])
    codes = [p.code for p in source.sync().verdicts[KEY].problems]
    assert codes == ["alias.invalid_value"]

    # deleted: pruned from the config dir
    source.load("Alias", [])
    assert "aliases" in source.sync().changed
    assert read_config_dir(tmp_path / "config").aliases == {}


def test_ids_taken_and_duplicates_are_refused(tmp_path: Path) -> None:
    source = source_with(tmp_path, [cr("chat", slot_spec(18081))])
    source.load(
        "Alias",
        [
            cr("a", {"id": "same", "models": ["m"]}, created="1"),
            cr("b", {"id": "same", "models": ["m"]}, created="2"),  # the newcomer
            cr("m", {"models": ["m"]}),  # the catalogue model's id
            cr("chat", {"models": ["m"]}),  # a slot's name
        ],
    )
    verdicts = source.sync().verdicts
    codes = {k[2]: [p.code for p in v.problems] for k, v in verdicts.items() if k[0] == "Alias"}
    assert codes == {
        "a": [],
        "b": ["alias.duplicate_id"],
        "m": ["alias.id_taken"],
        "chat": ["alias.id_taken"],
    }
    assert set(read_config_dir(tmp_path / "config").aliases) == {"same"}


def test_an_alias_a_stack_file_declares_is_not_taken_over(tmp_path: Path) -> None:
    config = tmp_path / "config"
    text = '[stack]\nname = "files"\n[[model]]\nid = "m"\nsource = "demo://m"\n'
    text += '[[alias]]\nid = "assistant"\nmodels = ["m"]\n'
    report = load_stack_texts([("files.toml", text)])
    assert report.state is not None
    apply_to_config(report.state, config, prune=True)
    source = source_with(tmp_path, [])
    source.load("Alias", [cr("assistant", {"models": ["m"], "prefer": "spread"})])
    verdict = source.sync().verdicts[KEY]
    assert [p.code for p in verdict.problems] == ["alias.duplicate_id"]
    entry = read_config_dir(config).aliases["assistant"]
    assert entry.stack == "files" and entry.spec.prefer == "warm"


def test_alias_status() -> None:
    ok = alias_status("assistant", Verdict(generation=2, accepted=True, current=True), None)
    ready = {c["type"]: c for c in ok["conditions"]}["Ready"]
    assert ok["id"] == "assistant" and ok["observedGeneration"] == 2
    assert ready["status"] == "True" and ready["reason"] == "Declared" and "lastError" not in ok
    problem = Problem(code="alias.unknown_member", message="no")
    bad = alias_status(None, Verdict(generation=1, problems=(problem,)), ok)
    conditions = {c["type"]: c for c in bad["conditions"]}
    assert conditions["Ready"]["status"] == "False" and conditions["Degraded"]["status"] == "True"
    assert bad["lastError"]["code"] == "alias.unknown_member"
