"""The model-files engine's pure parts (issue 35): sources and destinations, the schema's
new keys, digests, the GC plan, joins, disk admission arithmetic and progress."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from controller.kit.clock import FakeClock
from controller.model.errors import InsufficientDisk
from controller.modelfiles.admission import DiskAdmission
from controller.modelfiles.digests import Digest, digest_from_etag, hash_file
from controller.modelfiles.gc import Reference, plan_gc
from controller.modelfiles.inventory import CacheEntry
from controller.modelfiles.joins import Joins
from controller.modelfiles.progress import ProgressFeed, ProgressMeter, PullProgress
from controller.modelfiles.sources import (
    HubFile,
    HubSnapshot,
    LocalFile,
    UrlFile,
    destination,
    wanted,
)
from controller.providers.base import BuildContext, model_path
from controller.spec.problems import problems_from_validation
from controller.spec.schema import ModelSpec

MODELS = Path("/models")


# -- sources ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "dest"),
    [
        ("hf://org/repo/dir/f.gguf", "/models/org/repo/dir/f.gguf"),
        ("hf://org/repo", "/models/org/repo"),
        ("hf:///org//repo/f.gguf", "/models/org/repo/f.gguf"),
        ("https://Host.example/a/b%20c.gguf?sig=1", "/models/_urls/host.example/a/b c.gguf"),
        ("http://127.0.0.1:8080/x.gguf", "/models/_urls/127.0.0.1_8080/x.gguf"),
        ("file:///abs/f.gguf", "/abs/f.gguf"),
        ("rel/f.gguf", "/models/rel/f.gguf"),
        ("/abs/g.gguf", "/abs/g.gguf"),
    ],
)
def test_destination_is_where_the_server_reads(source: str, dest: str) -> None:
    assert destination(source, MODELS) == Path(dest)
    model = ModelSpec(
        id="m",
        source=source,
        sha256="a" * 64 if "://" in source and source.startswith("http") else None,
    )
    assert model_path(model, BuildContext(models_dir=MODELS)) == dest


def test_wanted_types_each_source() -> None:
    def of(**kw: object) -> object:
        want = wanted(ModelSpec.model_validate({"id": "m", **kw}), MODELS)
        return None if want is None else want.source

    assert of(source="hf://o/r/f.gguf", revision="v1") == HubFile("o/r", "f.gguf", "v1")
    assert of(source="hf://o/r", include=["*.json"], exclude=["x*"]) == HubSnapshot(
        "o/r", None, ("*.json",), ("x*",)
    )
    assert of(source="https://h/f.gguf", sha256="b" * 64) == UrlFile("https://h/f.gguf")
    assert of(source="f.gguf") == LocalFile(MODELS / "f.gguf")
    assert of(source="demo://chat") is None and of() is None


@pytest.mark.parametrize(
    ("payload", "key", "words"),
    [
        ({"source": "https://h/f.gguf"}, "sha256", "needs sha256"),
        ({"source": "https://u:pw@h/f.gguf", "sha256": "a" * 64}, "source", "credentials"),
        ({"source": "https://h/"}, "source", "name a file"),
        ({"source": "hf://o/r", "sha256": "a" * 64}, "sha256", "whole repository"),
        ({"source": "demo://x", "sha256": "a" * 64}, "sha256", "file source"),
        ({"source": "/x.gguf", "revision": "main"}, "revision", "hf:// sources only"),
        ({"source": "hf://o/r/f", "include": ["*"]}, "include", "hf://org/repo"),
        ({"source": "hf://o/r", "exclude": []}, "exclude", "at least 1"),
        ({"source": "hf://o/../r"}, "source", "'..'"),
        ({"source": "hf://o/r", "revision": "../x"}, "revision", ""),
        ({"source": "s3://b/x"}, "source", "unsupported"),
    ],
)
def test_schema_refuses_with_a_clear_error(
    payload: dict[str, object], key: str, words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        ModelSpec.model_validate({"id": "m", **payload})
    (error,) = caught.value.errors()
    assert error["loc"] == (key,)
    assert words in error["msg"]


def test_sha256_is_kept_lower_case_and_credentials_are_not_echoed() -> None:
    assert ModelSpec(id="m", source="https://h/f", sha256="AB" * 32).sha256 == "ab" * 32
    with pytest.raises(ValidationError) as caught:
        ModelSpec.model_validate({"id": "m", "source": "https://me:s3cret@h/f", "sha256": "a" * 64})
    shown = " ".join(
        p.message
        for p, _ in problems_from_validation(
            caught.value, scope="model", fields=ModelSpec.model_fields
        )
    )
    assert "s3cret" not in shown and "***@h/f" in shown


# -- digests ---------------------------------------------------------------------------


def test_digests_from_hub_etags_and_files(tmp_path: Path) -> None:
    data = b"hello world\n"
    path = tmp_path / "f"
    path.write_bytes(data)
    sha256 = hashlib.sha256(data).hexdigest()
    git = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
    assert digest_from_etag(f'"{sha256}"') == Digest("sha256", sha256)
    assert digest_from_etag(f'W/"{git}"') == Digest("git-sha1", git)
    assert digest_from_etag('"abc-123"') is None and digest_from_etag(None) is None
    assert hash_file(path, "sha256") == sha256 and hash_file(path, "git-sha1") == git
    assert Digest.parse(f"sha256:{sha256}") == Digest("sha256", sha256)


# -- GC --------------------------------------------------------------------------------


def entry(name: str, size: int, used: float) -> CacheEntry:
    return CacheEntry(MODELS / name, "file", size, used)


def test_gc_removes_unreferenced_least_recently_used_first_and_never_a_pinned_one() -> None:
    entries = [
        entry("a.gguf", 10, used=300.0),
        entry("b.gguf", 20, used=100.0),
        entry("c.gguf", 30, used=200.0),
        entry("org/repo/w.safetensors", 40, used=50.0),
        entry("pinned.gguf", 50, used=1.0),
    ]
    refs = [
        Reference(MODELS / "org/repo", "vl"),  # a snapshot directory covers its files
        Reference(MODELS / "pinned.gguf", "agent", pinned=True),
    ]
    everything = plan_gc(entries, refs)
    assert [e.path.name for e in everything.remove] == ["b.gguf", "c.gguf", "a.gguf"]
    assert everything.freed_bytes == 60

    some = plan_gc(entries, refs, need_bytes=25)
    assert [e.path.name for e in some.remove] == ["b.gguf", "c.gguf"] and some.short_bytes == 0
    reasons = dict((e.path.name, why) for e, why in some.kept)
    assert reasons == {
        "w.safetensors": "declared: vl",
        "pinned.gguf": "pinned: agent",
        "a.gguf": "not needed",
    }

    aggressive = plan_gc(entries, refs, need_bytes=1000, spare_referenced=False)
    assert [e.path.name for e in aggressive.remove] == [
        "w.safetensors",
        "b.gguf",
        "c.gguf",
        "a.gguf",
    ]
    assert aggressive.short_bytes == 1000 - 100  # the pinned file never goes
    assert any(line.startswith("keep") and "pinned" in line for line in aggressive.lines())


# -- joins -----------------------------------------------------------------------------


async def test_joins_share_one_task_and_only_the_last_waiter_cancels_it() -> None:
    joins: Joins[str, int] = Joins()
    started = 0
    gate = asyncio.Event()

    async def work() -> int:
        nonlocal started
        started += 1
        await gate.wait()
        return 42

    shared, new = joins.start("k", work, name="w")
    again, second = joins.start("k", work, name="w")
    assert new and not second and again is shared
    first = asyncio.create_task(joins.wait(shared))
    other = asyncio.create_task(joins.wait(shared))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not shared.task.cancelled() and shared.waiters == 1
    gate.set()
    assert await other == 42 and started == 1 and "k" not in joins

    lone, _ = joins.start("j", work, name="w")
    gate.clear()
    waiter = asyncio.create_task(joins.wait(lone))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    with pytest.raises(asyncio.CancelledError):
        await lone.task
    await asyncio.sleep(0)  # the task's done callbacks
    assert "j" not in joins


# -- admission -------------------------------------------------------------------------


class FixedDisk:
    def __init__(self, free: int) -> None:
        self.free = free

    def free_bytes(self, path: Path) -> int:
        return self.free


def test_admission_counts_the_margin_and_what_pulls_in_flight_will_write() -> None:
    disk = FixedDisk(1000)
    admission = DiskAdmission(MODELS, disk, margin_bytes=100)
    first = admission.admit(600, "a")
    with pytest.raises(InsufficientDisk) as refused:
        admission.admit(400, "b")  # 1000 - 100 - 600 = 300 left
    assert refused.value.details["needed_bytes"] == 400
    assert refused.value.details["free_bytes"] == 1000
    assert refused.value.details["reserved_bytes"] == 600
    first.wrote(500)
    disk.free = 500  # what it wrote is gone from the disk and from its reservation
    second = admission.admit(300, "b")
    assert admission.reserved() == 100 + 300
    first.release()
    second.release()
    assert admission.reserved() == 0


# -- progress --------------------------------------------------------------------------


async def test_progress_has_rate_and_eta_and_ends_with_the_final_snapshot() -> None:
    clock = FakeClock()
    feed = ProgressFeed()
    meter = ProgressMeter(
        feed,
        PullProgress("m", "hf://o/r/f", "checking"),
        clock,
        asyncio.get_running_loop(),
        interval=0.0,
    )
    seen: list[PullProgress] = []
    reader = asyncio.create_task(_collect(feed, seen))
    meter.update(phase="downloading", bytes_total=1000, bytes_done=100, bytes_resumed=100)
    meter.add(100)
    clock.advance(1.0)
    meter.add(200)  # 300 bytes in the 1 s since the phase began (its first sample)
    snap = meter.snapshot()
    assert snap.bytes_done == 400 and snap.rate_bps == pytest.approx(300.0)
    assert snap.eta_s == pytest.approx(2.0) and snap.percent == pytest.approx(40.0)
    await asyncio.sleep(0)
    meter.update(phase="done", bytes_done=1000)
    await asyncio.wait_for(reader, 5)
    assert seen[-1].phase == "done" and seen[-1].details()["percent"] == 100.0


async def _collect(feed: ProgressFeed, into: list[PullProgress]) -> None:
    async for snapshot in feed.updates():
        into.append(snapshot)
