"""llama-swap's macros, expanded as llama-swap v250 expands them
(``internal/config/macros.go``, ``config.example.yaml``'s ``macros`` section).

- ``${env.VAR}`` first, everywhere: the variable's value (an unset one is reported
  ``needs-input`` and left as written, where llama-swap would refuse to start: the import
  may run on another machine than the server);
- the global ``macros`` (an ordered mapping of scalars) in every top-level value, then in
  each model its effective list: ``MODEL_ID`` first, the globals, the model's own
  ``macros`` overriding a global of the same name in place or appended. A list is applied
  from its last entry to its first, so a macro may use any declared before it (nested
  macros); a string that is exactly ``${name}`` takes the macro's typed value;
- ``${PORT}`` last, only in a model whose ``cmd`` uses it: slotctl chooses the port, so it
  becomes :data:`~controller.importers.servers.PORT_TOKEN`; a ``proxy`` without one is
  ``http://localhost:${PORT}`` (llama-swap's default);
- ``${PID}`` survives in ``cmdStop`` only; any other ``${name}`` left is an error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from controller.importers.report import ImportReport
from controller.importers.servers import PORT_TOKEN
from controller.model.errors import ImportSourceError

__all__ = ["DEFAULT_PROXY", "expand_config"]

DEFAULT_PROXY: Final = "http://localhost:${PORT}"
_NAME_RE: Final = re.compile(r"^[a-zA-Z0-9_-]+$")
_USE_RE: Final = re.compile(r"\$\{([a-zA-Z0-9_-]+)\}")
_ENV_RE: Final = re.compile(r"\$\{env\.([a-zA-Z_][a-zA-Z0-9_]*)\}")
_RESERVED: Final = frozenset({"PID", "PORT", "MODEL_ID"})

Macros = list[tuple[str, Any]]


def _declared(raw: object, where: str) -> Macros:
    if raw is None:
        return []
    if not isinstance(raw, Mapping):
        raise ImportSourceError(f"{where}: macros must be a mapping", key=where)
    out: Macros = []
    for name, value in raw.items():
        name = str(name)
        if len(name) >= 64 or not _NAME_RE.fullmatch(name):
            raise ImportSourceError(
                f"{where}: macro name {name!r} must match ^[a-zA-Z0-9_-]+$ (under 64 chars)",
                key=f"{where}.{name}",
            )
        if name in _RESERVED:
            raise ImportSourceError(f"{where}: macro name {name!r} is reserved", key=where)
        if not isinstance(value, str | int | float | bool):
            raise ImportSourceError(
                f"{where}.{name}: a macro is a string, number or boolean", key=f"{where}.{name}"
            )
        if isinstance(value, str) and "${" + name + "}" in value:
            raise ImportSourceError(f"{where}.{name}: a macro may not use itself", key=where)
        out.append((name, value))
    return out


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # Go's %v of a bool
    return str(value)


def substitute(value: Any, name: str, macro: Any) -> Any:
    slug = "${" + name + "}"
    if isinstance(value, str):
        if value == slug:
            return macro
        return value.replace(slug, _text(macro)) if slug in value else value
    if isinstance(value, Mapping):
        return {k: substitute(v, name, macro) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, name, macro) for v in value]
    return value


def _apply(value: Any, macros: Macros) -> Any:
    for name, macro in reversed(macros):
        value = substitute(value, name, macro)
    return value


def _env(value: Any, env: Mapping[str, str], where: str, report: ImportReport) -> Any:
    if isinstance(value, str):

        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in env:
                return env[name]
            report.add(
                where,
                "needs-input",
                f"${{env.{name}}} is not set here: left as written (set it and import again)",
            )
            return match.group(0)

        return _ENV_RE.sub(one, value)
    if isinstance(value, Mapping):
        return {k: _env(v, env, f"{where}.{k}", report) for k, v in value.items()}
    if isinstance(value, list):
        return [_env(v, env, f"{where}[{i}]", report) for i, v in enumerate(value)]
    return value


def _merge(model_id: str, global_: Macros, own: Macros) -> Macros:
    merged: Macros = [("MODEL_ID", model_id), *global_]
    for name, value in own:
        at = next((i for i, (n, _) in enumerate(merged) if n == name), None)
        if at is None:
            merged.append((name, value))
        else:
            merged[at] = (name, value)
    return merged


def _strip_comments(model: dict[str, Any]) -> None:
    for field in ("cmd", "cmdStop"):
        value = model.get(field)
        if isinstance(value, str):
            lines = [ln for ln in value.split("\n") if not ln.strip().startswith("#")]
            model[field] = "\n".join(lines)


def _leftover(value: Any, where: str, *, allow_pid: bool = False) -> None:
    if isinstance(value, str):
        for name in _USE_RE.findall(value):
            if not (allow_pid and name == "PID"):
                raise ImportSourceError(
                    f"{where}: unknown macro ${{{name}}} (declare it under macros before use)",
                    key=where,
                )
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _leftover(v, f"{where}.{k}", allow_pid=allow_pid)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _leftover(v, f"{where}[{i}]", allow_pid=allow_pid)


def expand_config(
    raw: Mapping[str, Any], env: Mapping[str, str], report: ImportReport
) -> dict[str, Any]:
    """The parsed ``config.yaml`` with every macro expanded (the ``macros`` keys gone)."""
    data: dict[str, Any] = _env(dict(raw), env, "", report)
    data = {k: v for k, v in data.items()}
    global_ = _declared(data.pop("macros", None), "macros")
    models = data.get("models")
    models = dict(models) if isinstance(models, Mapping) else {}
    own: dict[str, Macros] = {}
    for model_id, body in models.items():
        if isinstance(body, Mapping):
            body = dict(body)
            own[str(model_id)] = _declared(body.pop("macros", None), f"models.{model_id}.macros")
            _strip_comments(body)
            if body.get("proxy") is None:
                body["proxy"] = DEFAULT_PROXY
            models[model_id] = body
    out = {k: (v if k == "models" else _apply(v, global_)) for k, v in data.items()}
    expanded: dict[str, Any] = {}
    for model_id, body in models.items():
        if not isinstance(body, Mapping):
            expanded[str(model_id)] = body
            continue
        body = _apply(dict(body), _merge(str(model_id), global_, own.get(str(model_id), [])))
        cmd = body.get("cmd") if isinstance(body.get("cmd"), str) else ""
        proxy = body.get("proxy") if isinstance(body.get("proxy"), str) else ""
        if "${PORT}" in cmd:
            body = substitute(body, "PORT", PORT_TOKEN)
        elif "${PORT}" in proxy:
            if proxy == DEFAULT_PROXY:
                body["proxy"] = None  # the default, for a command that takes no port
            else:
                raise ImportSourceError(
                    f"models.{model_id}.proxy uses ${{PORT}} but cmd does not: ${{PORT}} is "
                    "only available when used in cmd",
                    key=f"models.{model_id}.proxy",
                )
        for field, value in body.items():
            if field in ("metadata", "filters"):
                continue  # dropped whole (reported); a macro there stops nothing
            _leftover(value, f"models.{model_id}.{field}", allow_pid=field == "cmdStop")
        expanded[str(model_id)] = body
    if "models" in data:
        out["models"] = expanded
    return out
