"""Proof that the slot record has owners (docs/design/0016-slot-record-owners.md).

A static scan of every module of ``controller/slots/``: each thing a
:class:`~controller.slots.records.SlotRecord` holds is written by its owner only.

1. the record's **facts** (state, binding, placement, tier, timestamps, costs...) are
   assigned only in ``table.py`` (``SlotTable``'s guarded setters); its hash memo only in
   ``core.py``; ``lock``, ``book``, ``flight`` and ``on_nodes`` are made with it, never
   assigned; the crash breaker changes only through the table;
2. the **running server** is one frozen value, assigned in one place: ``SlotTable.run``;
3. the **coordination** objects change only in their own modules (``flight.py``,
   ``leasebook.py``), and only the parts listed in :data:`CALLERS` call what changes them.

Writes are assignments (plain, augmented, annotated, ``del``, ``setattr``), item stores
into an owned container, and calls of mutating methods on one (``x.book.leases.clear()``).
The scan reads attribute names, not types, so it is scoped to the one package that can
reach a record: a test below checks that no module outside ``controller/slots/`` imports
the record's classes. The scanner itself is tested on synthetic sources first, so it cannot
pass by finding nothing.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

import controller
from controller.slots.flight import LoadFlight
from controller.slots.leasebook import LeaseBook
from controller.slots.records import RunningServer, SlotRecord

PACKAGE_ROOT = Path(controller.__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent
SLOTS = "controller/slots/"

TABLE = "controller/slots/table.py"
CORE = "controller/slots/core.py"
FLIGHT = "controller/slots/flight.py"
BOOK = "controller/slots/leasebook.py"
LOADING = "controller/slots/loading.py"
UNITS = "controller/slots/units.py"
LEASES = "controller/slots/leases.py"
UNLOADING = "controller/slots/unloading.py"
HOUSEKEEPING = "controller/slots/housekeeping.py"
RECOVERY = "controller/slots/recovery.py"
SURGE = "controller/slots/surge.py"
PULLING = "controller/slots/pulling.py"
MANAGER = "controller/slots/manager.py"

NOBODY = "(nobody: made with the record)"
# The record's fields that are not the table's facts.
NOT_FACTS: Mapping[str, str] = {
    "hashed": CORE,  # the launch hash's memo (Core.launch_hash, Core.forget_hash)
    "lock": NOBODY,
    "book": NOBODY,
    "flight": NOBODY,
    "on_nodes": NOBODY,
}


def owners() -> dict[str, str]:
    """Every owned attribute name -> the module that may write it."""
    out = {f.name: NOT_FACTS.get(f.name, TABLE) for f in dataclasses.fields(SlotRecord)}
    for cls, module in ((LoadFlight, FLIGHT), (LeaseBook, BOOK)):
        for name in cls.__slots__:
            assert name not in out, f"{name} names a field of two owners"
            out[name] = module
    return out


# Attributes of a record's name that are something else's (the scan reads names, not
# types): (module, the target as written) -> what it is.
NOT_RECORDS: Mapping[tuple[str, str], str] = {
    (UNITS, "error.message"): "a typed error's message (a member's refusal as its unit's)",
}

# (holder, method) -> the modules that may call it: what changes a coordination object,
# or the breaker, called through the record (or a local of the holder's name).
CALLERS: Mapping[tuple[str, str], frozenset[str]] = {
    ("breaker", "record_failure"): frozenset({TABLE}),
    ("breaker", "reset"): frozenset({TABLE}),
    ("breaker", "restore"): frozenset({TABLE}),
    ("flight", "begin"): frozenset({LOADING, UNITS}),  # a unit's load is its members'
    ("flight", "decided"): frozenset({LOADING, UNITS}),
    ("flight", "next_generation"): frozenset({LOADING, RECOVERY, SURGE}),  # a new server
    ("flight", "wanting"): frozenset({LOADING}),
    ("flight", "reserve"): frozenset({LOADING}),
    ("flight", "ready"): frozenset({LOADING}),
    ("flight", "abandon"): frozenset({LOADING}),
    ("flight", "avoid"): frozenset({LOADING}),
    # a load's pull of its model files: run by pulling, stopped by an unload or a removal
    ("flight", "pulling"): frozenset({PULLING}),
    ("flight", "progressed"): frozenset({PULLING}),
    ("flight", "pulled"): frozenset({PULLING}),
    ("flight", "stop_pull"): frozenset({UNLOADING, MANAGER}),
    ("book", "add"): frozenset({LEASES}),
    ("book", "remove"): frozenset({LEASES}),
    ("book", "join_cold"): frozenset({LEASES}),
    ("book", "leave_cold"): frozenset({LEASES}),
    # a place in the slot's line, per flow (the line's admission: scheduling/queueshare)
    ("book", "enter"): frozenset({LEASES}),
    ("book", "leave"): frozenset({LEASES}),
    ("book", "shed_newest"): frozenset({LEASES}),
    ("book", "queue"): frozenset({LEASES}),
    # the server goes under its requests: a failed load, a drain's timeout, a hung server
    ("book", "revoke_all"): frozenset({LOADING, UNLOADING, HOUSEKEEPING}),
    ("book", "drain"): frozenset({UNLOADING, HOUSEKEEPING}),  # no new lease meanwhile
    ("book", "end_turns"): frozenset({TABLE}),  # a slot forgotten: its turns start over
}
# The mutators of each holder: every public method that is not a read.
READS: Mapping[str, frozenset[str]] = {
    "breaker": frozenset({"check", "retry_after", "to_record"}),
    "flight": frozenset({"running", "avoided"}),
    "book": frozenset({"in_flight", "holds", "queued", "held_for", "waiting_classes", "holding"}),
}

_MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "clear",
        "update",
        "setdefault",
        "add",
        "discard",
        "remove",
        "sort",
        "reverse",
        "set",
        "push",
    }
)


@dataclass(frozen=True)
class Finding:
    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.what}"


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        targets: list[ast.expr] = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    else:
        return
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets += target.elts
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        else:
            yield target


def _holder(node: ast.expr) -> str | None:
    """``x.book`` or a local named ``book``: the holder's name."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, module: str, owned: Mapping[str, str]) -> None:
        self.module = module
        self.owned = owned
        self.findings: list[Finding] = []
        self.classes: list[str] = []
        self.functions: list[str] = []

    def _hit(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.module, getattr(node, "lineno", 0), what))

    def _foreign(self, attr: str) -> bool:
        owner = self.owned.get(attr)
        return owner is not None and owner != self.module

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def generic_visit(self, node: ast.AST) -> None:
        for target in _targets(node):
            self._target(target)
        super().generic_visit(node)

    def _target(self, target: ast.expr) -> None:
        if (self.module, ast.unparse(target)) in NOT_RECORDS:
            return
        if isinstance(target, ast.Attribute):
            own = isinstance(target.value, ast.Name) and target.value.id == "self"
            if own and (not self.classes or self.classes[-1] != "SlotRecord"):
                return  # another class's own attribute (a record's are the table's)
            if self._foreign(target.attr):
                self._hit(target, f"assigns .{target.attr} (owner: {self.owned[target.attr]})")
            elif target.attr == "server" and self.functions[-1:] != ["run"]:
                self._hit(target, "assigns .server outside SlotTable.run")
        elif isinstance(target, ast.Subscript):
            inner = target.value
            if isinstance(inner, ast.Attribute) and self._foreign(inner.attr):
                self._hit(target, f"stores into .{inner.attr} (owner: {self.owned[inner.attr]})")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            receiver = func.value
            holder = _holder(receiver) or ""
            allowed = CALLERS.get((holder, func.attr))
            if allowed is not None and self.module not in allowed:
                self._hit(node, f"calls {holder}.{func.attr}() (callers: {sorted(allowed)})")
            elif (
                holder in READS
                and (holder, func.attr) not in CALLERS
                and func.attr not in READS[holder]
                and not func.attr.startswith("_")
            ):
                self._hit(node, f"calls {holder}.{func.attr}(), which CALLERS does not know")
            if (
                func.attr in _MUTATORS
                and holder not in READS  # a holder's methods: CALLERS above
                and isinstance(receiver, ast.Attribute)
                and self._foreign(receiver.attr)
            ):
                self._hit(node, f"mutates .{receiver.attr} (owner: {self.owned[receiver.attr]})")
        if isinstance(func, ast.Name | ast.Attribute) and _holder(func) in {
            "setattr",
            "__setattr__",
        }:
            name = node.args[1] if len(node.args) > 1 else None
            value = name.value if isinstance(name, ast.Constant) else None
            if isinstance(value, str) and (self._foreign(value) or value == "server"):
                self._hit(node, f"setattr of {value!r}")
        self.generic_visit(node)


