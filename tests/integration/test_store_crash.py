"""Crash safety of state.json: SIGKILL a writer mid-loop, many times, while a reader reads.

SPEC §3: state.json is written atomically, so a reader never sees a torn file and a
controller restarted after SIGKILL finds the old record or the new one, never a mix.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from controller.model.lifecycle import SlotState
from controller.store.state import SlotStateRecord, StateStore

SLOT = "crash-a"
KILLS = 40

# The writer: rewrites one state.json in a tight loop through StateStore.write, with
# payloads from a few bytes to a few hundred KiB so a kill often lands mid-write. It says
# "ready" once its first write is on disk so the test kills a writer that is writing.
WRITER = r"""
import json, random, sys
from pathlib import Path
from controller.model.lifecycle import SlotState
from controller.store.state import SlotStateRecord, StateStore

state_dir, name, gen = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
store = StateStore(state_dir)
states = list(SlotState)
rng = random.Random(gen)
seq = 0
while True:
    size = rng.choice((0, 10, 1_000, 20_000, 100_000, 400_000)) if seq else 0
    payload = {"gen": gen, "seq": seq, "size": size, "pad": "y" * (seq % 300)}
    payload["blob"] = {f"k{i}": "x" * 97 for i in range(size // 100)}
    store.write(SlotStateRecord(
        name=name, state=states[seq % len(states)], model_id=f"m-{gen}-{seq}",
        port=8000 + seq % 1000, message=json.dumps(payload),
        extra={"failures": seq % 7, "idle_reason": "timeout"},
    ))
    if seq == 0:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
    seq += 1
"""


def _validate(raw: bytes) -> dict[str, Any]:
    """The record's payload (in its message), after checking it is whole and consistent."""
    record = SlotStateRecord.model_validate(json.loads(raw))
    assert record.name == SLOT
    payload = json.loads(record.message)
    # Internal consistency: the blob has the size the same write announced.
    assert len(payload.get("blob", {})) == int(payload["size"]) // 100
    assert record.model_id in ("", f"m-{payload['gen']}-{payload['seq']}")
    return dict(payload)


class _Reader(threading.Thread):
    """Reads and validates the file as fast as it can until stopped."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.stop = threading.Event()
        self.reads = 0
        self.failures: list[str] = []
        self.seen: set[tuple[int, int]] = set()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError as exc:  # the file must always exist once written
                self.failures.append(f"missing: {exc}")
                continue
            try:
                payload = _validate(raw)
            except Exception as exc:
                self.failures.append(f"{type(exc).__name__}: {exc!s:.200} ({len(raw)} bytes)")
                continue
            self.reads += 1
            self.seen.add((int(payload["gen"]), int(payload["seq"])))
            time.sleep(0.0002)  # leave some CPU to the writer on a small machine


def _start_writer(state_dir: Path, gen: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(state_dir), SLOT, str(gen)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != b"ready\n":
        proc.kill()
        proc.wait()
        pytest.fail(f"writer {gen} did not start (exit {proc.returncode}): {line!r}")
    return proc


def test_sigkill_never_leaves_a_torn_state_file(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    path = store.path_for(SLOT)
    first = {"gen": -1, "seq": 0, "size": 0}
    store.write(SlotStateRecord(name=SLOT, state=SlotState.OFFLINE, message=json.dumps(first)))

    rng = random.Random(1234)
    reader = _Reader(path)
    reader.start()
    live: subprocess.Popen[bytes] | None = None
    gens_on_disk: set[int] = set()
    started = time.monotonic()
    try:
        for gen in range(KILLS):
            live = _start_writer(tmp_path, gen)
            time.sleep(rng.uniform(0.0, 0.08))
            live.send_signal(signal.SIGKILL)
            assert live.wait(timeout=10) == -signal.SIGKILL
            live.stdout.close()  # type: ignore[union-attr]
            live = None
            # After the kill the file on disk is a whole record, from this or an older writer.
            assert store.read(SLOT) is not None
            payload = _validate(path.read_bytes())
            assert int(payload["gen"]) <= gen
            gens_on_disk.add(int(payload["gen"]))
    finally:
        if live is not None and live.poll() is None:
            live.kill()
            live.wait()
        reader.stop.set()
        reader.join(timeout=10)
    elapsed = time.monotonic() - started

    assert not reader.is_alive()
    assert reader.failures == [], reader.failures[:5]
    # The test proves something only if reads overlapped many writes of many writers.
    assert reader.reads > 200, reader.reads
    assert len({g for g, _ in reader.seen}) >= KILLS // 2, sorted(reader.seen)[:20]
    assert len(gens_on_disk) >= KILLS // 2
    # a figure, not a gate (timing is the benchmarks' to judge)
    print(f"{KILLS} writers killed, {reader.reads} reads in {elapsed:.1f}s")

    # Killed writers may leave temp files; the sweep removes them and nothing else.
    store.sweep()
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]
    assert store.read(SLOT) is not None
