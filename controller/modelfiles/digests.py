"""What vouches for a file's bytes: a digest, its incremental hasher, and a file's hash.

Pure but for :func:`hash_file` (reads a file; call it in a thread). Two algorithms, the two
the hub vouches with: ``sha256`` (an LFS file's ``X-Linked-Etag``, a model's declared
``sha256``) and ``git-sha1`` (a small file kept in git: its ``ETag`` is the git blob hash,
sha1 over ``b"blob <size>\\0"`` and the bytes). Used by :mod:`controller.modelfiles.partial`
(hashing as bytes arrive), :mod:`controller.modelfiles.hub` (reading the hub's headers) and
:mod:`controller.modelfiles.pull` (verifying a file already on disk).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, Protocol

__all__ = [
    "HASH_BLOCK",
    "Digest",
    "Hasher",
    "digest_from_etag",
    "feed_file",
    "hash_file",
    "new_hasher",
]

Algorithm = Literal["sha256", "git-sha1"]
HASH_BLOCK: Final = 4 * 1024 * 1024  # bytes read per hash update from a file on disk
_SHA256: Final = re.compile(r"^[0-9a-f]{64}$")
_SHA1: Final = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True, slots=True)
class Digest:
    """An expected (or computed) digest: ``sha256:<hex>`` or ``git-sha1:<hex>``."""

    algorithm: Algorithm
    hex: str

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hex}"

    @classmethod
    def parse(cls, text: str) -> Digest:
        algorithm, _, value = text.partition(":")
        if algorithm == "sha256" and _SHA256.fullmatch(value):
            return cls("sha256", value)
        if algorithm == "git-sha1" and _SHA1.fullmatch(value):
            return cls("git-sha1", value)
        raise ValueError(f"not a digest: {text!r}")


def digest_from_etag(etag: str | None) -> Digest | None:
    """The digest a hub ETag names: 64 hex digits are an LFS file's sha256, 40 a git blob
    hash (huggingface_hub's own reading, ``REGEX_SHA256`` in ``file_download``); anything
    else (a CDN's opaque tag) vouches for nothing."""
    if not etag:
        return None
    value = etag.removeprefix("W/").strip('"').lower()
    if _SHA256.fullmatch(value):
        return Digest("sha256", value)
    if _SHA1.fullmatch(value):
        return Digest("git-sha1", value)
    return None


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: Algorithm, size: int | None) -> Hasher:
    """A hasher for ``algorithm``; a git blob hash needs the file's ``size`` up front."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if size is None:
        raise ValueError("a git blob hash needs the file's size")
    sha1 = hashlib.sha1(usedforsecurity=False)
    sha1.update(b"blob %d\0" % size)
    return sha1


def hash_file(path: Path, algorithm: Algorithm, *, limit: int | None = None) -> str:
    """The digest of ``path``'s bytes (its first ``limit`` bytes when given): blocking."""
    size = path.stat().st_size if limit is None else limit
    hasher = new_hasher(algorithm, size)
    feed_file(path, hasher, size)
    return hasher.hexdigest()


def feed_file(path: Path, hasher: Hasher, length: int) -> None:
    """Feed the first ``length`` bytes of ``path`` to ``hasher`` (blocking)."""
    buffer = bytearray(HASH_BLOCK)
    view = memoryview(buffer)
    left = length
    with path.open("rb", buffering=0) as f:
        while left > 0:
            n = f.readinto(view[: min(left, HASH_BLOCK)])
            if not n:
                raise OSError(f"{path} ended {left} bytes short")
            hasher.update(view[:n])
            left -= n
