"""Proof that nothing but the guard writes slot config (SPEC §2, "Tests prove no other code
path writes slot config").

Two static scans over every module under ``controller/``:

1. file-writing calls (``open`` for writing, ``write_text``, ``os.replace``, ``shutil.move``,
   the atomic writers, ``tomlkit.dump``, deletions ...) are allowed only in the modules of
   :data:`FILE_WRITERS`, each with the reason it may write;
2. the slot-config writers (``write_slot_config``, ``write_slot_configs``,
   ``delete_slot_config``, ``write_catalogue``) are referenced only from
   :data:`CONFIG_WRITER_USERS`.

A new module that writes files, or a new caller of the guard's writers, fails here until it
is added to the allow-list on purpose, with its reason. The scanner itself is tested on
synthetic sources so the scan cannot pass by detecting nothing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import controller

PACKAGE_ROOT = Path(controller.__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent

# module (path relative to the repo root) -> why it may write files
FILE_WRITERS: dict[str, str] = {
    "controller/store/state.py": "writes observed state (state.json, the aux records) "
    "through the store's atomic writers",
    "controller/store/residency.py": "writes residency.json through the store's atomic writer",
    "controller/store/files.py": "defines the atomic writers (temp file + fsync + "
    "os.replace) and sweeps their temp files",
    "controller/store/lock.py": "the controller lock file, controller.json and the API "
    "token (0600), through the store's atomic writers",
    "controller/spec/guard.py": "the write boundary: the one writer of slot config "
    "(<config_dir>/slots/*.toml) and the catalogue (models.toml), plus its lock file",
    "controller/runtime/process/servers.py": "the process runtime writes and rotates server "
    "logs under the state dir (never the config dir)",
    "controller/runtime/docker/surge.py": "no file: Container.rename renames a Docker "
    "container (a surge's second one into the slot's name)",
    "controller/access/keys.py": "keys.json (0600): the API keys created and revoked, through the "
    "store's atomic writer (never the config dir)",
    "controller/modelfiles/partial.py": "the models dir (never the config dir): a pull's partial "
    "file, appended and hashed, renamed into place once verified, and its flock file",
    "controller/modelfiles/layout.py": "the models dir: bytes that failed verification are moved "
    "to its quarantine, with a note of what was expected beside them",
    "controller/modelfiles/pull.py": "the models dir: stale partial files removed, a snapshot's "
    "staged files renamed into place, `model rm`; its partial files' sidecars through the "
    "store's atomic writer (never the config dir)",
    "controller/modelfiles/gc.py": "the models dir's GC removes model files no declared model "
    "references (never a pinned one, never the config dir)",
    "controller/modelfiles/records.py": "<state_dir>/models/files.json (verified digests, last "
    "use) through the store's atomic writer",
    "controller/cli/export.py": "`stack export --output-dir` writes exported stack "
    "files / Quadlet units where the user asks (never the config dir)",
    "controller/cli/migrate.py": "`slotctl import --output FILE` writes the imported stack "
    "where the user asks (a file they then apply; never the config dir)",
    "controller/cli/pull.py": "`model pull --source --termination-log PATH` writes a failed "
    "pull's typed error where a pod's kubelet reads its termination message (never the "
    "config dir)",
    "controller/cli/k8s.py": "`crd generate` writes the CRD manifests, `stack export --format "
    "crd` / `stack import --output-dir` the converted files, where the user asks (never the "
    "config dir)",
}

# module -> why it may import or call write_slot_config / delete_slot_config / write_catalogue
CONFIG_WRITER_USERS: dict[str, str] = {
    "controller/spec/guard.py": "defines them",
    "controller/reconcile/apply.py": "`stack apply` and GitOps: writes a validated stack into the "
    "config dir, every write through the guard's functions",
    "controller/api/routes.py": "the HTTP API's slot writes (POST/PUT/PATCH/DELETE "
    "/api/slots, swap) go through the guard's functions",
}

CONFIG_WRITERS = frozenset(
    {"write_slot_config", "write_slot_configs", "delete_slot_config", "write_catalogue"}
)

_ATOMIC_WRITERS = frozenset({"atomic_write_bytes", "atomic_write_json"})
_PATH_WRITE_METHODS = frozenset({"write_text", "write_bytes", "touch", "unlink", "rmdir"})
_OS_WRITES = frozenset(
    {"replace", "rename", "renames", "remove", "unlink", "rmdir", "removedirs", "truncate"}
)
_OS_WRITE_FLAGS = frozenset({"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"})
_SHUTIL_WRITES = frozenset(
    {"move", "copy", "copy2", "copyfile", "copyfileobj", "copytree", "rmtree", "copymode"}
)
_TEMPFILE_WRITES = frozenset({"mkstemp", "NamedTemporaryFile", "TemporaryFile"})


@dataclass(frozen=True)
class Finding:
    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.what}"


def _mode_writes(node: ast.expr | None) -> bool:
    """A mode argument that writes: any of w/a/x/+, or anything not a literal (unknown)."""
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return any(c in node.value for c in "wax+")
    return True


def _flags_write(node: ast.expr) -> bool:
    names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return bool(names & _OS_WRITE_FLAGS) or not names  # a bare int: assume the worst


def _arg(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[index] if len(call.args) > index else None


class _WriteScanner(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.findings: list[Finding] = []
        # local name -> "module.attr" for `from os import replace as r` and friends
        self.imported: dict[str, str] = {}
        self.modules: dict[str, str] = {}  # alias -> module for `import shutil as sh`

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.modules[alias.asname or alias.name] = alias.name
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        self.generic_visit(node)

    def _hit(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.module, getattr(node, "lineno", 0), what))

    def visit_Call(self, node: ast.Call) -> None:
        what = self._classify(node)
        if what:
            self._hit(node, what)
        self.generic_visit(node)

    def _qualified(self, func: ast.expr) -> str | None:
        """``os.replace`` / ``shutil.move`` / an imported bare name, as module.attr."""
        if isinstance(func, ast.Name):
            return self.imported.get(func.id, f"builtins.{func.id}")
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = func.value.id
            if base in self.modules:
                return f"{self.modules[base]}.{func.attr}"
        return None

    def _classify(self, call: ast.Call) -> str | None:
        func = call.func
        qualified = self._qualified(func)
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in _ATOMIC_WRITERS:
            return f"{name}(...)"
        if qualified is not None:
            mod, _, attr = qualified.rpartition(".")
            if mod in {"builtins", "io", "codecs"} and attr == "open":
                return "open(..., write mode)" if _mode_writes(_arg(call, 1, "mode")) else None
            if mod == "os" and attr == "open":
                flags = _arg(call, 1, "flags")
                return "os.open(..., write flags)" if flags is None or _flags_write(flags) else None
            if mod == "os" and attr == "fdopen":
                return "os.fdopen(..., write mode)" if _mode_writes(_arg(call, 1, "mode")) else None
            if mod == "os" and attr in _OS_WRITES:
                return f"os.{attr}(...)"
            if mod == "shutil" and attr in _SHUTIL_WRITES:
                return f"shutil.{attr}(...)"
            if mod == "tempfile" and attr in _TEMPFILE_WRITES:
                return f"tempfile.{attr}(...)"
            if mod == "tomlkit" and attr == "dump":
                return "tomlkit.dump(...)"
            if mod in {"builtins", "io", "codecs", "os", "shutil", "tempfile", "tomlkit"}:
                return None
        if not isinstance(func, ast.Attribute):
            return None
        # Method calls on something else: Path objects, file handles, documents.
        if name == "open":  # Path.open(mode)
            return "Path.open(write mode)" if _mode_writes(_arg(call, 0, "mode")) else None
        if name in _PATH_WRITE_METHODS:
            return f".{name}(...)"
        if name in {"replace", "rename"} and len(call.args) == 1 and not call.keywords:
            # Path.replace(target) / Path.rename(target); str.replace takes two arguments
            # and datetime.replace keywords, so those are not file writes.
            return f"Path.{name}(...)"
        return None


def scan_writes(source: str, module: str = "<test>") -> list[Finding]:
    scanner = _WriteScanner(module)
    scanner.visit(ast.parse(source))
    return scanner.findings


def scan_references(source: str, names: frozenset[str], module: str = "<test>") -> list[Finding]:
    """Imports, names and attributes that mention any of ``names``."""
    found: list[Finding] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [
                Finding(module, node.lineno, f"imports {a.name}")
                for a in node.names
                if a.name in names or a.name == "*"
            ]
        elif isinstance(node, ast.Name) and node.id in names:
            found.append(Finding(module, node.lineno, f"uses {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append(Finding(module, node.lineno, f"uses .{node.attr}"))
        elif isinstance(node, ast.Constant) and node.value in names:
            # getattr(guard, "write_slot_config"), importlib tricks
            found.append(Finding(module, node.lineno, f"names {node.value!r} in a string"))
    return found


def package_modules() -> dict[str, str]:
    modules = {
        str(path.relative_to(REPO_ROOT)): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
    }
    assert "controller/spec/guard.py" in modules and "controller/store/files.py" in modules
    return modules


# --------------------------------------------------------------------- the scans


def test_only_allow_listed_modules_write_files() -> None:
    offenders = [
        str(finding)
        for module, source in package_modules().items()
        if module not in FILE_WRITERS
        for finding in scan_writes(source, module)
    ]
    assert not offenders, (
        "file-writing calls outside the allow-list (slot config goes through "
        "controller.spec.guard; state through controller.store). If this module must write "
        "files, add it to FILE_WRITERS with the reason:\n" + "\n".join(offenders)
    )


def test_allow_listed_writers_exist_and_still_write() -> None:
    modules = package_modules()
    for module in FILE_WRITERS:
        assert module in modules, f"stale allow-list entry {module}"
        assert scan_writes(modules[module], module), f"{module} no longer writes: drop it"


def test_guard_writes_only_through_the_atomic_writer() -> None:
    # Inside the guard every write of config is atomic_write_bytes; the other findings are
    # the lock file (os.open O_RDWR|O_CREAT) and delete_slot_config's unlink.
    findings = scan_writes(package_modules()["controller/spec/guard.py"])
    kinds = sorted({f.what for f in findings})
    assert kinds == [".unlink(...)", "atomic_write_bytes(...)", "os.open(..., write flags)"]


def test_only_allow_listed_modules_reference_the_config_writers() -> None:
    offenders = [
        str(finding)
        for module, source in package_modules().items()
        if module not in CONFIG_WRITER_USERS
        for finding in scan_references(source, CONFIG_WRITERS, module)
    ]
    assert not offenders, (
        "new callers of the slot-config writers; add them to CONFIG_WRITER_USERS on "
        "purpose:\n" + "\n".join(offenders)
    )


def test_config_writer_users_exist() -> None:
    modules = package_modules()
    for module in CONFIG_WRITER_USERS:
        assert module in modules, f"stale allow-list entry {module}"
        assert scan_references(modules[module], CONFIG_WRITERS, module)


def test_slot_config_layout_is_only_named_by_the_guard_and_the_reader() -> None:
    # The config-dir paths come from the guard's constants; nobody else spells them.
    allowed = {"controller/spec/guard.py", "controller/spec/configdir.py"}
    constants = frozenset({"SLOTS_SUBDIR", "CATALOGUE_FILE", "slot_config_path"})
    offenders = [
        str(finding)
        for module, source in package_modules().items()
        if module not in allowed
        for finding in scan_references(source, constants, module)
    ]
    assert not offenders, "\n".join(offenders)


# --------------------------------------------------------- the scanner, self-tested


@pytest.mark.parametrize(
    "source",
    [
        'open(p, "w")',
        'open(p, "a")',
        'open(p, mode="wb")',
        'open(p, "r+")',
        'open(p, "x")',
        "open(p, mode)",  # unknown mode: assume it writes
        'io.open(p, "w")',
        'path.open("w")',
        'path.open(mode="a")',
        "path.write_text(text)",
        "path.write_bytes(data)",
        "path.touch()",
        "path.unlink()",
        "path.replace(target)",
        "path.rename(target)",
        "os.replace(a, b)",
        "os.rename(a, b)",
        "os.remove(a)",
        "os.open(p, os.O_WRONLY | os.O_CREAT)",
        "os.open(p, flags=os.O_RDWR)",
        'os.fdopen(fd, "wb")',
        "shutil.move(a, b)",
        "shutil.copy(a, b)",
        "shutil.copy2(a, b)",
        "shutil.copyfile(a, b)",
        "shutil.rmtree(d)",
        "tempfile.mkstemp(dir=d)",
        "atomic_write_bytes(p, b'x')",
        "store.atomic_write_json(p, {})",
        "tomlkit.dump(doc, fp)",
        "from os import replace\nreplace(a, b)",
        "from shutil import move as mv\nmv(a, b)",
        "import shutil as sh\nsh.copy(a, b)",
        "from tomlkit import dump\ndump(doc, fp)",
        "def f():\n    with open(p, 'w') as fh:\n        fh.write('x')",
    ],
)
def test_scanner_detects_writes(source: str) -> None:
    prelude = "import os, io, shutil, tempfile, tomlkit\n"
    findings = scan_writes(prelude + source)
    assert len(findings) == 1, findings
    assert findings[0].line >= 2


@pytest.mark.parametrize(
    "source",
    [
        "open(p)",
        'open(p, "r")',
        'open(p, "rb")',
        'path.open("rb")',
        "path.open()",
        "path.read_text()",
        'name.replace("_", "-")',
        "stamp.replace(tzinfo=None)",
        "tomlkit.dumps(doc)",
        "tomlkit.parse(text)",
        "os.open(d, os.O_RDONLY | os.O_DIRECTORY)",
        "json.dumps(x)",
        "dataclasses.replace(p, slot=1)",
        "from dataclasses import replace\nreplace(p, slot=1)",
        "shutil.which('slotctl')",
        "os.environ.get('X')",
    ],
)
def test_scanner_ignores_reads_and_lookalikes(source: str) -> None:
    prelude = "import os, io, json, shutil, tomlkit, dataclasses\n"
    assert scan_writes(prelude + source) == []


def test_scanner_flags_a_synthetic_module_that_writes_slot_config() -> None:
    rogue = """
from pathlib import Path
import tomlkit

def sneaky_update(config_dir: Path, doc) -> None:
    target = config_dir / "slots" / "chat.toml"
    target.write_text(tomlkit.dumps(doc))
"""
    findings = scan_writes(rogue, "controller/api/rogue.py")
    assert [str(f) for f in findings] == ["controller/api/rogue.py:7: .write_text(...)"]


@pytest.mark.parametrize(
    "source",
    [
        "from controller.spec import write_slot_config",
        "from controller.spec.guard import delete_slot_config as d",
        "import controller.spec as s\ns.write_catalogue(d, [])",
        "getattr(guard, 'write_slot_config')(d, p)",
        "from controller.spec.guard import *",
    ],
)
def test_reference_scanner_detects_callers(source: str) -> None:
    assert scan_references(source, CONFIG_WRITERS)


def test_reference_scanner_ignores_the_guard_itself() -> None:
    source = "from controller.spec import guard_slot_write_payload\nguard_slot_write_payload(p)"
    assert scan_references(source, CONFIG_WRITERS) == []
