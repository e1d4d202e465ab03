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

Threads, not asyncio: the main thread waits in a selector on the listening sockets and a
wake-up socket (signals arrive there through :func:`signal.set_wakeup_fd`, the load thread
reports its end there); each connection gets a daemon thread (:mod:`controller.demo.httpd`);
the load runs on a thread of its own. No event loop keeps the start cheap (see
docs/performance.md, "Demo server start").
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

from controller.demo.api import DemoState, build_app
from controller.demo.config import DemoConfig, parse_args
from controller.demo.httpd import App, Tracker, listen, serve_connection
from controller.demo.lora import lora_routes
from controller.demo.sleep import SLEEP_ROUTES, hold_memory

__all__ = ["LoadError", "build_app", "hold_memory", "main", "serve"]

# After a stop signal in-flight requests get this long to finish; then the process exits
# and their connections drop: a stop takes at most ~0.5 s even mid-stream.
SHUTDOWN_TIMEOUT_S = 0.5
LOAD_ENDED = 0  # the byte the load thread writes on the wake-up socket (no signal is 0)


class LoadError(Exception):
    """The (injected) model load failed; the process exits 1 with this message."""


def _say(line: str) -> None:
    print(line, flush=True)


def _complain(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load(state: DemoState, port: int, stopped: threading.Event) -> None:
    """Play the load phase (on its own thread); raises :class:`LoadError` for ``--fail-on-load``.

    Returns without flipping ``loaded`` when the server stops first or hangs on purpose.
    """
    config = state.config
    started = time.monotonic()
    if config.memory_mb:
        state.ballast = hold_memory(config.memory_mb)
    if stopped.wait(max(0.0, config.load_seconds - (time.monotonic() - started))):
        return
    gate = config.load_until  # a test's gate: loading ends once it exists
    while gate and not os.path.exists(gate):  # noqa: PTH110 (pathlib: a slower start)
        if stopped.wait(0.02):
            return
    if config.fail_on_load:
        raise LoadError(f"failed to load model {config.model}: injected failure (--fail-on-load)")
    if config.hang_on_load:
        _complain(f"slotctl-demo hanging while loading model {config.model} (--hang-on-load)")
        return  # never loaded; SIGTERM still stops the server
    ready_at = time.time()  # before the flip, so no client can see the model earlier
    state.loaded = True
    if config.empty_models:
        _say(f"slotctl-demo loaded without a model port={port} (--empty-models)")
    else:
        _say(f"slotctl-demo ready model={config.model} port={port} t={ready_at:.6f}")


class _Loader(threading.Thread):
    """Runs :func:`load`, keeps its :class:`LoadError`, and wakes the main thread."""

    def __init__(self, state: DemoState, port: int, wake: socket.socket) -> None:
        super().__init__(name="load", daemon=True)
        self.state, self.port, self.wake = state, port, wake
        self.stopped = threading.Event()
        self.error: LoadError | None = None

    def run(self) -> None:
        try:
            load(self.state, self.port, self.stopped)
        except LoadError as err:
            self.error = err
            self.wake.send(bytes([LOAD_ENDED]))


def install_stop_signals(wake: socket.socket) -> None:
    """SIGTERM and SIGINT write their number on ``wake`` (the main loop reads them)."""
    signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _noted)


def _noted(signum: int, frame: object) -> None:
    """The Python-level handler: nothing to do, the wake-up fd carries the signal."""


class _Stopper:
    """Turns signals into a stop: SIGINT at once, SIGTERM after ``slow_stop`` seconds."""

    def __init__(self, slow_stop: float) -> None:
        self.slow_stop = slow_stop
        self.deadline: float | None = None  # monotonic time of a pending slow stop
        self.now = False

    def signal(self, signum: int) -> None:
        if signum == signal.SIGINT or (signum == signal.SIGTERM and self.slow_stop <= 0):
            self.now = True
        elif signum == signal.SIGTERM and self.deadline is None:
            _complain(f"slotctl-demo got SIGTERM; stopping in {self.slow_stop:g} s (--slow-stop)")
            self.deadline = time.monotonic() + self.slow_stop

    def timeout(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def due(self) -> bool:
        return self.now or (self.deadline is not None and time.monotonic() >= self.deadline)


def _accept(listener: socket.socket, app: App, tracker: Tracker) -> None:
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
        return  # another wake-up took it, or the client gave up already
    conn.setblocking(True)
    threading.Thread(target=serve_connection, args=(conn, app, tracker), daemon=True).start()


def _run_until_stopped(
    listeners: list[socket.socket],
    app: App,
    loader: _Loader,
    stopper: _Stopper,
    wake: socket.socket,
) -> int:
    """Serve until a stop is due (0) or the load failed (1)."""
    tracker = Tracker()
    with selectors.DefaultSelector() as selector:
        selector.register(wake, selectors.EVENT_READ)
        for listener in listeners:
            selector.register(listener, selectors.EVENT_READ)
        try:
            while not stopper.due():
                for key, _ in selector.select(stopper.timeout()):
                    if key.fileobj is wake:
                        for signum in wake.recv(64):
                            stopper.signal(signum)
                    else:
                        assert isinstance(key.fileobj, socket.socket)
                        _accept(key.fileobj, app, tracker)
                if loader.error is not None:
                    _complain(f"error: {loader.error}")
                    return 1
            return 0
        finally:
            loader.stopped.set()
            for listener in listeners:
                listener.close()
            tracker.drain(SHUTDOWN_TIMEOUT_S)


def serve(config: DemoConfig) -> int:
    """Run the demo server until a stop signal or a failed load; the exit status."""
    wake, waker = socket.socketpair()
    wake.setblocking(False)
    waker.setblocking(False)
    install_stop_signals(waker)
    try:
        listeners = listen(config.host, config.port)
    except OSError as err:
        _complain(f"error: cannot listen on {config.host}:{config.port}: {err}")
        return 1
    port: int = listeners[0].getsockname()[1]
    _say(
        f"slotctl-demo listening host={config.host} port={port} "
        f"model={config.model} pid={os.getpid()}"
    )
    state = DemoState(config)
    loader = _Loader(state, port, waker)
    loader.start()
    extra = (*(SLEEP_ROUTES if config.enable_sleep_mode else ()), *lora_routes(state))
    app = build_app(state, extra)
    return _run_until_stopped(listeners, app, loader, _Stopper(config.slow_stop), wake)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m controller.demo``; returns the exit status."""
    return serve(parse_args(argv))
