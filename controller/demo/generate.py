"""Deterministic text and embeddings for the demo server (pure: no I/O, no clock).

Called by :mod:`controller.demo.server`. The same model and prompt always give the same
words and the same vector, so tests can compare responses across restarts. A "token" here
is one pseudo-word with its leading space; token counts are whitespace-separated words.
"""

from __future__ import annotations

import math

try:  # the same function as hashlib.blake2b, without loading OpenSSL for the other hashes
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - a Python built without _blake2
    from hashlib import blake2b

__all__ = ["count_tokens", "embedding", "embedding_base64", "pseudo_tokens"]

_SYLLABLES = (
    "ka", "lo", "mi", "ren", "to", "sa", "vel", "no",
    "qui", "dar", "el", "po", "fin", "ar", "su", "mo",
)  # fmt: skip


def _digest(*parts: str | int) -> bytes:
    hasher = blake2b(digest_size=32)
    for part in parts:
        hasher.update(str(part).encode())
        hasher.update(b"\x00")
    return hasher.digest()


def _word(seed: bytes, index: int) -> str:
    raw = _digest(seed.hex(), index)
    syllables = 1 + raw[0] % 3
    return "".join(_SYLLABLES[b % len(_SYLLABLES)] for b in raw[1 : 1 + syllables])


def pseudo_tokens(model: str, prompt: str, count: int) -> list[str]:
    """``count`` pseudo-words, each with a leading space, determined by model and prompt."""
    seed = _digest(model, prompt)
    return [" " + _word(seed, i) for i in range(count)]


def count_tokens(text: str) -> int:
    """The demo's token count of ``text``: its whitespace-separated words."""
    return len(text.split())


def embedding(model: str, text: str, dim: int) -> list[float]:
    """A unit-length vector of ``dim`` floats determined by model and text."""
    values: list[float] = []
    block = 0
    while len(values) < dim:
        raw = _digest(model, text, block)
        values.extend(int.from_bytes(raw[i : i + 4], "big") / 2**31 - 1.0 for i in range(0, 32, 4))
        block += 1
    values = values[:dim]
    norm = math.sqrt(sum(v * v for v in values))
    if norm == 0.0:  # every component exactly 0: practically impossible
        return [1.0] + [0.0] * (dim - 1)
    return [v / norm for v in values]


def embedding_base64(vector: list[float]) -> str:
    """``vector`` as OpenAI's ``encoding_format: "base64"``: little-endian float32 bytes."""
    import base64  # here, not at the top: only this rarely used format needs them
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
