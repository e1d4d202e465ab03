"""Command line of the demo server: its flags, their validation, and :class:`DemoConfig`.

Called by :func:`controller.demo.server.main`. The ``demo`` provider builds
``--host/--port/--model`` and appends a slot's ``server.extra_args`` (the knobs below), so
this parser is the contract between slot TOML files and the demo server. Bad arguments
are refused by argparse with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence

__all__ = ["DemoConfig", "build_parser", "parse_args"]

MAX_EMBEDDING_DIM = 65536

_DESCRIPTION = """\
slotctl's demo model server: a small OpenAI-compatible server (GET /v1/models,
POST /v1/completions, POST /v1/chat/completions with "stream": true, POST /v1/embeddings,
GET /health) that generates deterministic pseudo-words, with knobs for load time, memory
held and injected faults."""

_EPILOG = """\
output (stdout, one line each, flushed):
  slotctl-demo listening host=H port=P model=ID pid=N   when the socket is bound
  slotctl-demo ready model=ID port=P t=UNIX_TIME        when the model is listed
  slotctl-demo asleep level=N model=ID                  when it falls asleep (sleep mode)
  slotctl-demo awake model=ID t=UNIX_TIME               when a wake restored everything
While loading, GET /v1/models, GET /health and the inference
endpoints answer 503. Without --slow-stop, SIGTERM and SIGINT stop it gracefully.

