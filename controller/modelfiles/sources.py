"""Where a model's bytes come from and where they land: a source as typed data.

Pure (no I/O). :func:`wanted` turns a catalogue model into a :class:`Wanted` — its
source (a hub file, a hub snapshot, a URL, a local path) and its destination in the models
dir — for :mod:`controller.modelfiles.pull`; :func:`destination` is the one mapping of a
source text to the path a server reads, which :func:`controller.providers.base.model_path`
shares, so a pull writes exactly where the server will look:

==============================  ============================================
``hf://org/repo/dir/f.gguf``    ``<models_dir>/org/repo/dir/f.gguf``
``hf://org/repo``               ``<models_dir>/org/repo`` (a directory)
``https://host/a/b.gguf?sig``   ``<models_dir>/_urls/host/a/b.gguf``
``file:///abs/f.gguf``          ``/abs/f.gguf``
``relative/f.gguf``             ``<models_dir>/relative/f.gguf``
==============================  ============================================

(``_urls`` can not be a hub organisation: hub names start with a letter or digit.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final
from urllib.parse import unquote, urlsplit

from controller.spec.schema import ModelSpec, hub_parts

__all__ = [
    "URLS_DIR",
    "HubFile",
    "HubSnapshot",
    "LocalFile",
    "Source",
    "UrlFile",
    "Wanted",
    "destination",
    "parse_source",
    "wanted",
]

URLS_DIR: Final = "_urls"


@dataclass(frozen=True, slots=True)
class HubFile:
    """One file of a hub repository (``hf://org/repo/path/in/repo``)."""

    repo: str  # org/repo
    filename: str  # the path in the repository
    revision: str | None = None  # None: the hub's default branch


@dataclass(frozen=True, slots=True)
class HubSnapshot:
    """A whole repository at one commit (``hf://org/repo``), filtered by patterns."""

    repo: str
    revision: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class UrlFile:
    """A file at an ``http(s)://`` URL (verified by the model's declared sha256)."""

    url: str


@dataclass(frozen=True, slots=True)
class LocalFile:
    """A path on this host: never pulled, verified when the model declares a sha256."""

    path: Path


Source = HubFile | HubSnapshot | UrlFile | LocalFile


@dataclass(frozen=True, slots=True)
class Wanted:
    """What one model needs on disk: its source, where it lands, and its pinned digest."""

    model: str
    text: str  # the source as written (what events and errors show)
    source: Source
    dest: Path  # the file, or for a snapshot the directory, a server reads
    sha256: str | None = None

    @property
    def pullable(self) -> bool:
        return not isinstance(self.source, LocalFile)

    @property
    def is_snapshot(self) -> bool:
        return isinstance(self.source, HubSnapshot)


def _safe_parts(parts: list[str], what: str) -> list[str]:
    if not parts or any(part in (".", "..") for part in parts):
        raise ValueError(f"{what}: a path with '.' or '..' segments can not be placed")
    return parts


def destination(text: str, models_dir: Path) -> Path:
    """The path a server reads for a source text (see the table above)."""
    if text.startswith("file://"):
        return Path(urlsplit(text).path)
    if text.startswith("hf://"):
        return models_dir.joinpath(*_safe_parts(hub_parts(text), text))
    scheme = urlsplit(text).scheme
    if scheme in ("http", "https"):
        parts = urlsplit(text)
        segments = [unquote(p) for p in PurePosixPath(parts.path).parts if p != "/"]
        host = (parts.hostname or "").lower()
        if parts.port is not None:
            host = f"{host}_{parts.port}"
        return models_dir.joinpath(URLS_DIR, *_safe_parts([host, *segments], text))
    path = Path(text)
    return path if path.is_absolute() else models_dir / path


def parse_source(model: ModelSpec, models_dir: Path) -> Source | None:
    """The typed source of a catalogue model; None for ``demo://`` and no source."""
    text = model.source
    if not text or text.startswith("demo://"):
        return None
    if text.startswith("hf://"):
        parts = hub_parts(text)
        repo = "/".join(parts[:2])
        if len(parts) == 2:
            return HubSnapshot(
                repo=repo,
                revision=model.revision,
                include=tuple(model.include or ()),
                exclude=tuple(model.exclude or ()),
            )
        return HubFile(repo=repo, filename="/".join(parts[2:]), revision=model.revision)
    if urlsplit(text).scheme in ("http", "https"):
        return UrlFile(url=text)
    return LocalFile(path=destination(text, models_dir))


def wanted(model: ModelSpec, models_dir: Path) -> Wanted | None:
    """What ``model`` needs on disk under ``models_dir``; None when it needs no file."""
    source = parse_source(model, models_dir)
    if source is None or not model.source:
        return None
    return Wanted(
        model=model.id,
        text=model.source,
        source=source,
        dest=destination(model.source, models_dir),
        sha256=model.sha256,
    )