def scan(source: str, module: str, owned: Mapping[str, str] | None = None) -> list[Finding]:
    scanner = _Scanner(module, owners() if owned is None else owned)
    scanner.visit(ast.parse(source))
    return scanner.findings


def package_modules() -> dict[str, str]:
    modules = {
        str(path.relative_to(REPO_ROOT)): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
    }
    assert TABLE in modules and LOADING in modules
    return modules


# --------------------------------------------------------------------- the package


def test_only_the_owners_write_what_a_slot_record_holds() -> None:
    offenders = [
        str(finding)
        for module, source in package_modules().items()
        if module.startswith(SLOTS)
        for finding in scan(source, module)
    ]
    assert not offenders, (
        "a write of a slot record's facts, server or coordination outside its owner "
        "(docs/design/0016): call the owner's setter, or change the owner on purpose here "
        "with the reason:\n" + "\n".join(offenders)
    )


def test_every_field_has_an_owner_and_the_server_is_one_frozen_value() -> None:
    fields = {f.name for f in dataclasses.fields(SlotRecord)}
    assert set(NOT_FACTS) <= fields, set(NOT_FACTS) - fields
    assert {"state", "placement", "asleep", "costs", "server", "last_used"} <= fields
    assert RunningServer.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert {f.name for f in dataclasses.fields(RunningServer)} >= {
        "launch",
        "config_hash",
        "adopted",
    }


