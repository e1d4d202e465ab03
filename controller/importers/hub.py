"""llama-server's ``-hf user/model[:quant]`` as a slotctl source (``hf://org/repo/file``).

llama-server's README (``tools/server/README.md``, common params): ``-hf, -hfr,
--hf-repo <user>/<model>[:quant]`` — "quant is optional, case-insensitive, default to
Q4_K_M, or falls back to the first file in the repo if Q4_K_M doesn't exist"; ``-hff,
--hf-file FILE`` — "If specified, it will override the quant in --hf-repo". slotctl pulls
one named file, so a repository with a quant is resolved to its file against the
repository's listing, by that rule; without a listing (``slotctl import --offline``) the
file stays for the user to name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_QUANT", "HubRef", "Lister", "choose_file", "parse_hf"]

DEFAULT_QUANT: Final = "Q4_K_M"

# The files of a hub repository (its paths), or an exception when it cannot be listed.
Lister = Callable[[str], Sequence[str]]


@dataclass(frozen=True, slots=True)
class HubRef:
    repo: str  # user/model
    quant: str | None  # the :tag, as written
    file: str | None  # --hf-file


def parse_hf(value: str, file: str | None = None) -> HubRef | None:
    """``user/model[:quant]`` (and ``--hf-file``); None when it names no repository."""
    repo, _, quant = value.partition(":")
    parts = [p for p in repo.split("/") if p]
    if len(parts) != 2 or any(p in (".", "..") for p in parts):
        return None
    return HubRef("/".join(parts), quant or None, file or None)


def _ggufs(files: Sequence[str]) -> list[str]:
    """The model files a quant may name: ``.gguf``, not projectors (``mmproj*``)."""
    return [
        f
        for f in files
        if f.lower().endswith(".gguf") and not f.rsplit("/", 1)[-1].lower().startswith("mmproj")
    ]


def choose_file(ref: HubRef, files: Sequence[str]) -> str | None:
    """The file llama-server would load for ``ref`` among the repository's ``files``:
    ``--hf-file`` when given; else the first model file whose name holds the quant
    (case-insensitive; ``Q4_K_M`` by default); else, for the default quant only, the
    repository's first model file. A multi-part model resolves to its first part."""
    if ref.file:
        return ref.file
    candidates = sorted(_ggufs(files))
    tag = (ref.quant or DEFAULT_QUANT).lower()
    named = [f for f in candidates if tag in f.rsplit("/", 1)[-1].lower()]
    if named:
        firsts = [f for f in named if "-00001-of-" in f] or named
        return firsts[0]
    if ref.quant is None and candidates:
        return candidates[0]
    return None


def projector(files: Sequence[str]) -> str | None:
    """The repository's multimodal projector (``mmproj*.gguf``), which llama-server
    downloads with the model unless ``--no-mmproj``."""
    found = sorted(
        f
        for f in files
        if f.lower().endswith(".gguf") and f.rsplit("/", 1)[-1].lower().startswith("mmproj")
    )
    return found[0] if found else None
