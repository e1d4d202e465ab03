"""The demo server (``python -m controller.demo``) as a real child process.

Each test starts the server on a free 127.0.0.1 port, talks to it over HTTP with aiohttp's
client, and kills it in the ``spawn`` fixture's teardown. Bounds on time are generous: a
build may be using the CPU while these run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import aiohttp
import psutil
import pytest

from tests.children import CHILD

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "demo-model"
START_TIMEOUT_S = 20.0
READY_RE = re.compile(r"^slotctl-demo ready model=(\S+) port=(\d+) t=(\d+\.\d{6})$")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Demo:
    """One demo server process, with its output lines collected (and timestamped)."""

    def __init__(self, knobs: tuple[str, ...], model: str, port: int | None = None) -> None:
        self.model = model
        self.port = port if port is not None else free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = ["--host", "127.0.0.1", "--port", str(self.port), "--model", model, *knobs]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controller.demo", *argv],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **CHILD,  # its SIGINT/SIGTERM as a foreground job's, whatever the shell ignores
        )
        self.stdout: list[tuple[float, str]] = []
        self.stderr: list[tuple[float, str]] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=_collect, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=_collect, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_text(self) -> str:
        return "".join(line for _, line in self.stderr)

    async def line(self, prefix: str, timeout: float = START_TIMEOUT_S) -> tuple[float, str]:
        """The first stdout line starting with ``prefix`` (and when it was read)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for stamp, text in list(self.stdout):
                if text.startswith(prefix):
                    return stamp, text.rstrip("\n")
            if self.proc.poll() is not None and not any(r.is_alive() for r in self._readers):
                break
            await asyncio.sleep(0.01)
        raise AssertionError(
            f"no line {prefix!r}; exit={self.proc.poll()} stdout={self.stdout} "
            f"stderr={self.stderr_text()!r}"
        )

    async def listening(self) -> None:
        await self.line("slotctl-demo listening ")

    async def ready(self) -> float:
        """Wait for the ready line; returns its ``t``."""
        _, text = await self.line("slotctl-demo ready ")
        match = READY_RE.match(text)
        assert match, text
        assert match.group(1) == self.model and int(match.group(2)) == self.port
        return float(match.group(3))

    async def exit_code(self, timeout: float) -> int | None:
        """The exit status, or None when still running after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for reader in self._readers:
            reader.join(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _collect(stream: IO[str], into: list[tuple[float, str]]) -> None:
    for text in stream:
        into.append((time.time(), text))


Spawn = Callable[..., Demo]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start demo servers: ``spawn("--load-seconds", "1", model="m")``; all killed after."""
    started: list[Demo] = []

    def start(*knobs: str, model: str = MODEL, port: int | None = None) -> Demo:
        demo = Demo(knobs, model, port)
        started.append(demo)
        return demo

    yield start
    for demo in started:
        demo.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