exit status: 0 after SIGTERM/SIGINT, 1 when loading fails or the port cannot be bound,
2 for bad arguments, 3 for the crash injected by --crash-after."""


MAX_TOKENS_LIMIT = 8192  # the most tokens one request may ask for (400 beyond)


class DemoConfig:
    """Everything the demo server is told at start; the server never changes it.

    A plain class, not a dataclass: ``dataclasses`` imports ``inspect``, which costs the
    demo server a sixth of its start (see docs/performance.md).
    """

    __slots__ = (
        "crash_after",
        "embedding_dim",
        "empty_models",
        "enable_sleep_mode",
        "fail_on_load",
        "fail_wake",
        "hang_after",
        "hang_on_load",
        "host",
        "load_seconds",
        "load_until",
        "lora_load_seconds",
        "max_loras",
        "memory_mb",
        "model",
        "port",
        "prefix_cache",
        "reload_seconds",
        "sampling",
        "sleep_memory_mb",
        "slow_stop",
        "tokens_per_second",
        "wake_seconds",
    )

    def __init__(
        self,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        load_seconds: float = 0.0,
        load_until: str | None = None,
        tokens_per_second: float = 0.0,
        embedding_dim: int = 16,
        memory_mb: int = 0,
        fail_on_load: bool = False,
        hang_on_load: bool = False,
        empty_models: bool = False,
        crash_after: int = 0,
        hang_after: int = 0,
        slow_stop: float = 0.0,
        enable_sleep_mode: bool = False,
        wake_seconds: float = 0.0,
        reload_seconds: float = 0.0,
        sleep_memory_mb: int | None = None,
        fail_wake: bool = False,
        max_loras: int = 0,
        lora_load_seconds: float = 0.0,
        prefix_cache: int = 0,
        sampling: dict[str, object] | None = None,
    ) -> None:
        self.model = model
        self.host = host
        self.port = port
        self.load_seconds = load_seconds
        self.load_until = load_until  # a gate: loading ends once this path exists
        self.tokens_per_second = tokens_per_second
        self.embedding_dim = embedding_dim
        self.memory_mb = memory_mb
        self.fail_on_load = fail_on_load
        self.hang_on_load = hang_on_load
        self.empty_models = empty_models
        self.crash_after = crash_after
        self.hang_after = hang_after
        self.slow_stop = slow_stop
        self.enable_sleep_mode = enable_sleep_mode
        self.wake_seconds = wake_seconds
        self.reload_seconds = reload_seconds
        # host RAM held asleep at level 1 (the weights moved off the device): --memory-mb
        self.sleep_memory_mb = memory_mb if sleep_memory_mb is None else sleep_memory_mb
        self.fail_wake = fail_wake
        self.max_loras = max_loras  # 0: no adapter API (as vLLM without --enable-lora)
        self.lora_load_seconds = lora_load_seconds
        self.prefix_cache = prefix_cache  # sequences the prefix cache holds (0: none)
        # a request's sampling defaults (--sampling): max_tokens applied, all reported
        self.sampling = dict(sampling or {})

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"DemoConfig({fields})"


def _float_at_least(low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low:g}: {text!r}")
        return value

    return parse


def _sampling(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    tokens = value.get("max_tokens")
    if tokens is not None and (
        isinstance(tokens, bool)
        or not isinstance(tokens, int)
        or not 0 <= tokens <= MAX_TOKENS_LIMIT
    ):
        raise argparse.ArgumentTypeError(
            f"max_tokens must be an integer from 0 to {MAX_TOKENS_LIMIT}: {tokens!r}"
        )
    return value


def _int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}: {text!r}")
        return value

    return parse


def _model_id(text: str) -> str:
    if not text.strip() or any(ch.isspace() for ch in text):
        raise argparse.ArgumentTypeError(f"model id must be non-empty, without spaces: {text!r}")
    return text


def _add_serving_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=_int_between(0, 65535), required=True, help="TCP port; 0 picks a free one"
    )
    parser.add_argument("--model", type=_model_id, required=True, help="model id to serve")
    parser.add_argument(
        "--load-seconds",
        type=_float_at_least(0),
        default=0.0,
        metavar="S",
        help="time to load the model; answers 503 meanwhile (default: 0)",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=_float_at_least(0),
        default=0.0,
        metavar="R",
        help="generation speed; 0 = as fast as possible (default: 0)",
    )
    parser.add_argument(
        "--embedding-dim",
        type=_int_between(1, MAX_EMBEDDING_DIM),
        default=16,
        metavar="D",
        help="length of embedding vectors (default: %(default)s)",
    )
    parser.add_argument(
        "--memory-mb",
        type=_int_between(0, 1 << 20),
        default=0,
        metavar="N",
        help="allocate and touch N MiB at load, so the process really holds it (default: 0)",
    )
    parser.add_argument(
        "--sampling",
        type=_sampling,
        default={},
        metavar="JSON",
        help="a request's sampling defaults, a JSON object (slotctl passes a model's "
        "temperature, top_p, ... max_tokens): max_tokens is applied where a request "
        "sets none, and all are reported at GET /props as llama-server's "
        "default_generation_settings",
    )
    parser.add_argument(
        "--prefix-cache",
        type=_int_between(0, 4096),
        default=0,
        metavar="N",
        help="model a prefix cache of the last N sequences served and report the cached "
        "prompt tokens (usage.prompt_tokens_details.cached_tokens, timings.cache_n); "
        "0 = none (default: 0)",
    )


def _add_fault_flags(parser: argparse.ArgumentParser) -> None:
    faults = parser.add_argument_group("fault injection")
    outcome = faults.add_mutually_exclusive_group()
    outcome.add_argument(
        "--fail-on-load",
        action="store_true",
        help="print an error to stderr and exit 1 when loading would finish",
    )
    outcome.add_argument(
        "--hang-on-load",
        action="store_true",
        help="never finish loading: the model list stays empty forever",
    )
    outcome.add_argument(
        "--empty-models",
        action="store_true",
        help="finish loading but list no model (like a server started without one)",
    )
    faults.add_argument(
        "--load-until",
        metavar="PATH",
        default=None,
        help="keep loading (answering 503) until PATH exists, after --load-seconds: a "
        "test holds a server in warming until it has looked, then lets it finish",
    )
    faults.add_argument(
        "--crash-after",
        type=_int_between(0, 1 << 31),
        default=0,
        metavar="N",
        help="serve N inference requests, then exit abruptly (status 3) when the next "
        "one arrives; 0 = never (default: 0)",
    )
    faults.add_argument(
        "--hang-after",
        type=_int_between(0, 1 << 31),
        default=0,
        metavar="N",
        help="serve N inference requests, then hang when the next one arrives: from then "
        "on no request gets another byte (that one, every stream in flight, every later "
        "request, /health included), as a wedged GPU server; SIGTERM still stops it; "
        "0 = never (default: 0)",
    )
    faults.add_argument(
        "--slow-stop",
        type=_float_at_least(0),
        default=0.0,
        metavar="S",
        help="on SIGTERM keep serving for S seconds before exiting; SIGINT and SIGKILL "
        "still stop it at once (default: 0)",
    )


def _add_sleep_flags(parser: argparse.ArgumentParser) -> None:
    sleep = parser.add_argument_group(
        "sleep mode",
        "vLLM's dev-mode API: POST /sleep?level=1|2, POST /wake_up[?tags=...],\n"
        "POST /collective_rpc, GET /is_sleeping",
    )
    sleep.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="serve the sleep endpoints (as vLLM's --enable-sleep-mode with "
        "VLLM_SERVER_DEV_MODE=1); asleep, inference answers 503",
    )
    sleep.add_argument(
        "--wake-seconds",
        type=_float_at_least(0),
        default=0.0,
        metavar="S",
        help="a POST /wake_up takes S seconds (default: 0)",
    )
    sleep.add_argument(
        "--reload-seconds",
        type=_float_at_least(0),
        default=0.0,
        metavar="S",
        help="reloading the weights after a level-2 sleep (collective_rpc reload_weights) "
        "takes S seconds (default: 0)",
    )
    sleep.add_argument(
        "--sleep-memory-mb",
        type=_int_between(0, 1 << 20),
        default=None,
        metavar="N",
        help="host RAM held asleep at level 1, allocated and touched (the weights moved off "
        "the device; --memory-mb is released meanwhile); default: --memory-mb",
    )
    sleep.add_argument(
        "--fail-wake",
        action="store_true",
        help="every POST /wake_up fails (HTTP 500) after --wake-seconds: the server stays asleep",
    )


def _add_lora_flags(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group(
        "LoRA adapters",
        "vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (served only with\n"
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING set, as vLLM's), SGLang's POST /load_lora_adapter\n"
        "and /unload_lora_adapter; a request names an adapter in `model` (or base:adapter)",
    )
    lora.add_argument(
        "--max-loras",
        type=_int_between(0, 256),
        default=0,
        metavar="N",
        help="hold up to N adapters at once (as vLLM's --enable-lora --max-loras N); a load "
        "beyond them is refused (400). Default 0: no adapter API",
    )
    lora.add_argument(
        "--lora-load-seconds",
        type=_float_at_least(0),
        default=0.0,
        metavar="S",
        help="an adapter load takes S seconds (default: 0)",
    )


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter, sized without importing ``shutil`` (a few ms of every start)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=max(_columns(), 40) - 2)


def _columns() -> int:
    """The terminal width as ``shutil.get_terminal_size`` finds it: $COLUMNS, tty, 80."""
    text = os.environ.get("COLUMNS", "")
    if text.isdigit() and int(text) > 0:
        return int(text)
    try:
        return os.get_terminal_size(1).columns or 80
    except OSError:
        return 80


def build_parser() -> argparse.ArgumentParser:
    """The demo server's argument parser (``python -m controller.demo --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m controller.demo",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    _add_serving_flags(parser)
    _add_fault_flags(parser)
    _add_sleep_flags(parser)
    _add_lora_flags(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> DemoConfig:
    """Parse a command line into a :class:`DemoConfig`; argparse exits 2 on bad input."""
    ns = build_parser().parse_args(argv)
    return DemoConfig(
        model=ns.model,
        host=ns.host,
        port=ns.port,
        load_seconds=ns.load_seconds,
        load_until=ns.load_until,
        tokens_per_second=ns.tokens_per_second,
        embedding_dim=ns.embedding_dim,
        memory_mb=ns.memory_mb,
        fail_on_load=ns.fail_on_load,
        hang_on_load=ns.hang_on_load,
        empty_models=ns.empty_models,
        crash_after=ns.crash_after,
        hang_after=ns.hang_after,
        slow_stop=ns.slow_stop,
        enable_sleep_mode=ns.enable_sleep_mode,
        wake_seconds=ns.wake_seconds,
        reload_seconds=ns.reload_seconds,
        sleep_memory_mb=ns.sleep_memory_mb,
        fail_wake=ns.fail_wake,
        max_loras=ns.max_loras,
        lora_load_seconds=ns.lora_load_seconds,
        prefix_cache=ns.prefix_cache,
        sampling=ns.sampling,
    )
