"""Model pulls for real (issue 35): the real ``huggingface_hub`` client against a
hub-compatible server on 127.0.0.1 (tests/integration/hubserver.py), real files, no mock
of the client. Each test waits on state (the server's counters and events, files on
disk), never on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants as hf_constants

import controller.modelfiles.pull as pull_module
from controller.model.errors import (
    InsufficientDisk,
    ModelAccessDenied,
    ModelFileMissing,
    ModelPullFailed,
    ModelVerifyFailed,
)
from controller.modelfiles.gc import Reference
from controller.modelfiles.hub import HubSettings
from controller.modelfiles.progress import PullProgress
from controller.modelfiles.pull import ModelFiles
from controller.modelfiles.stream import CHUNK_BYTES
from controller.spec.schema import ModelSpec
from tests.integration.hubserver import HubServer

TOKEN = "hf_TESTtokenNEVERlogged0123456789"
MIB = 1024 * 1024
CHUNK = CHUNK_BYTES  # the reader's block: the most a kill loses
REPO = Path(__file__).resolve().parents[2]


def blob(size: int, seed: int = 0) -> bytes:
    """Deterministic bytes (cheaper than os.urandom for tens of MiB, and reproducible)."""
    block = hashlib.sha256(b"%d" % seed).digest() * 2048  # 64 KiB
    return (block * (size // len(block) + 1))[:size]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Wait for a state (the deadline only turns a hang into a failure)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer(token=TOKEN) as server:
        yield server


@pytest.fixture
def long_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A held response must not look like a stalled one to the client's read timeout."""
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 300)


MakeFiles = Callable[..., ModelFiles]


@pytest.fixture
def make_files(tmp_path: Path, hub: HubServer) -> MakeFiles:
    def make(
        models_dir: Path | None = None,
        *,
        token: str | None = None,
        token_file: bool = True,
        **kwargs: Any,
    ) -> ModelFiles:
        path = tmp_path / f"token-{len(list(tmp_path.glob('token-*')))}"
        path.write_text(token or "")
        settings = HubSettings(endpoint=hub.endpoint, token_file=path if token_file else None)
        kwargs.setdefault("margin_bytes", 0)
        kwargs.setdefault("progress_interval_s", 0.0)
        return ModelFiles(
            models_dir or tmp_path / "models", tmp_path / "state", hub_settings=settings, **kwargs
        )

    return make


def lfs_gets(hub: HubServer) -> list[Any]:
    return [r for r in hub.requests if r.route == "lfs" and r.method == "GET"]


# -- sources ---------------------------------------------------------------------------


async def test_hub_file_is_pulled_verified_and_then_present_without_a_request(
    hub: HubServer, make_files: MakeFiles
) -> None:
    data = blob(3 * MIB + 5)
    commit = hub.add_repo("org/chat", {"chat.Q4.gguf": data, "config.json": b"{}"})
    files = make_files(token=TOKEN)
    model = ModelSpec(id="chat", source="hf://org/chat/chat.Q4.gguf")
    assert files.needs_pull(model)
    seen: list[PullProgress] = []

    outcome = await files.ensure(model, on_progress=seen.append)

    dest = files.models_dir / "org/chat/chat.Q4.gguf"
    assert outcome.action == "pulled" and outcome.path == dest
    assert outcome.commit == commit and outcome.digest == f"sha256:{sha(data)}"
    assert outcome.bytes_pulled == len(data) and outcome.bytes_resumed == 0
    assert dest.read_bytes() == data
    assert not list((files.models_dir / ".slotctl/partial").glob("*.part"))
    phases = [p.phase for p in seen]
    assert phases[0] == "checking" and "downloading" in phases and phases[-1] == "done"
    assert seen[-1].bytes_done == seen[-1].bytes_total == len(data)
    # The token goes to the hub, never to the CDN's signed URL (another origin).
    resolve = [r for r in hub.requests if r.route == "resolve"]
    assert resolve and all(r.authorized for r in resolve)
    assert lfs_gets(hub) and not any(r.authorized for r in lfs_gets(hub))
    assert files.records.verified(dest) is not None and not files.needs_pull(model)

    before = len(hub.requests)
    again = await files.ensure(model)
    assert again.action == "verified" and len(hub.requests) == before  # no network call
    assert files.stats.snapshot()["outcomes"] == {
        **dict.fromkeys(files.stats.snapshot()["outcomes"], 0),  # type: ignore[arg-type]
        "pulled": 1,
        "verified": 1,
    }