async def post_json(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def started(spawn: Spawn, *knobs: str) -> Demo:
    demo = spawn(*knobs)
    await demo.ready()
    return demo


# --- loading and readiness ------------------------------------------------------------


async def test_models_503_while_loading_then_listed(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    demo = spawn("--load-seconds", "1.5")
    await demo.listening()
    listened = time.time()
    status, body = await get_json(http, f"{demo.base}/v1/models")
    assert status == 503 and body["error"]["code"] == "loading"
    status, body = await get_json(http, f"{demo.base}/health")
    assert status == 503
    status, body = await post_json(http, f"{demo.base}/v1/completions", {"prompt": "hi"})
    assert status == 503 and body["error"]["type"] == "unavailable_error"

    last_empty_sent, first_listed = await _poll_until_listed(http, demo)
    ready_t = await demo.ready()
    # t is taken just before the model becomes visible: after the last 503 answer was
    # produced and before the first non-empty one arrived (same clock, same host).
    assert last_empty_sent - 0.001 <= ready_t <= first_listed + 0.001
    assert first_listed - ready_t < 1.0
    assert ready_t - listened > 1.0  # the load really took --load-seconds
    assert await get_json(http, f"{demo.base}/health") == (200, {"status": "ok"})


async def _poll_until_listed(http: aiohttp.ClientSession, demo: Demo) -> tuple[float, float]:
    deadline = time.monotonic() + START_TIMEOUT_S
    last_empty_sent = 0.0
    while time.monotonic() < deadline:
        sent = time.time()
        status, body = await get_json(http, f"{demo.base}/v1/models")
        received = time.time()
        assert status in (200, 503)
        if status == 200:
            assert body["data"], "a loaded server lists its model"
            (entry,) = body["data"]
            assert entry["id"] == MODEL and entry["object"] == "model"
            assert entry["owned_by"] == "slotctl-demo" and isinstance(entry["created"], int)
            return last_empty_sent, received
        last_empty_sent = sent
        await asyncio.sleep(0.01)
    raise AssertionError("model never listed")


async def test_empty_models_loads_but_lists_nothing(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    demo = spawn("--empty-models")
    await demo.line("slotctl-demo loaded without a model")
    assert await get_json(http, f"{demo.base}/v1/models") == (200, {"object": "list", "data": []})
    assert (await get_json(http, f"{demo.base}/health"))[0] == 200
    status, body = await post_json(http, f"{demo.base}/v1/completions", {"prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert not any("ready" in text for _, text in demo.stdout)


async def test_hang_on_load_never_lists_the_model(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    demo = spawn("--hang-on-load")
    await demo.listening()
    await asyncio.sleep(1.0)
    assert (await get_json(http, f"{demo.base}/v1/models"))[0] == 503
    assert (await get_json(http, f"{demo.base}/health"))[0] == 503
    assert demo.proc.poll() is None
    demo.proc.send_signal(signal.SIGTERM)  # a hung load still stops on request
    assert await demo.exit_code(timeout=10) == 0


async def test_load_until_holds_the_load_until_the_path_exists(
    spawn: Spawn, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    demo = spawn("--load-until", str(gate))
    await demo.listening()
    assert (await get_json(http, f"{demo.base}/v1/models"))[0] == 503  # held
    assert not any(text.startswith("slotctl-demo ready") for _, text in demo.stdout)
    gate.touch()
    await demo.line("slotctl-demo ready")
    assert (await get_json(http, f"{demo.base}/v1/models"))[0] == 200


async def test_fail_on_load_exits_1_with_message(spawn: Spawn) -> None:
    demo = spawn("--load-seconds", "0.3", "--fail-on-load")
    assert await demo.exit_code(timeout=START_TIMEOUT_S) == 1
    demo.stop()  # drains stderr
    assert f"error: failed to load model {MODEL}: injected failure" in demo.stderr_text()
    assert not any(text.startswith("slotctl-demo ready") for _, text in demo.stdout)


# --- inference --------------------------------------------------------------------------


async def test_completions_are_openai_shaped_and_deterministic(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    demo = await started(spawn)
    request = {"model": MODEL, "prompt": "one two three", "max_tokens": 5}
    status, body = await post_json(http, f"{demo.base}/v1/completions", request)
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    _, again = await post_json(http, f"{demo.base}/v1/completions", request)
    assert again["choices"][0]["text"] == choice["text"]
    _, other = await post_json(http, f"{demo.base}/v1/completions", {**request, "prompt": "x"})
    assert other["choices"][0]["text"] != choice["text"]


async def test_chat_completion(spawn: Spawn, http: aiohttp.ClientSession) -> None:
    demo = await started(spawn)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    request = {"model": MODEL, "messages": messages, "max_tokens": 4}
    status, body = await post_json(http, f"{demo.base}/v1/chat/completions", request)
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(choice["message"]["content"].split()) == 4
    assert not choice["message"]["content"].startswith(" ")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


async def test_streaming_chat_arrives_token_by_token(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    demo = await started(spawn, "--tokens-per-second", "20")
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to ten"}],
        "max_tokens": 10,
    }
    events = await _sse_events(http, f"{demo.base}/v1/chat/completions", request)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    content = [
        (stamp, chunk["choices"][0]["delta"]["content"])
        for stamp, chunk in zip((s for s, _ in events), chunks, strict=False)
        if chunk["choices"][0]["delta"].get("content")
    ]
    assert len(content) == 10
    # 10 tokens at 20/s: the first arrives ~0.45 s before the last (not all in one burst).
    assert content[-1][0] - content[0][0] > 0.25
    _, whole = await post_json(http, f"{demo.base}/v1/chat/completions", request)
    assert "".join(text for _, text in content) == whole["choices"][0]["message"]["content"]


async def test_streaming_completion_with_usage(spawn: Spawn, http: aiohttp.ClientSession) -> None:
    demo = await started(spawn)
    request = {
        "prompt": "a b",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await _sse_events(http, f"{demo.base}/v1/completions", request)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 3 + ["length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


async def _sse_events(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> list[tuple[float, str]]:
    """POST with ``stream: true``; each ``data:`` payload with the time it arrived."""
    events: list[tuple[float, str]] = []
    async with http.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("data: "):
                events.append((time.monotonic(), line.removeprefix("data: ")))
            else:
                assert line == "", line
    return events


async def test_embeddings_are_unit_vectors(spawn: Spawn, http: aiohttp.ClientSession) -> None:
    demo = await started(spawn, "--embedding-dim", "24")
    url = f"{demo.base}/v1/embeddings"
    status, body = await post_json(http, url, {"model": MODEL, "input": ["a", "b c", "a"]})
    assert status == 200 and body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    vectors = [d["embedding"] for d in body["data"]]
    assert all(d["object"] == "embedding" for d in body["data"])
    assert all(len(v) == 24 and math.isclose(math.hypot(*v), 1.0, abs_tol=1e-9) for v in vectors)
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}

    _, single = await post_json(http, url, {"input": "a", "encoding_format": "base64"})
    raw = base64.b64decode(single["data"][0]["embedding"])
    decoded = struct.unpack("<24f", raw)
    assert all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(decoded, vectors[0], strict=True))


async def test_wrong_model_is_404_and_bad_input_400(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    demo = await started(spawn)
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/embeddings", {"input": "x"}),
    ):
        status, error = await post_json(http, demo.base + path, {**body, "model": "other"})
        assert status == 404, path
        assert error["error"]["code"] == "model_not_found" and "other" in error["error"]["message"]
    status, error = await post_json(http, f"{demo.base}/v1/completions", {"max_tokens": "x"})
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    async with http.post(f"{demo.base}/v1/completions", data=b"{not json") as resp:
        assert resp.status == 400


# --- faults while serving and stopping ------------------------------------------------


async def test_crash_after_2_exits_on_the_third_request(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    demo = await started(spawn, "--crash-after", "2")
    for _ in range(2):
        status, _body = await post_json(http, f"{demo.base}/v1/completions", {"prompt": "x"})
        assert status == 200
    assert demo.proc.poll() is None
    with pytest.raises(aiohttp.ClientConnectionError):
        await post_json(http, f"{demo.base}/v1/completions", {"prompt": "x"})
    assert await demo.exit_code(timeout=10) == 3
    demo.stop()
    assert "--crash-after" in demo.stderr_text()


async def test_hang_after_1_answers_nothing_from_the_second_request_on(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    """``--hang-after N`` (issue 26): a wedged server. The request after the N-th gets no
    byte, nor does anything after it, ``/health`` included; SIGTERM still stops it."""
    demo = await started(spawn, "--hang-after", "1", "--tokens-per-second", "50")
    status, _body = await post_json(http, f"{demo.base}/v1/completions", {"prompt": "x"})
    assert status == 200
    quick = aiohttp.ClientTimeout(total=1.0)
    with pytest.raises(TimeoutError):
        async with http.post(
            f"{demo.base}/v1/completions", json={"prompt": "x"}, timeout=quick
        ) as resp:
            await resp.read()
    for path in ("/health", "/v1/models"):
        with pytest.raises(TimeoutError):
            async with http.get(demo.base + path, timeout=quick) as resp:
                await resp.read()
    assert "--hang-after" in demo.stderr_text()
    demo.proc.send_signal(signal.SIGTERM)
    assert await demo.exit_code(timeout=10) == 0


async def test_sigterm_and_sigint_stop_promptly(spawn: Spawn) -> None:
    demos = [spawn(), spawn()]
    for demo in demos:
        await demo.ready()
    demos[0].proc.send_signal(signal.SIGTERM)
    demos[1].proc.send_signal(signal.SIGINT)
    assert [await demo.exit_code(timeout=10) for demo in demos] == [0, 0]


async def test_slow_stop_ignores_sigterm_but_not_sigkill(
    spawn: Spawn, http: aiohttp.ClientSession
) -> None:
    demo = await started(spawn, "--slow-stop", "2")
    demo.proc.send_signal(signal.SIGTERM)
    assert await demo.exit_code(timeout=1.0) is None
    status, body = await get_json(http, f"{demo.base}/v1/models")  # still serving meanwhile
    assert status == 200 and body["data"]
    demo.proc.send_signal(signal.SIGKILL)
    assert await demo.exit_code(timeout=5) == -signal.SIGKILL


async def test_slow_stop_exits_by_itself_after_the_delay(spawn: Spawn) -> None:
    demo = await started(spawn, "--slow-stop", "1")
    sent = time.monotonic()
    demo.proc.send_signal(signal.SIGTERM)
    assert await demo.exit_code(timeout=15) == 0
    assert time.monotonic() - sent >= 0.9


async def test_memory_mb_is_resident(spawn: Spawn) -> None:
    small, big = spawn("--memory-mb", "0"), spawn("--memory-mb", "64")
    for demo in (small, big):
        await demo.ready()
    rss = [psutil.Process(demo.pid).memory_info().rss for demo in (small, big)]
    assert rss[1] - rss[0] >= 60 * 2**20, rss


# --- the command line -----------------------------------------------------------------


async def test_binds_only_the_given_host(spawn: Spawn) -> None:
    demo = await started(spawn)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.2", demo.port), timeout=5):
        pass


async def test_port_in_use_exits_1(spawn: Spawn) -> None:
    first = await started(spawn)
    second = spawn(port=first.port)
    assert await second.exit_code(timeout=START_TIMEOUT_S) == 1
    second.stop()
    assert "cannot listen" in second.stderr_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", MODEL],  # no --port
        ["--port", "1234"],  # no --model
        ["--port", "-1", "--model", MODEL],
        ["--port", "1234", "--model", MODEL, "--load-seconds", "nan"],
        ["--port", "1234", "--model", MODEL, "--fail-on-load", "--hang-on-load"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "controller.demo", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and "usage:" in done.stderr
