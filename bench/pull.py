"""Model pulls (issue 35): throughput, verification cost, bytes fetched again after a kill.

Side by side in one run, against one local hub server (tests/integration/hubserver.py:
the hub's routes, LFS files redirected to a second origin as the hub's CDN is):

* pull throughput of :class:`controller.modelfiles.pull.ModelFiles` — a hub file (resolved
  by ``huggingface_hub``) and a URL (probed with a ``HEAD``), both fetched by the lean
  reader (controller/modelfiles/stream.py) into a partial file hashed as the bytes
  arrive, renamed into place once verified — against ``curl`` of the same file (the hub's
  ``resolve`` URL, redirected to the "CDN"; the URL itself: the server sends those two
  differently, so each pull is set against curl of its own; goal: at least 0.9x) and
  against the library's own ``hf_hub_download`` (which verifies nothing but the size);
  a pull fsyncs its file before the rename (a power cut never leaves a torn file in
  place), which curl does not: ``curl + sync`` is curl with that cost;
* verification cost per GB (sha256 and git blob hash of a file already on disk);
* bytes fetched again after a pull is killed (SIGKILL) at half the file and a fresh
  process pulls it (goal: at most one chunk, the reader's 4 MiB block).

Every contender runs in a process of its own, as ``curl`` does (the hub server is a thread
of this one, and a pull sharing its interpreter lock would measure the lock). Prints figures
and ratios (best of ``--runs``); never fails on timing.

    python bench/pull.py [--mib 256] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import hf_hub_download

from controller.modelfiles.digests import hash_file
from controller.modelfiles.hub import HubSettings
from controller.modelfiles.pull import ModelFiles
from controller.modelfiles.stream import CHUNK_BYTES
from controller.spec.schema import ModelSpec
from tests.integration.hubserver import HubServer

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def blob(size: int) -> bytes:
    block = hashlib.sha256(b"bench").digest() * 2048
    return (block * (size // len(block) + 1))[:size]


Measured = tuple[float, float]  # (wall seconds, CPU seconds of the client's process)


def best(runs: int, once: Callable[[Path], Measured | None]) -> Measured:
    """The best wall time of ``runs`` runs of ``once`` (each in a fresh directory), with
    that run's CPU.

    ``once`` returns what a child process measured itself (its pull without its
    interpreter's start and imports: wall and its own CPU), or None to be timed from here
    (``curl``: wall, and the CPU of the children it ran).
    """
    results = []
    for _ in range(runs):
        where = Path(tempfile.mkdtemp(prefix="bench-pull-"))
        try:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            measured = once(where)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            results.append((wall, cpu) if measured is None else measured)
        finally:
            shutil.rmtree(where, ignore_errors=True)
    return min(results)


def one(where: Path, kind: str, endpoint: str, source: str, sha: str) -> Measured:
    """One pull in a child process, as ``curl`` is: the hub server runs in this process's
    thread, and a pull in the same process would share its interpreter lock."""
    out = subprocess.run(
        [sys.executable, __file__, "--one", kind, endpoint, source, sha, str(where)],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def pull_once(kind: str, endpoint: str, source: str, sha: str, where: Path) -> Measured:
    """The child's side of :func:`one`: the wall and CPU seconds (every thread's) of one
    pull, after the imports."""
    start, cpu = time.perf_counter(), time.process_time()
    if kind == "library":
        hf_hub_download(
            "bench/model", "model.gguf", local_dir=where, endpoint=endpoint, token=False
        )
        return time.perf_counter() - start, time.process_time() - cpu
    files = ModelFiles(
        where / "models",
        where / "state",
        hub_settings=HubSettings(endpoint=endpoint, token_file=where / "none"),
        margin_bytes=0,
    )
    (where / "none").write_text("")
    outcome = asyncio.run(files.ensure(ModelSpec(id="b", source=source, sha256=sha or None)))
    measured = time.perf_counter() - start, time.process_time() - cpu
    assert outcome.bytes_pulled > 0, outcome
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="file size in MiB")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    size = args.mib * MIB
    data = blob(size)
    digest = hashlib.sha256(data).hexdigest()

    with HubServer() as hub:
        hub.add_repo("bench/model", {"model.gguf": data})
        url = hub.add_url("model.gguf", data)
        resolve = f"{hub.endpoint}/bench/model/resolve/main/model.gguf"

        def curl_of(address: str) -> Callable[[Path], Measured | None]:
            def once(where: Path) -> Measured | None:
                subprocess.run(["curl", "-sSfL", "-o", str(where / "f"), address], check=True)
                return None

            return once

        curl = curl_of(resolve)

        def curl_sha(where: Path) -> Measured | None:
            curl(where)
            subprocess.run(["sha256sum", str(where / "f")], check=True, capture_output=True)
            return None

        def curl_sync(where: Path) -> Measured | None:
            # what a pull renamed into place owes a power cut: the data on disk first
            curl(where)
            subprocess.run(["sync", "--data", str(where / "f")], check=True)
            return None

        def library(where: Path) -> Measured:
            return one(where, "library", hub.endpoint, "", "")

        def ours(source: str, sha: str | None) -> Callable[[Path], Measured | None]:
            def once(where: Path) -> Measured:
                return one(where, "ours", hub.endpoint, source, sha or "")

            return once

        # (name, run, the row it is set against)
        contenders: list[tuple[str, Callable[[Path], Measured | None], str]] = [
            ("curl, hub file (no verification)", curl, "curl, hub file (no verification)"),
            ("curl + sha256sum", curl_sha, "curl, hub file (no verification)"),
            ("curl + sync (on disk, unverified)", curl_sync, "curl, hub file (no verification)"),
            ("hf_hub_download (size check only)", library, "curl, hub file (no verification)"),
            (
                "slotctl pull, hub (sha256 inline)",
                ours("hf://bench/model/model.gguf", None),
                "curl, hub file (no verification)",
            ),
            ("curl, URL (no verification)", curl_of(url), "curl, URL (no verification)"),
            ("slotctl pull, URL (sha256 inline)", ours(url, digest), "curl, URL (no verification)"),
        ]
        # interleaved, run by run, so that a machine's load drifting during the bench
        # weighs on every contender alike
        times: dict[str, list[Measured]] = {name: [] for name, _, _ in contenders}
        for _ in range(args.runs):
            for name, once, _ in contenders:
                times[name].append(best(1, once))
        rows = {name: min(times[name]) for name, _, _ in contenders}
        gb = size / 1e9
        print(
            f"pull of a {args.mib} MiB file from a local hub server (best of {args.runs}; "
            f"load average {os.getloadavg()[0]:.1f}):"
        )
        print(f"  {'':38} {'seconds':>8} {'MiB/s':>8} {'vs curl':>8} {'CPU s/GB':>9}")
        for name, _, against in contenders:
            seconds, cpu = rows[name]
            print(
                f"  {name:38} {seconds:8.2f} {args.mib / seconds:8.0f} "
                f"{rows[against][0] / seconds:7.2f}x {cpu / gb:9.2f}"
            )
        ours_hub = rows["slotctl pull, hub (sha256 inline)"][0]
        print(
            "  slotctl hub pull vs curl + sha256sum: "
            f"{rows['curl + sha256sum'][0] / ours_hub:.2f}x, vs curl + sync: "
            f"{rows['curl + sync (on disk, unverified)'][0] / ours_hub:.2f}x, "
            f"vs hf_hub_download: {rows['hf_hub_download (size check only)'][0] / ours_hub:.2f}x"
        )

        with tempfile.TemporaryDirectory() as where:
            path = Path(where) / "f"
            path.write_bytes(data)
            for algorithm in ("sha256", "git-sha1"):
                start = time.perf_counter()
                hash_file(path, algorithm)
                seconds = time.perf_counter() - start
                print(
                    f"verification ({algorithm}) of a file on disk: "
                    f"{seconds / (size / 1e9):.2f} s per GB"
                )

        print(kill_at_half(hub, size))


def kill_at_half(hub: HubServer, size: int) -> str:
    """SIGKILL a pulling process at half the file, pull again; the bytes fetched twice."""
    hub.fault("model.gguf", hold_at=size // 2)
    sent_before = hub.sent("model.gguf")
    with tempfile.TemporaryDirectory() as where:
        models, state = Path(where) / "models", Path(where) / "state"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_DOWNLOAD_TIMEOUT="600", PYTHONPATH=str(REPO))
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.pull_child",
                str(models),
                str(state),
                "hf://bench/model/model.gguf",
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        hub.held.wait(300)
        chunk = CHUNK_BYTES
        deadline = time.monotonic() + 300
        kept = 0
        while time.monotonic() < deadline:
            kept = sum(p.stat().st_size for p in (models / ".slotctl/partial").glob("*.part"))
            if kept >= size // 2 - chunk:
                break
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        hub.release()
        files = ModelFiles(
            models, state, hub_settings=HubSettings(endpoint=hub.endpoint), margin_bytes=0
        )
        outcome = asyncio.run(files.ensure(ModelSpec(id="b", source="hf://bench/model/model.gguf")))
    sent = hub.sent("model.gguf") - sent_before
    again = sent - size
    return (
        f"kill -9 at half ({size // 2 // MIB} MiB sent): {kept / MIB:.0f} MiB were on disk and "
        f"resumed ({outcome.action}); fetched again: {again / MIB:.1f} MiB "
        f"(goal: at most one chunk, {chunk / MIB:.0f} MiB: {'met' if again <= chunk else 'missed'})"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        kind, endpoint, source, sha, where = sys.argv[2:7]
        wall, cpu = pull_once(kind, endpoint, source, sha, Path(where))
        print(wall, cpu)
    else:
        main()