async def test_a_small_git_file_is_verified_by_its_git_blob_hash(
    hub: HubServer, make_files: MakeFiles
) -> None:
    hub.add_repo("org/tok", {"tokenizer.json": b'{"vocab": [1, 2, 3]}'})
    files = make_files()
    outcome = await files.ensure(ModelSpec(id="t", source="hf://org/tok/tokenizer.json"))
    assert outcome.action == "pulled" and outcome.digest is not None
    assert outcome.digest.startswith("git-sha1:")
    assert not lfs_gets(hub)  # served by the resolve route itself


async def test_snapshot_with_include_exclude_and_a_pinned_revision(
    hub: HubServer, make_files: MakeFiles
) -> None:
    hub.page_size = 2  # the tree listing comes in pages (Link: rel="next")
    old = {
        "model-1.safetensors": blob(200_000, 1),
        "model-2.safetensors": blob(200_000, 2),
        "config.json": b'{"v": 1}',
        "README.md": b"# readme",
        "onnx/model.onnx": blob(100_000, 3),
    }
    first = hub.add_repo("org/vl", old)
    hub.add_repo("org/vl", {**old, "config.json": b'{"v": 2}'})  # main moves on
    files = make_files()
    model = ModelSpec(
        id="vl",
        source="hf://org/vl",
        revision=first,
        include=["*.safetensors", "*.json"],
        exclude=["model-2*"],
    )
    outcome = await files.ensure(model)

    dest = files.models_dir / "org/vl"
    assert outcome.action == "pulled" and outcome.commit == first and outcome.files == 2
    assert sorted(p.name for p in dest.rglob("*") if p.is_file()) == [
        "config.json",
        "model-1.safetensors",
    ]
    assert (dest / "config.json").read_bytes() == b'{"v": 1}'  # the pinned commit's
    assert not (files.models_dir / ".slotctl/staging").exists() or not any(
        (files.models_dir / ".slotctl/staging").iterdir()
    )
    assert (await files.state(model)).state == "verified"
    assert (await files.ensure(model)).action == "verified"


async def test_a_snapshot_reuses_a_file_pulled_alone_and_is_not_present_before(
    hub: HubServer, make_files: MakeFiles
) -> None:
    weights = blob(300_000, 4)
    hub.add_repo("org/mix", {"w.safetensors": weights, "config.json": b"{}"})
    files = make_files()
    await files.ensure(ModelSpec(id="one", source="hf://org/mix/w.safetensors"))
    snapshot = ModelSpec(id="all", source="hf://org/mix")
    assert files.needs_pull(snapshot)  # the directory holds one pulled file, not the repo
    sent = hub.sent("w.safetensors")
    outcome = await files.ensure(snapshot)
    assert outcome.files == 2 and hub.sent("w.safetensors") == sent  # not fetched again


async def test_url_source_is_verified_by_its_declared_sha256(
    hub: HubServer, make_files: MakeFiles
) -> None:
    data = blob(2 * MIB + 3, 5)
    url = hub.add_url("models/tiny.gguf", data)
    files = make_files()
    outcome = await files.ensure(ModelSpec(id="u", source=url, sha256=sha(data)))
    assert outcome.action == "pulled"
    assert outcome.path == files.models_dir / f"_urls/127.0.0.1_{hub.port}/files/models/tiny.gguf"
    assert outcome.path.read_bytes() == data