def test_the_callers_name_real_methods_and_every_mutator_has_callers() -> None:
    holders: dict[str, type[LoadFlight] | type[LeaseBook]] = {
        "flight": LoadFlight,
        "book": LeaseBook,
    }
    for (holder, method), modules in CALLERS.items():
        if holder in holders:
            assert hasattr(holders[holder], method), (holder, method)
        assert modules, (holder, method)
    for holder, cls in holders.items():
        public = {n for n in vars(cls) if not n.startswith("_")} - set(cls.__slots__)
        unknown = public - READS[holder] - {m for h, m in CALLERS if h == holder}
        assert not unknown, f"{holder}: say who may call {sorted(unknown)} (CALLERS or READS)"


def test_each_listed_caller_and_exception_is_still_there() -> None:
    modules = package_modules()
    stale = []
    for (holder, method), callers in CALLERS.items():
        for module in sorted(callers):
            calls = [
                n
                for n in ast.walk(ast.parse(modules[module]))
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == method
                and _holder(n.func.value) == holder
            ]
            if not calls:
                stale.append(f"{module} no longer calls {holder}.{method}(): drop it")
    for module, target in NOT_RECORDS:
        written = {
            ast.unparse(t) for n in ast.walk(ast.parse(modules[module])) for t in _targets(n)
        }
        if target not in written:
            stale.append(f"{module} no longer assigns {target}: drop it from NOT_RECORDS")
    assert not stale, "\n".join(stale)


def test_the_record_is_reached_only_inside_its_package() -> None:
    inner = {"SlotRecord", "RunningServer", "LoadFlight", "LeaseBook", "SlotTable", "Core"}
    private = {"controller.slots.table", "controller.slots.core", "controller.slots.flight"}
    offenders = []
    for module, source in package_modules().items():
        if module.startswith(SLOTS):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "controller.slots"
            ):
                names = {a.name for a in node.names}
                if names & inner or node.module in private or "*" in names:
                    offenders.append(f"{module}:{node.lineno}: from {node.module} import {names}")
    assert not offenders, "\n".join(offenders)


# --------------------------------------------------------- the scanner, self-tested

OWNED = {"state": TABLE, "hashed": CORE, "leases": BOOK, "generation": FLIGHT, "lock": NOBODY}


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("slot.state = S.READY", "assigns .state"),
        ("slot.state, other = a, b", "assigns .state"),
        ("slot.flight.generation += 1", "assigns .generation"),
        ("del slot.state", "assigns .state"),
        ("x: int\nslot.state: int = 1", "assigns .state"),
        ("slot.book.leases[1] = lease", "stores into .leases"),
        ("slot.book.leases.clear()", "mutates .leases"),
        ("slot.book.leases.pop(1, None)", "mutates .leases"),
        ("setattr(slot, 'state', 1)", "setattr of 'state'"),
        ("object.__setattr__(slot, 'state', 1)", "setattr of 'state'"),
        ("slot.lock = asyncio.Lock()", "assigns .lock"),
        ("slot.server = server", "assigns .server outside SlotTable.run"),
        ("def ready(t, slot):\n    slot.server = None", "assigns .server outside"),
        ("slot.breaker.reset()", "calls breaker.reset()"),
        ("slot.breaker.record_failure(1.0, 'x')", "calls breaker.record_failure()"),
        ("slot.flight.begin(task, background=True)", "calls flight.begin()"),
        ("flight = slot.flight\nflight.next_generation()", "calls flight.next_generation()"),
        ("slot.book.revoke_all(error)", "calls book.revoke_all()"),
        ("with book.drain():\n    pass", "calls book.drain()"),
        ("slot.book.forge(1)", "which CALLERS does not know"),
        ("class SlotRecord:\n    def f(self):\n        self.state = 1", "assigns .state"),
    ],
)
def test_scanner_detects_writes_outside_the_owner(source: str, what: str) -> None:
    findings = scan(source, "controller/slots/rogue.py", OWNED)
    assert len(findings) == 1, findings
    assert what in findings[0].what, findings


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("slot.state = S.READY", TABLE),
        ("slot.hashed = None", CORE),
        ("self.generation += 1", FLIGHT),
        ("slot.book.leases.clear()", BOOK),
        ("class SlotTable:\n    def run(self, slot, server):\n        slot.server = server", TABLE),
        ("self.state = 1  # another class's own attribute", LOADING),
        ("slot.flight.begin(task, background=False)", LOADING),
        ("slot.flight.next_generation()", SURGE),
        ("slot.book.revoke_all(error)", HOUSEKEEPING),
        ("slot.breaker.check('a', 1.0, 3)", LOADING),
        ("n = slot.book.held_for(now) + slot.book.queued", LOADING),
        ("view = slot.state\nx = slot.book.leases.get(1)", LOADING),
        ("self.table.records.pop(name)", LOADING),
        ("error.message = prefix + error.message  # NOT_RECORDS", UNITS),
        ("counts[slot.state] = 1", LOADING),
    ],
)
def test_scanner_lets_the_owners_write_and_everyone_read(source: str, module: str) -> None:
    assert scan(source, module, OWNED) == []
