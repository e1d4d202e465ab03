"""Located problems: what is wrong, where (file, line, slot, key) and how to fix it.

Pure. The loader and the guard produce lists of :class:`Problem`; the CLI prints them and
the API returns them inside a ``SlotConfigError``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import ValidationError

from controller.model.errors import NpuExclusivityViolation, SlotConfigError

__all__ = ["Problem", "problems_from_validation", "raise_for_problems", "redact_credentials"]

# ``scheme://user:password@host``: the part before the ``@`` is a secret (a source URL that
# carries one is refused; the refusal must not print it back).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def redact_credentials(value: Any) -> Any:
    """``value`` with a URL's ``user:password@`` shown as ``***@`` (strings only)."""
    if isinstance(value, str):
        return _USERINFO.sub(r"\g<scheme>***@", value)
    return value


Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Problem:
    code: str
    message: str
    file: str | None = None
    slot: str | None = None
    key: str | None = None
    line: int | None = None
    hint: str | None = None
    severity: Severity = "error"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["severity"]
        return data

    def where(self) -> str:
        """``file:line`` (or whatever part is known) for human output."""
        if self.file and self.line:
            return f"{self.file}:{self.line}"
        return self.file or "<payload>"


def format_key(loc: Sequence[str | int]) -> str:
    """``("server", "extra_args", 2)`` -> ``server.extra_args[2]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _hint_for(kind: str, loc: Sequence[str | int], fields: Iterable[str]) -> str | None:
    if kind == "extra_forbidden" and loc and isinstance(loc[-1], str):
        close = difflib.get_close_matches(loc[-1], list(fields), n=1)
        if close:
            return f"did you mean {close[0]!r}?"
        return "remove the key; see docs/stack-files.md for the schema"
    if kind == "missing":
        return f"add the required key {format_key(loc)!r}"
    return None


def problems_from_validation(
    exc: ValidationError,
    *,
    scope: str,
    fields: Iterable[str],
    file: str | None = None,
    slot: str | None = None,
    prefix: Sequence[str | int] = (),
) -> list[tuple[Problem, tuple[str | int, ...]]]:
    """Map pydantic errors to problems; returns each with its absolute location path."""
    fields = list(fields)
    out: list[tuple[Problem, tuple[str | int, ...]]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if isinstance(p, str | int))
        kind = err["type"]
        code = {
            "extra_forbidden": f"{scope}.unknown_key",
            "missing": f"{scope}.missing_key",
        }.get(kind, f"{scope}.invalid_value")
        key = format_key(loc)
        if kind == "extra_forbidden":
            message = f"unknown key {key!r}"
        elif kind == "missing":
            message = f"missing required key {key!r}"
        else:
            shown = redact_credentials(err.get("input"))
            message = f"{key or scope}: {err['msg']} (got {shown!r})"
        problem = Problem(
            code=code,
            message=message,
            file=file,
            slot=slot,
            key=key or None,
            hint=_hint_for(kind, loc, fields),
        )
        out.append((problem, (*prefix, *loc)))
    return out


def raise_for_problems(problems: Sequence[Problem], what: str = "slot config") -> None:
    """Raise the typed error for a list of problems (no-op when only warnings)."""
    errors = [p for p in problems if p.severity == "error"]
    if not errors:
        return
    keys = sorted({p.key for p in errors if p.key})
    first = errors[0]
    summary = first.message if len(errors) == 1 else f"{first.message} (+{len(errors) - 1} more)"
    cls = (
        NpuExclusivityViolation
        if all(p.code == "slot.npu_exclusive" for p in errors)
        else SlotConfigError
    )
    raise cls(
        f"invalid {what}: {summary}",
        keys=keys,
        problems=[p.to_dict() for p in errors],
    )
