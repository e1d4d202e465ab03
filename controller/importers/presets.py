"""llama.cpp's router presets (``llama-server --models-preset FILE.ini``) -> a slotctl stack.

Written from llama-server's README (``tools/server/README.md``, "Using multiple models" ->
"Model presets"; PRs #17859 and #18206): each ``[section]`` is a model (its name the
model id; ``[*]`` holds options every model shares, a model's own winning); a key is a
command-line argument without its dashes (``n-gpu-layers = 123``), a short form (``c``,
``ngl``) or an environment variable (``LLAMA_ARG_CACHE_RAM``); a flag takes ``true``;
``;`` and ``#`` start comments; a section needs ``model`` or an HF repo unless its name
is a cached model (``[user/model:quant]``). Two keys are presets' own:
``load-on-startup`` (-> ``autoload``) and ``stop-timeout``. Host, port, API key and
alias are the router's (here: slotctl's). Each model becomes a ``llamacpp`` slot whose
options go through the same reading as a llama-swap ``cmd``
(:func:`controller.importers.servers.import_server`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from controller.importers.hub import Lister, parse_hf
from controller.importers.report import ImportReport
from controller.importers.servers import import_server
from controller.importers.stackdoc import (
    ImportResult,
    StackDoc,
    model_id_of,
    slot_name_of,
    stack_name_of,
)
from controller.model.errors import ImportSourceError

__all__ = ["SHORT_KEYS", "import_presets", "parse_ini"]

GLOBAL: Final = "*"
# llama-server's short argument forms (README, "common params"): one dash, not two.
SHORT_KEYS: Final = frozenset(
    {
        "c", "n", "b", "ub", "t", "tb", "np", "ngl", "sm", "ts", "mg", "m", "mu", "hf",
        "hfr", "hff", "hfd", "hfrd", "a", "s", "fa", "ctk", "ctv", "dev", "ot", "cmoe",
        "ncmoe", "nkvo", "kvu", "md", "mm", "dt", "e", "nr", "j", "jf", "l", "r", "sp",
        "cb", "nocb", "lv", "v", "hft", "to", "ctkd", "ctvd", "ngld", "devd", "cd",
    }
)  # fmt: skip
# Environment-variable keys read as the argument they set (README: "(env: …)").
_ENV_ARGS: Final[dict[str, str]] = {
    "LLAMA_ARG_MODEL": "--model",
    "LLAMA_ARG_HF_REPO": "--hf-repo",
    "LLAMA_ARG_HF_FILE": "--hf-file",
    "LLAMA_ARG_CTX_SIZE": "--ctx-size",
    "LLAMA_ARG_N_PARALLEL": "--parallel",
    "LLAMA_ARG_N_GPU_LAYERS": "--n-gpu-layers",
    "LLAMA_ARG_PORT": "--port",
    "LLAMA_ARG_HOST": "--host",
}
_TRUE: Final = frozenset({"true", "on", "yes"})
_FALSE: Final = frozenset({"false", "off", "no"})


def parse_ini(text: str, source: str) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``(top-level keys, {section: {key: value}})``, in file order; a key given twice
    keeps its last value (the README's example sets ``model-draft`` twice)."""
    top: dict[str, str] = {}
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = top
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped[0] in ";#":
            continue
        match = re.fullmatch(r"\[(.+)\]", stripped)
        if match:
            current = sections.setdefault(match.group(1).strip(), {})
            continue
        key, eq, value = stripped.partition("=")
        if not eq or not key.strip():
            raise ImportSourceError(
                f"{source}:{number}: not `key = value` or `[section]`: {stripped!r}",
                source=source,
            )
        current[key.strip()] = value.strip().strip('"')
    return top, sections


def _argv(
    options: Mapping[str, str], where: str, report: ImportReport
) -> tuple[list[str], dict[str, str]]:
    argv: list[str] = ["llama-server"]
    env: dict[str, str] = {}
    for key, value in options.items():
        if re.fullmatch(r"[A-Z_][A-Z0-9_]*", key) and key not in _ENV_ARGS:
            env[key] = value  # an environment variable llama-server reads itself
            continue
        flag = _ENV_ARGS.get(key) or (("-" if key in SHORT_KEYS else "--") + key)
        lowered = value.lower()
        if lowered in _TRUE:
            argv.append(flag)
        elif lowered in _FALSE:
            report.add(
                f"{where}.{key}",
                "dropped",
                "false: the option is left out (the server's default; llama-server negates "
                "some flags with a no- prefix)",
            )
        else:
            argv += [flag, value]
    return argv, env


def import_presets(
    text: str,
    *,
    source: str = "models.ini",
    stack: str = "llama-router",
    binary: str | None = None,
    lister: Lister | None = None,
) -> ImportResult:
    """A presets file's text as a stack of ``llamacpp`` slots, with its report."""
    top, sections = parse_ini(text, source)
    report = ImportReport("llama-server-presets")
    for key, value in top.items():
        if key != "version":
            report.add(key, "dropped", "a key outside any section is not a documented preset key")
        elif value != "1":
            report.add(key, "needs-input", f"version {value!r}: the README documents version 1")
    shared = sections.pop(GLOBAL, {})
    doc = StackDoc(stack_name_of(stack))
    for name, own in sections.items():
        where = f"[{name}]"
        options: dict[str, str] = {**shared, **own}
        autoload = options.pop("load-on-startup", "false").lower() in _TRUE
        if "stop-timeout" in options:
            options.pop("stop-timeout")
            report.add(
                f"{where}.stop-timeout",
                "dropped",
                "the grace before a server is killed is the runtime's (SIGTERM, then "
                "SIGKILL), not a slot setting",
            )
        sources = {"model", "m", "hf", "hf-repo", "hfr", "LLAMA_ARG_MODEL", "LLAMA_ARG_HF_REPO"}
        if not sources & options.keys():
            if parse_hf(name) is None:
                report.add(
                    where,
                    "needs-input",
                    "no model or hf key, and the name is no user/model[:quant]",
                )
                continue
            options["hf-repo"] = name  # a cached model: the section names it
        argv, env = _argv(options, where, report)
        if binary:
            argv[0] = binary
        srv = import_server(argv, env=env, key=where, report=report, lister=lister, cmd_key=where)
        model_id = model_id_of(name, where, report)
        model: dict[str, Any] = {"id": model_id, **srv.model}
        slot: dict[str, Any] = {
            "name": slot_name_of(model_id, [s["name"] for s in doc.slots]),
            "provider": srv.provider,
            "model": {"default": model_id},
            **srv.slot,
            "autoload": autoload,
        }
        if srv.server:
            slot["server"] = srv.server
        doc.models.append(model)
        doc.slots.append(slot)
    return ImportResult(doc, report)
