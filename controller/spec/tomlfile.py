"""One TOML stack or config file read and parsed: plain data, a line index, or a located problem.

tomllib parses first (~10x cheaper than tomlkit: a config dir read parses every slot file
at every resync); what it refuses goes to tomlkit, so a syntax error reads as tomlkit
words it and nothing tomlkit accepts is refused. A file over :data:`MAX_FILE_BYTES` is
refused unparsed (``stack.too_large``); one nested beyond the parsers' recursion is refused
as ``stack.too_deep`` (it raised RecursionError: issue 40). Reads only.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import tomlkit

from controller.spec.locate import LineIndex
from controller.spec.problems import Problem

__all__ = ["MAX_FILE_BYTES", "Parsed", "parse_toml_file", "parse_toml_text"]

# One stack (or config) file is parsed whole, in a worker thread; beyond this size it is
# refused unparsed (``stack.too_large``) rather than occupying the controller for seconds.
MAX_FILE_BYTES = 1024 * 1024

Parsed = tuple[dict[str, Any] | None, LineIndex | None, list[Problem]]


def _too_large(name: str) -> Problem:
    return Problem(
        code="stack.too_large",
        message=f"larger than {MAX_FILE_BYTES // 1024} KiB: not parsed",
        file=name,
        hint="split it into several stack files (a directory of stack files is one state)",
    )


def _too_deep(name: str) -> Problem:
    return Problem(
        code="stack.too_deep",
        message="nested too deeply to parse (arrays or tables inside each other, "
        "thousands of levels): not parsed",
        file=name,
        hint="a stack file nests a few levels at most: this one is damaged or not a stack",
    )


def parse_toml_file(path: Path) -> Parsed:
    """A stack or config file; at most :data:`MAX_FILE_BYTES` are read (``stack.too_large``)."""
    name = str(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            return None, None, [_too_large(name)]
        # As read_text() would: universal newlines.
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except (OSError, UnicodeDecodeError) as exc:
        return None, None, [Problem(code="stack.unreadable", message=str(exc), file=name)]
    return parse_toml_text(text, name)


def parse_toml_text(text: str, name: str) -> Parsed:
    """TOML text -> plain data and a line index, or a located syntax problem."""
    if len(text) > MAX_FILE_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        return None, None, [_too_large(name)]
    try:
        # tomllib first: ~10x cheaper than tomlkit (a config dir read parses every slot
        # file, at every resync). A document it refuses goes to tomlkit as before, so a
        # syntax error reads the same and nothing tomlkit accepted is refused now.
        return tomllib.loads(text), LineIndex(text), []
    except tomllib.TOMLDecodeError as exc:
        refused = exc
    except RecursionError:  # both parsers recurse per level: a hostile file, refused once
        return None, None, [_too_deep(name)]
    try:
        doc = tomlkit.parse(text)
    except RecursionError:
        return None, None, [_too_deep(name)]
    except tomlkit.exceptions.TOMLKitError as exc:  # ParseError, KeyAlreadyPresent, ...
        # A key or table defined twice: tomlkit gives no line (<= 0.15.2) or the line where
        # it noticed, past the table (0.15.3); tomllib's is the offending statement's. Any
        # other error is tomlkit's, with its line (tomllib may have refused something
        # earlier that tomlkit accepts: its line would not be this error's).
        tomlkit_line = getattr(exc, "line", None)
        line = tomlkit_line
        if tomlkit_line is None or _TOMLLIB_REDEFINED.match(str(refused)):
            line = _tomllib_line(refused) or tomlkit_line
        said = str(exc)
        if getattr(exc, "line", line) != line:  # one line named, not two
            said = _TOMLKIT_AT.sub("", said)
        problem = Problem(
            code="stack.toml_syntax",
            message=f"TOML syntax error: {said}",
            file=name,
            line=line,
            hint="fix the TOML syntax at the line shown",
        )
        return None, None, [problem]
    return doc.unwrap(), LineIndex(text), []


_TOMLLIB_LINE = re.compile(r"\(at line (\d+), column \d+\)")
_TOMLKIT_AT = re.compile(r" at line \d+ col \d+$")
_TOMLLIB_REDEFINED = re.compile(
    r"Cannot (overwrite a value|declare .* twice|redefine namespace|mutate immutable namespace)"
)


def _tomllib_line(exc: tomllib.TOMLDecodeError) -> int | None:
    """The line tomllib names in its error ("... (at line 5, column 3)")."""
    match = _TOMLLIB_LINE.search(str(exc))
    return int(match.group(1)) if match else None
