"""The demo server process: bind, load (slowly, failing or hanging on request), serve, stop.

Run by ``python -m controller.demo`` (see :mod:`controller.demo`); the ``demo`` provider
starts it as a slot's child process and tests start it directly. The order of events is
what a real model server does, so the controller's probes meet the same phases:

1. bind the socket and print ``slotctl-demo listening ...``: connections are accepted,
   ``/v1/models`` lists nothing, ``/health`` and inference answer 503;
2. load: hold ``--memory-mb`` (allocated and touched), wait ``--load-seconds``, then
   fail (``--fail-on-load``: exit 1), hang forever (``--hang-on-load``) or finish;
3. list the model and print ``slotctl-demo ready model=ID port=P t=UNIX_TIME``, where
   ``t`` is taken just before the model becomes visible (``--empty-models``: loaded, but
   nothing listed and no ready line);
4. on SIGTERM or SIGINT stop gracefully with status 0 (``--slow-stop S``: SIGTERM is
   ignored for S seconds first).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Sequence

from aiohttp import web

from controller.demo.api import ROUTES, STATE, DemoState, openai_errors
from controller.demo.config import DemoConfig, parse_args

__all__ = ["LoadError", "build_app", "hold_memory", "main", "serve"]

MIB = 1 << 20
PAGE_SIZE = 4096
# After a stop signal aiohttp gives in-flight requests this long to finish, then cancels
# them and waits as long again: a stop takes at most ~1 s even mid-stream.
SHUTDOWN_TIMEOUT_S = 0.5


class LoadError(Exception):
    """The (injected) model load failed; the process exits 1 with this message."""


def _say(line: str) -> None:
    print(line, flush=True)


def _complain(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_app(state: DemoState) -> web.Application:
    """The aiohttp application serving ``state``."""
    app = web.Application(middlewares=[openai_errors])
    app[STATE] = state
    app.add_routes(ROUTES)
    return app


def hold_memory(mb: int) -> bytearray:
    """Allocate ``mb`` MiB and write one byte per page, so it is resident, not just reserved."""
    buffer = bytearray(mb * MIB)
    pages = len(range(0, len(buffer), PAGE_SIZE))
    buffer[::PAGE_SIZE] = b"\x01" * pages
    return buffer


async def load(state: DemoState, port: int) -> None:
    """Play the load phase; raises :class:`LoadError` for ``--fail-on-load``."""
    config = state.config
    loop = asyncio.get_running_loop()
    started = loop.time()
    if config.memory_mb:
        state.ballast = await asyncio.to_thread(hold_memory, config.memory_mb)
    await asyncio.sleep(max(0.0, config.load_seconds - (loop.time() - started)))
    if config.fail_on_load:
        raise LoadError(f"failed to load model {config.model}: injected failure (--fail-on-load)")
    if config.hang_on_load:
        _complain(f"slotctl-demo hanging while loading model {config.model} (--hang-on-load)")
        await asyncio.Event().wait()  # nothing ever sets it
    ready_at = time.time()  # before the flip, so no client can see the model earlier
    state.loaded = True
    if config.empty_models:
        _say(f"slotctl-demo loaded without a model port={port} (--empty-models)")
    else:
        _say(f"slotctl-demo ready model={config.model} port={port} t={ready_at:.6f}")


def install_stop_signals(stop: asyncio.Event, slow_stop: float) -> None:
    """SIGINT sets ``stop``; SIGTERM too, after ``slow_stop`` seconds when that is > 0."""
    loop = asyncio.get_running_loop()
    pending: list[asyncio.TimerHandle] = []

    def on_sigterm() -> None:
        if slow_stop <= 0:
            stop.set()
        elif not pending:
            _complain(f"slotctl-demo got SIGTERM; stopping in {slow_stop:g} s (--slow-stop)")
            pending.append(loop.call_later(slow_stop, stop.set))

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    loop.add_signal_handler(signal.SIGINT, stop.set)


async def _listen(runner: web.AppRunner, config: DemoConfig) -> int:
    """Bind ``config.host:config.port``; returns the bound port (for ``--port 0``)."""
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port: int = runner.addresses[0][1]
    _say(
        f"slotctl-demo listening host={config.host} port={port} "
        f"model={config.model} pid={os.getpid()}"
    )
    return port


async def _run_until_stopped(state: DemoState, port: int, stop: asyncio.Event) -> int:
    """Load, then serve until ``stop``; the exit status (1 when loading failed)."""
    loader = asyncio.create_task(load(state, port))
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if loader in done:
            loader.result()  # raises LoadError
            await stopper
        return 0
    except LoadError as err:
        _complain(f"error: {err}")
        return 1
    finally:
        for task in (loader, stopper):
            task.cancel()
        await asyncio.gather(loader, stopper, return_exceptions=True)


async def serve(config: DemoConfig) -> int:
    """Run the demo server until a stop signal or a failed load; the exit status."""
    stop = asyncio.Event()
    install_stop_signals(stop, config.slow_stop)
    runner = web.AppRunner(
        build_app(DemoState(config)), shutdown_timeout=SHUTDOWN_TIMEOUT_S, access_log=None
    )
    await runner.setup()
    try:
        port = await _listen(runner, config)
    except OSError as err:
        _complain(f"error: cannot listen on {config.host}:{config.port}: {err}")
        await runner.cleanup()
        return 1
    try:
        return await _run_until_stopped(runner.app[STATE], port, stop)
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m controller.demo``; returns the exit status."""
    return asyncio.run(serve(parse_args(argv)))
