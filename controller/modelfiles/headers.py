"""Model file headers: what a GGUF file or a safetensors repository says of its size.

Reads only headers (a GGUF's key-value metadata and tensor infos; each ``.safetensors``
file's JSON header and ``config.json``), never the weights: a few hundred kilobytes of a
multi-gigabyte file. The layout is ggml's documented GGUF format (``docs/gguf.md``: magic
``GGUF``, version 2 or 3, tensor and key-value counts, typed values, tensor infos) and
safetensors' (an 8-byte little-endian header length, then JSON ``{name: {dtype, shape,
data_offsets}}``). The arithmetic over what is read is :mod:`controller.scheduling.footprint`'s.

:func:`read_model` answers by path (a ``.gguf`` file, or a directory holding safetensors
or one GGUF), remembering each file's answer by its size and modification time.
"""

from __future__ import annotations

import json
import re
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final

from controller.model.weights import GGML_TYPES, GgufModel, SafetensorsModel, tensor_bytes

__all__ = ["HeaderError", "read_gguf", "read_model", "read_safetensors"]

GGUF_MAGIC: Final = b"GGUF"
MAX_STRING: Final = 1 << 24  # 16 MiB: no key or value of a real header is longer
MAX_COUNT: Final = 1 << 26  # tensors, keys, array elements
_BLOCK_RE: Final = re.compile(r"^blk\.(\d+)\.")

# GGUF value types: id -> struct format (8 string, 9 array: read apart)
_SCALARS: Final[dict[int, str]] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
# safetensors dtypes: bytes per element
_ST_DTYPES: Final[dict[str, float]] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


class HeaderError(ValueError):
    """A file whose header cannot be read as GGUF or safetensors (what is wrong said)."""


class _Reader:
    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle

    def take(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise HeaderError("truncated header")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > MAX_STRING:
            raise HeaderError(f"a string of {n} bytes in the header")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int, keep: bool) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if count > MAX_COUNT:
                raise HeaderError(f"an array of {count} items in the header")
            if item in _SCALARS and not keep:  # skipped whole (a tokenizer's scores)
                self.handle.seek(count * struct.calcsize(_SCALARS[item]), 1)
                return count
            values = [self.value(item, keep) for _ in range(count)]
            return values if keep else count
        raise HeaderError(f"unknown GGUF value type {kind}")


def _wanted(key: str) -> bool:
    """Metadata kept as values (arrays of the tokenizer are only counted)."""
    return not key.startswith("tokenizer.") or key == "tokenizer.ggml.tokens"


def read_gguf(path: Path) -> GgufModel:
    """The size facts of a GGUF file (its header only)."""
    with open(path, "rb") as handle:
        r = _Reader(handle)
        if r.take(4) != GGUF_MAGIC:
            raise HeaderError(f"{path.name} is not a GGUF file (no GGUF magic)")
        version = r.scalar("<I")
        if version not in (2, 3):
            raise HeaderError(f"{path.name}: GGUF version {version} is not read (2 or 3)")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
            raise HeaderError(f"{path.name}: {n_tensors} tensors, {n_kv} keys")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            kind = r.scalar("<I")
            keep = _wanted(key)
            value = r.value(kind, keep)
            if key == "tokenizer.ggml.tokens":
                value = len(value) if isinstance(value, list) else value
            meta[key] = value
        tensors: list[tuple[str, int, int]] = []
        for _ in range(n_tensors):
            name = r.string()
            dims = r.scalar("<I")
            if dims > 8:
                raise HeaderError(f"{path.name}: tensor {name} has {dims} dimensions")
            elements = 1
            for _d in range(dims):
                elements *= r.scalar("<Q")
            kind = r.scalar("<I")
            r.scalar("<Q")  # offset
            if kind not in GGML_TYPES:
                raise HeaderError(f"{path.name}: tensor {name} has unknown type {kind}")
            tensors.append((name, kind, elements))
    return _gguf_model(meta, tensors, path.name)


