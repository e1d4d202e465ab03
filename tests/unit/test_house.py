"""The house's shape (issue 41): every module under an import contract, and no import cycle.

import-linter (``lint-imports``, run by ``make test``) checks that the contracts in
``.importlinter`` are kept, but not that they say anything about a given module: a module
no contract lists is one no rule constrains, and a layers contract that skips a module of
its package is silently weaker. Nor does a layers contract see a cycle between two modules
it does not list. So, read from the code itself:

1. every module of ``controller/`` is named by a contract at its own level: a package whose
   modules a contract lists (``containers = controller.X`` with its ``layers``, or dotted
   names) has every one of its modules listed; the root has no module but ``__init__`` and
   ``__main__``;
2. the import graph has no cycle, counting every import: the ones inside functions and
   under ``TYPE_CHECKING`` too, which hide a cycle from a first reading without removing it.

Both checks are tested on synthetic trees first, so neither can pass by finding nothing.
"""

from __future__ import annotations

import ast
import configparser
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import controller

PACKAGE_ROOT = Path(controller.__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent
CONFIG = REPO_ROOT / ".importlinter"


def modules(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (package, *path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: Mapping[str, Path]) -> Iterator[str]:
    """The known modules ``name`` imports, wherever the import statement stands."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def import_graph(known: Mapping[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges = set(imports_of(name, path, known))
        if path.name == "__init__.py":  # a package importing its own modules is how packages work
            edges = {t for t in edges if not t.startswith(name + ".")}
        graph[name] = edges
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        found.append(sorted(component))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter
                counter += 1
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph.get(nxt, ())))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return found


def contracted(config_text: str) -> set[str]:
    """Every module name the contracts mention, a container's layers made absolute."""
    parser = configparser.ConfigParser()
    parser.read_string(config_text)
    names: set[str] = set()
    for section in parser.sections():
        containers = parser.get(section, "containers", fallback="").split()
        for key in ("layers", "source_modules", "forbidden_modules", "modules"):
            text = parser.get(section, key, fallback="")
            for token in re.findall(r"[A-Za-z_][\w.]*", text):
                names.add(token)
                names.update(f"{c}.{token}" for c in containers)
        names.update(containers)
    return names


def uncontracted(known: Iterable[str], named: set[str], package: str) -> list[str]:
    """Modules not named at their own level: for each, the nearest package some contract
    lists modules of must list this one (a package no contract looks inside is covered by
    the contract naming the package itself)."""
    missing = []
    for name in sorted(known):
        if name == package or name.endswith(".__main__"):
            continue
        parts = name.split(".")
        covered = False
        for i in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:i])
            if any(n.startswith(parent + ".") for n in named):
                covered = ".".join(parts[: i + 1]) in named
                break
        if not covered:
            missing.append(name)
    return missing


# ---------------------------------------------------------------- the checks on synthetic trees


def _tree(tmp_path: Path, files: Mapping[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(tmp_path / "pkg", "pkg")


def test_cycles_found_through_function_and_type_checking_imports(tmp_path: Path) -> None:
    known = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from pkg import b\n",
            "b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n"
            ),
            "c.py": "from . import d\n",
            "d.py": "import pkg.c\n",
            "e.py": "from pkg import a\n",
            "sub/__init__.py": "from pkg.sub import inner\n",  # a package's own: not a cycle
            "sub/inner.py": "import pkg.sub\n",
        },
    )
    assert cycles(import_graph(known)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_uncontracted_modules_found(tmp_path: Path) -> None:
    known = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "top/__init__.py": "",
            "top/x.py": "",
            "top/y.py": "",
            "low/__init__.py": "",
            "low/z.py": "",
            "alone/__init__.py": "",
            "alone/w.py": "",
        },
    )
    config = """
[importlinter:contract:root]
name = root
type = layers
layers =
    pkg.top
    pkg.low
[importlinter:contract:top]
name = top
type = layers
containers =
    pkg.top
layers =
    x
[importlinter:contract:pure]
name = pure
type = forbidden
source_modules =
    pkg.low.z
forbidden_modules =
    os
"""
    # top.y: its package's contract skips it; alone: no contract names the package at all
    assert uncontracted(known, contracted(config), "pkg") == [
        "pkg.alone",
        "pkg.alone.w",
        "pkg.top.y",
    ]


# ---------------------------------------------------------------- the checks on the package


def test_no_module_at_the_root_but_init_and_main() -> None:
    loose = sorted(
        p.name for p in PACKAGE_ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert loose == [], f"every module lives in a package named for its concern: {loose}"


def test_every_module_is_named_by_an_import_contract() -> None:
    known = modules(PACKAGE_ROOT, "controller")
    missing = uncontracted(known, contracted(CONFIG.read_text()), "controller")
    assert missing == [], (
        "modules no import contract names (add each to its package's layers in "
        f".importlinter): {missing}"
    )


def test_no_import_cycle_counting_every_import() -> None:
    found = cycles(import_graph(modules(PACKAGE_ROOT, "controller")))
    assert found == [], f"import cycles (function-level and TYPE_CHECKING imports counted): {found}"
