"""Alias CRs as a source (issue 25, item 3), without kopf: the loader's codes, the last
good spec kept, the newcomer of a duplicate id refused, a stack file's alias id taken,
pruning, and the status mapping; nothing is written."""

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


def test_an_alias_cr_is_the_kubernetes_stacks_alias(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081))])
    change = crs.load("Alias", [cr("assistant", {"models": ["m"], "prefer": "first"})])
    assert change.aliases == {"assistant"}
    entry = crs.cache.snapshot.aliases["assistant"]
    assert entry.stack == STACK and entry.spec.prefer == "first" and entry.spec.models == ["m"]
    assert crs.source.verdicts[KEY].accepted and not crs.source.verdicts[KEY].problems
    assert crs.source.alias_ids == {KEY: "assistant"}
    same = crs.load("Alias", [cr("assistant", {"models": ["m"], "prefer": "first"})])
    assert not same.aliases  # level-triggered
    assert read_config_dir(crs.config).aliases == {}  # in memory: nothing written

    # an invalid edit (a member not in the catalogue): the last good spec stays
    crs.load("Alias", [cr("assistant", {"models": ["m", "nosuch"]})])
    verdict = crs.source.verdicts[KEY]
    assert [p.code for p in verdict.problems] == ["alias.unknown_member"]
    assert verdict.accepted and not verdict.current
    assert crs.cache.snapshot.aliases["assistant"].spec.models == ["m"]
    crs.load("Alias", [cr("assistant", {"models": ["m"], "prefer": "soon"})])
    assert [p.code for p in crs.source.verdicts[KEY].problems] == ["alias.invalid_value"]

    # deleted: gone from the desired state
    assert crs.load("Alias", []).aliases == {"assistant"}
    assert crs.cache.snapshot.aliases == {}


def test_ids_taken_and_duplicates_are_refused(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081))])
    crs.load(
        "Alias",
        [
            cr("a", {"id": "same", "models": ["m"]}, created="1"),
            cr("b", {"id": "same", "models": ["m"]}, created="2"),  # the newcomer
            cr("m", {"models": ["m"]}),  # the catalogue model's id
            cr("chat", {"models": ["m"]}),  # a slot's name
        ],
    )
    verdicts = crs.source.verdicts
    codes = {k[2]: [p.code for p in v.problems] for k, v in verdicts.items() if k[0] == "Alias"}
    assert codes == {
        "a": [],
        "b": ["alias.duplicate_id"],
        "m": ["alias.id_taken"],
        "chat": ["alias.id_taken"],
    }
    assert set(crs.cache.snapshot.aliases) == {"same"}


def test_an_alias_a_stack_file_declares_is_not_taken_over(tmp_path: Path) -> None:
    config = tmp_path / "config"
    text = '[stack]\nname = "files"\n[[model]]\nid = "m"\nsource = "demo://m"\n'
    text += '[[alias]]\nid = "assistant"\nmodels = ["m"]\n'
    report = load_stack_texts([("files.toml", text)])
    assert report.state is not None
    apply_to_config(report.state, config, prune=True)
    crs = source_with(tmp_path, [])
    crs.load("Alias", [cr("assistant", {"models": ["m"], "prefer": "spread"})])
    verdict = crs.source.verdicts[KEY]
    assert [p.code for p in verdict.problems] == ["alias.duplicate_id"]
    entry = crs.cache.snapshot.aliases["assistant"]
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