# -- verification ----------------------------------------------------------------------


def quarantined(files: ModelFiles) -> list[Path]:
    where = files.models_dir / ".slotctl/quarantine"
    return sorted(p for p in where.iterdir() if p.suffix != ".json") if where.exists() else []


async def test_wrong_bytes_from_the_hub_are_quarantined_never_served(
    hub: HubServer, make_files: MakeFiles
) -> None:
    data = blob(MIB, 6)
    hub.add_repo("org/bad", {"bad.gguf": data})
    hub.fault("bad.gguf", wrong_bytes=True)
    files = make_files()
    model = ModelSpec(id="bad", source="hf://org/bad/bad.gguf")
    with pytest.raises(ModelVerifyFailed) as caught:
        await files.ensure(model)

    assert not (files.models_dir / "org/bad/bad.gguf").exists()
    (moved,) = quarantined(files)
    assert caught.value.details["quarantined"] == str(moved)
    assert caught.value.details["expected"] == [f"sha256:{sha(data)}"]
    assert moved.stat().st_size == len(data)  # moved aside, not deleted
    facts = json.loads(moved.with_name(moved.name + ".json").read_text())
    assert facts["model"] == "bad"
    assert files.stats.outcomes["verify_failed"] == 1
    assert (await files.state(model)).state == "absent"


async def test_a_url_whose_bytes_are_not_the_declared_sha256_is_quarantined(
    hub: HubServer, make_files: MakeFiles
) -> None:
    url = hub.add_url("x.gguf", blob(MIB, 7))
    files = make_files()
    with pytest.raises(ModelVerifyFailed):
        await files.ensure(ModelSpec(id="x", source=url, sha256="0" * 64))
    assert len(quarantined(files)) == 1
    assert not (files.models_dir / f"_urls/127.0.0.1_{hub.port}/files/x.gguf").exists()


async def test_a_hub_file_that_is_not_the_pinned_sha256_is_refused_before_a_byte(
    hub: HubServer, make_files: MakeFiles
) -> None:
    hub.add_repo("org/p", {"p.gguf": blob(MIB, 8)})
    files = make_files()
    with pytest.raises(ModelVerifyFailed, match="not the sha256 the model pins"):
        await files.ensure(ModelSpec(id="p", source="hf://org/p/p.gguf", sha256="1" * 64))
    assert hub.sent("p.gguf") == 0