def _gguf_model(meta: dict[str, Any], tensors: list[tuple[str, int, int]], name: str) -> GgufModel:
    arch = str(meta.get("general.architecture", ""))
    if not arch:
        raise HeaderError(f"{name}: no general.architecture in its header")

    def num(key: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):
            value = max(value) if value else default
        if value is None:
            raise HeaderError(f"{name}: no {arch}.{key} in its header")
        return int(value)

    n_layer = num("block_count")
    n_embd = num("embedding_length")
    n_head = num("attention.head_count", 0) or 1
    raw_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    heads_kv = (
        tuple(int(h) for h in raw_kv) if isinstance(raw_kv, list) else (int(raw_kv),) * n_layer
    )
    head_dim = n_embd // n_head
    layer = [0] * n_layer
    by_type: dict[str, int] = {}
    input_bytes = output_bytes = 0
    for tname, kind, elements in tensors:
        size = tensor_bytes(kind, elements)
        by_type[GGML_TYPES[kind][0]] = by_type.get(GGML_TYPES[kind][0], 0) + size
        match = _BLOCK_RE.match(tname)
        if match and int(match.group(1)) < n_layer:
            layer[int(match.group(1))] += size
        elif tname.startswith("token_embd."):
            input_bytes += size
        else:
            output_bytes += size
    vocab = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens") or 0
    return GgufModel(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=heads_kv or (n_head,),
        key_length=num("attention.key_length", head_dim),
        value_length=num("attention.value_length", head_dim),
        n_ff=num("feed_forward_length", 4 * n_embd),
        n_vocab=int(vocab),
        n_ctx_train=num("context_length", 4096),
        layer_bytes=tuple(layer),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        by_type=tuple(sorted(by_type.items(), key=lambda kv: -kv[1])),
    )


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise HeaderError(f"{path.name}: truncated safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 1024 * 1024:
            raise HeaderError(f"{path.name}: a safetensors header of {n} bytes")
        try:
            parsed = json.loads(handle.read(n))
        except ValueError as exc:
            raise HeaderError(f"{path.name}: its safetensors header is not JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise HeaderError(f"{path.name}: its safetensors header is not an object")
    return parsed


def read_safetensors(directory: Path) -> SafetensorsModel:
    """The size facts of a safetensors repository (its files' headers, ``config.json``)."""
    files = sorted(directory.rglob("*.safetensors"))
    if not files:
        raise HeaderError(f"{directory} holds no .safetensors file")
    by_type: dict[str, int] = {}
    total = 0
    for file in files:
        for tname, info in _safetensors_header(file).items():
            if tname == "__metadata__" or not isinstance(info, dict):
                continue
            start, end = info.get("data_offsets", (0, 0))
            size = int(end) - int(start)
            dtype = str(info.get("dtype", "?")).lower()
            by_type[dtype] = by_type.get(dtype, 0) + size
            total += size
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise HeaderError(f"{directory}: no readable config.json ({exc})") from exc
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n_layer = int(text.get("num_hidden_layers", 0))
    n_head = int(text.get("num_attention_heads", 1)) or 1
    n_head_kv = int(text.get("num_key_value_heads") or n_head)
    hidden = int(text.get("hidden_size", 0))
    head_dim = int(text.get("head_dim") or (hidden // n_head if hidden else 0))
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "float16")
    dtype_bytes = 4 if dtype == "float32" else 2
    max_pos = text.get("max_position_embeddings")
    return SafetensorsModel(
        weight_bytes=total,
        by_type=tuple(sorted(by_type.items(), key=lambda kv: -kv[1])),
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        max_position=int(max_pos) if max_pos else None,
        dtype_bytes=dtype_bytes,
    )


_cache: dict[tuple[str, int, int], GgufModel | SafetensorsModel] = {}
_lock = threading.Lock()


def read_model(path: Path) -> GgufModel | SafetensorsModel | None:
    """What the model at ``path`` says of its size: a ``.gguf`` file (or a directory with
    exactly one, the first of a split model), a safetensors repository; None when there is
    nothing to read (no such path, another format). Raises :class:`HeaderError` for a file
    that claims a format and breaks it. Remembered by (path, size, mtime)."""
    reader: Callable[[Path], GgufModel | SafetensorsModel]
    try:
        stat = path.stat()
    except OSError:
        return None
    target = path
    if path.is_dir():
        ggufs = sorted(path.rglob("*.gguf"))
        if any(path.rglob("*.safetensors")):
            reader = read_safetensors
        elif ggufs:
            target, reader = ggufs[0], read_gguf
            stat = target.stat()
        else:
            return None
    else:
        with open(path, "rb") as handle:
            if handle.read(4) != GGUF_MAGIC:
                return None
        reader = read_gguf
    key = (str(target), stat.st_size, stat.st_mtime_ns)
    with _lock:
        known = _cache.get(key)
    if known is not None:
        return known
    model = reader(target)
    with _lock:
        _cache[key] = model
    return model