async def test_a_local_file_is_verified_once_and_remembered_by_identity(
    tmp_path: Path, make_files: MakeFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = blob(MIB, 9)
    local = tmp_path / "local.gguf"
    local.write_bytes(data)
    hashed: list[Path] = []
    real = pull_module.hash_file

    def counting(path: Path, algorithm: Any, **kw: Any) -> str:
        hashed.append(path)
        return real(path, algorithm, **kw)

    monkeypatch.setattr(pull_module, "hash_file", counting)
    files = make_files()
    model = ModelSpec(id="l", source=str(local), sha256=sha(data))
    assert files.needs_pull(model)  # a verification to do: the load goes through pulling
    assert (await files.ensure(model)).action == "verified"
    assert (await files.ensure(model)).action == "verified"
    assert hashed == [local]  # once
    os.utime(local, ns=(1, 1))  # another identity (mtime): hashed again
    assert (await files.ensure(model)).action == "verified"
    assert len(hashed) == 2

    with pytest.raises(ModelVerifyFailed):
        await files.ensure(ModelSpec(id="l2", source=str(local), sha256="2" * 64))
    assert local.read_bytes() == data  # a path of this host is never moved
    with pytest.raises(ModelFileMissing):
        await files.ensure(ModelSpec(id="gone", source=str(tmp_path / "absent.gguf")))


# -- tokens ----------------------------------------------------------------------------


async def test_gated_repo_needs_a_token_and_the_token_is_never_logged(
    hub: HubServer,
    make_files: MakeFiles,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    data = blob(MIB, 10)
    hub.add_repo("org/gated", {"g.gguf": data}, gated=True)
    model = ModelSpec(id="g", source="hf://org/gated/g.gguf")

    with pytest.raises(ModelAccessDenied) as refused:
        await make_files(token=None).ensure(model)
    assert refused.value.details["reason"] == "gated"
    assert refused.value.details["token_sent"] is False
    assert refused.value.http_status == 403 and hub.sent("g.gguf") == 0

    with pytest.raises(ModelAccessDenied) as wrong:
        await make_files(token="hf_wrong").ensure(model)
    assert wrong.value.details["token_sent"] is True

    outcome = await make_files(token=TOKEN).ensure(model)  # from the token file
    assert outcome.action == "pulled"
    (outcome.path).unlink()
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # from the environment, as the library reads it
    assert (await make_files(token_file=False).ensure(model)).action == "pulled"

    shown = caplog.text + str(refused.value) + json.dumps(refused.value.to_dict())
    assert TOKEN not in shown and "hf_wrong" not in shown
    assert "sig=" not in caplog.text  # nor the CDN's signed query


# -- resume ----------------------------------------------------------------------------


async def test_a_dropped_connection_resumes_and_fetches_only_the_rest(
    hub: HubServer, make_files: MakeFiles
) -> None:
    data = blob(24 * MIB, 11)
    hub.add_repo("org/drop", {"d.gguf": data})
    hub.fault("d.gguf", drop_after=15 * MIB)
    files = make_files()
    outcome = await files.ensure(ModelSpec(id="d", source="hf://org/drop/d.gguf"))
    assert outcome.path.read_bytes() == data
    gets = lfs_gets(hub)
    assert len(gets) == 2 and gets[1].range == f"bytes={15 * MIB}-"  # from the bytes on disk
    assert hub.sent("d.gguf") == len(data)  # a clean drop costs nothing: no byte twice


async def test_a_url_dropped_twice_is_resumed_losing_at_most_a_chunk_each_time(
    hub: HubServer, make_files: MakeFiles
) -> None:
    data = blob(8 * MIB + 1, 12)
    url = hub.add_url("drop.bin", data)
    drop = 3 * MIB
    hub.fault("drop.bin", drop_after=drop, drop_times=2)
    files = make_files()
    outcome = await files.ensure(ModelSpec(id="d", source=url, sha256=sha(data)))
    assert outcome.path.read_bytes() == data
    ranges = [r.range for r in hub.requests if r.route == "files" and r.method == "GET"]
    assert len(ranges) == 3 and ranges[0] is None
    starts = [int(r.removeprefix("bytes=").rstrip("-")) for r in ranges[1:]]
    # Each drop (3 MiB into a response) is resumed from the bytes on disk: what was read
    # before it was written (a reset costs at most one read: tests/integration/test_pull_stream.py).
    assert starts == [drop, 2 * drop]
    assert hub.sent("drop.bin") == len(data)


def child_env(hub: HubServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HUB_DOWNLOAD_TIMEOUT="300",
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONPATH=str(REPO),
    )
    return env


async def test_kill_9_at_half_then_a_fresh_pull_resumes_what_was_on_disk(
    hub: HubServer, make_files: MakeFiles, tmp_path: Path, long_reads: None
) -> None:
    data = blob(32 * MIB, 13)
    hub.add_repo("org/big", {"big.gguf": data})
    hub.fault("big.gguf", hold_at=len(data) // 2)
    models, state = tmp_path / "models", tmp_path / "state"
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.pull_child",
            str(models),
            str(state),
            "hf://org/big/big.gguf",
        ],
        env=child_env(hub),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        await asyncio.to_thread(hub.held.wait, 120)
        assert hub.held.is_set(), "the child never reached half of the file"

        def kept() -> int:
            return sum(p.stat().st_size for p in (models / ".slotctl/partial").glob("*.part"))

        await until(lambda: kept() >= len(data) // 2 - CHUNK, "the child's bytes on disk")
        child.send_signal(signal.SIGKILL)
        await asyncio.to_thread(child.wait, 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.communicate()
        hub.release()
    on_disk = kept()
    assert 0 < on_disk <= len(data) // 2
    first = hub.sent("big.gguf")

    files = make_files(models)
    assert (await files.state(ModelSpec(id="b", source="hf://org/big/big.gguf"))).state == "partial"
    outcome = await files.ensure(ModelSpec(id="b", source="hf://org/big/big.gguf"))

    assert outcome.action == "resumed" and outcome.bytes_resumed == on_disk
    assert outcome.path.read_bytes() == data
    assert hub.sent("big.gguf") - first == len(data) - on_disk  # only what was missing
    assert hub.sent("big.gguf") - len(data) <= CHUNK  # the re-download: at most one chunk
    assert lfs_gets(hub)[-1].range == f"bytes={on_disk}-"


async def test_offline_mode_is_honoured(hub: HubServer, tmp_path: Path) -> None:
    hub.add_repo("org/off", {"o.gguf": blob(MIB, 14)})
    env = {**child_env(hub), "HF_HUB_OFFLINE": "1"}
    run = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "tests.integration.pull_child",
            str(tmp_path / "m"),
            str(tmp_path / "s"),
            "hf://org/off/o.gguf",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    assert answer["code"] == "model.pull_failed" and answer["reason"] == "offline"
    assert not hub.requests


# -- joins -----------------------------------------------------------------------------


async def test_two_pulls_of_one_file_share_one_download(
    hub: HubServer, make_files: MakeFiles, long_reads: None
) -> None:
    data = blob(4 * MIB, 15)
    hub.add_repo("org/shared", {"s.gguf": data})
    hub.fault("s.gguf", hold_at=MIB)
    files = make_files()
    first = asyncio.create_task(files.ensure(ModelSpec(id="a", source="hf://org/shared/s.gguf")))
    await asyncio.to_thread(hub.held.wait, 60)
    second = asyncio.create_task(files.ensure(ModelSpec(id="b", source="hf://org/shared/s.gguf")))
    await until(lambda: len(files.pulling()) == 1, "one pull in flight")
    hub.release()
    one, two = await asyncio.gather(first, second)
    assert one == two and one.path.read_bytes() == data
    assert len(lfs_gets(hub)) == 1 and hub.sent("s.gguf") == len(data)


async def test_a_cancelled_waiter_leaves_and_the_last_one_cancels_the_pull(
    hub: HubServer, make_files: MakeFiles, long_reads: None
) -> None:
    data = blob(24 * MIB, 16)
    hub.add_repo("org/c", {"c.gguf": data})
    hub.fault("c.gguf", hold_at=12 * MIB)
    files = make_files()
    model = ModelSpec(id="c", source="hf://org/c/c.gguf")
    leaving = asyncio.create_task(files.ensure(model))
    staying = asyncio.create_task(files.ensure(model))
    await asyncio.to_thread(hub.held.wait, 60)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert files.pulling()  # still pulling for the other waiter
    hub.release()
    assert (await staying).path.read_bytes() == data

    # Alone: cancelling the only waiter cancels the pull; its bytes stay to resume.
    other = blob(24 * MIB, 17)
    hub.add_repo("org/d", {"d.gguf": other})
    hub.fault("d.gguf", hold_at=12 * MIB)
    lonely = ModelSpec(id="d", source="hf://org/d/d.gguf")
    alone = asyncio.create_task(files.ensure(lonely))
    await asyncio.to_thread(hub.held.wait, 60)
    await until(
        lambda: (
            (files.pulling() or [None])[0] is not None and files.pulling()[0].bytes_done >= CHUNK
        ),
        "a chunk on disk",
    )
    alone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await alone
    await until(lambda: not files.pulling(), "the pull to end")
    hub.release()
    assert files.stats.outcomes["cancelled"] == 1
    state = await files.state(lonely)
    assert state.state == "partial" and state.size_bytes >= CHUNK
    outcome = await files.ensure(lonely)
    assert outcome.action == "resumed" and outcome.path.read_bytes() == other


# -- disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """A real small filesystem (tmpfs) as the models dir: free space that is really that."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(
                f"cannot mount a tmpfs here ({done.stderr.strip()}); "
                "tests/unit/test_model_admission.py covers the arithmetic"
            )
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


def regular_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


async def test_a_pull_that_does_not_fit_is_refused_before_a_byte(
    hub: HubServer, make_files: MakeFiles, small_disk: Callable[[int], Path]
) -> None:
    disk = small_disk(4 * MIB)
    hub.add_repo("org/huge", {"h.gguf": blob(6 * MIB, 18)})
    files = make_files(disk / "models")
    with pytest.raises(InsufficientDisk) as refused:
        await files.ensure(ModelSpec(id="h", source="hf://org/huge/h.gguf"))
    assert refused.value.details["needed_bytes"] == 6 * MIB
    assert refused.value.details["free_bytes"] <= 4 * MIB
    assert refused.value.code == "model.insufficient_disk" and refused.value.http_status == 507
    assert regular_files(disk) == [] and hub.sent("h.gguf") == 0
    assert os.statvfs(disk).f_bfree == os.statvfs(disk).f_blocks  # nothing written


async def test_gc_makes_room_least_recently_used_first_never_a_pinned_file(
    hub: HubServer, make_files: MakeFiles, small_disk: Callable[[int], Path]
) -> None:
    disk = small_disk(12 * MIB)
    models = disk / "models"
    (models / "old").mkdir(parents=True)
    older, newer, pinned = models / "old/a.gguf", models / "old/b.gguf", models / "pinned.gguf"
    for path, size in ((older, 3 * MIB), (newer, 3 * MIB), (pinned, 4 * MIB)):
        path.write_bytes(blob(size, 19))
    refs = [Reference(pinned, "keep-me", pinned=True)]
    files = make_files(models, references=lambda: refs)
    files.records.touch(older, 1000.0)
    files.records.touch(newer, 2000.0)
    files.records.touch(pinned, 1.0)  # the oldest of all, and pinned

    dry = await files.gc(refs, need_bytes=MIB, dry_run=True)
    assert [e.path for e in dry.remove] == [older] and older.exists()
    assert any("pinned: keep-me" in line for line in dry.lines())

    hub.add_repo("org/new", {"n.gguf": blob(3 * MIB, 20)})
    outcome = await files.ensure(ModelSpec(id="n", source="hf://org/new/n.gguf"))
    assert outcome.action == "pulled"
    assert not older.exists() and newer.exists() and pinned.exists()

    hub.add_repo("org/newer", {"m.gguf": blob(7 * MIB, 21)})
    refs.append(Reference(newer, "declared"))
    refs.append(Reference(outcome.path, "n"))
    with pytest.raises(InsufficientDisk) as refused:
        await files.ensure(ModelSpec(id="m", source="hf://org/newer/m.gguf"))
    assert refused.value.details["reclaimable_bytes"] == 0  # all the rest is declared
    assert pinned.exists() and newer.exists()


# -- refresh, other processes, the dry run ---------------------------------------------


async def test_refresh_pulls_the_new_version_when_the_branch_moved(
    hub: HubServer, make_files: MakeFiles
) -> None:
    hub.add_repo("org/moving", {"m.gguf": blob(MIB, 22)})
    files = make_files()
    model = ModelSpec(id="m", source="hf://org/moving/m.gguf")
    await files.ensure(model)
    newer = blob(MIB, 23)
    commit = hub.add_repo("org/moving", {"m.gguf": newer})
    assert (await files.ensure(model)).action == "verified"  # no network call for it
    outcome = await files.ensure(model, refresh=True)
    assert outcome.action == "pulled" and outcome.commit == commit
    assert outcome.path.read_bytes() == newer
    again = await files.ensure(model, refresh=True)
    assert again.action == "verified" and len(lfs_gets(hub)) == 2  # asked, not fetched


async def test_a_file_another_process_is_pulling_is_waited_for_not_fetched_twice(
    hub: HubServer, make_files: MakeFiles
) -> None:
    import fcntl

    data = blob(2 * MIB, 24)
    hub.add_repo("org/busy", {"b.gguf": data})
    files = make_files()
    dest = files.models_dir / "org/busy/b.gguf"
    lock = files.layout.partial(dest, f"sha256:{sha(data)}").with_suffix(".lock")
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other process
    try:
        task = asyncio.create_task(files.ensure(ModelSpec(id="b", source="hf://org/busy/b.gguf")))
        await until(
            lambda: bool(files.pulling()) and files.pulling()[0].phase == "downloading",
            "the pull to wait for the lock",
        )
        dest.parent.mkdir(parents=True, exist_ok=True)
        placed = dest.with_name(dest.name + ".other")
        placed.write_bytes(data)
        placed.replace(dest)  # what the other process renames into place (whole, at once)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    outcome = await task
    assert outcome.path.read_bytes() == data and not lfs_gets(hub)
    assert files.records.verified(dest) is not None


async def test_the_dry_run_says_what_would_be_pulled(
    hub: HubServer, make_files: MakeFiles, tmp_path: Path
) -> None:
    hub.add_repo("org/plan", {"p.gguf": blob(3 * MIB, 25)}, gated=True)
    files = make_files(token=TOKEN)
    model = ModelSpec(id="p", source="hf://org/plan/p.gguf")
    plan = await files.plan(model)
    assert plan.action == "pull" and plan.bytes == 3 * MIB
    assert plan.message == "would pull 3.1 MB from hf://org/plan/p.gguf"
    assert not (files.models_dir / "org").exists() and hub.sent("p.gguf") == 0
    denied = await make_files(token=None).plan(model)
    assert denied.error is not None and denied.error["code"] == "model.access_denied"
    missing = await files.plan(ModelSpec(id="x", source=str(tmp_path / "nope.gguf")))
    assert missing.action == "missing"
    await files.ensure(model)
    assert (await files.plan(model)).action == "none"
    assert (await files.state(model)).state == "verified"
    assert await files.remove(model) == 3 * MIB and (await files.state(model)).state == "absent"


async def test_a_slow_pull_reports_its_rate_and_eta_through_the_iterator(
    hub: HubServer, make_files: MakeFiles
) -> None:
    data = blob(2 * MIB, 26)
    url = hub.add_url("slow.bin", data)
    hub.fault("slow.bin", rate_bps=4 * MIB)  # about half a second
    files = make_files()
    handle = files.pull(ModelSpec(id="s", source=url, sha256=sha(data)))
    seen = [snapshot async for snapshot in handle.updates()]
    outcome = await handle.wait()
    assert outcome.action == "pulled" and seen[-1].phase == "done"
    moving = [s for s in seen if s.phase == "downloading" and s.rate_bps > 0]
    assert moving and all(s.eta_s is not None and s.bytes_total == len(data) for s in moving)
    assert [s.bytes_done for s in moving] == sorted(s.bytes_done for s in moving)


async def test_a_read_only_models_dir_is_a_typed_failure(
    hub: HubServer, make_files: MakeFiles, small_disk: Callable[[int], Path]
) -> None:
    disk = small_disk(4 * MIB)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    hub.add_repo("org/ro", {"r.gguf": blob(MIB, 27)})
    with pytest.raises(ModelPullFailed) as failed:
        await make_files(disk / "models").ensure(ModelSpec(id="r", source="hf://org/ro/r.gguf"))
    assert failed.value.details["reason"] == "models_dir" and hub.sent("r.gguf") == 0
