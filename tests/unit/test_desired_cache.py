"""The desired state's one owner (issue 27, item 3; issue 41, item 7): ``DesiredCache``
merges its sources — the config dir's files first, the operator's custom resources after
them — keeps the last good of what fails validation, and tells its listeners which keys
each change touched; the reconciler and GitOps share the daemon's one, the operator's CR
source is one of its sources; the API re-reads only the files a write names.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.daemon.gitops import GitOps
from controller.operator.source import CrSource
from controller.reconcile.apply import apply_to_config
from controller.reconcile.reconciler import Reconciler
from controller.spec.desired import DesiredCache
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.sources import DesiredChange
from tests.unit.manager_fixtures import Harness, model_spec, slot_spec


def port_of(name: str) -> int:
    """A port of the slot's own, the same at every declare (``slot_spec`` counts)."""
    return 18100 + int(name[1:]) if name[1:].isdigit() else 18000 + ord(name[0])


def declare(config: Path, *names: str) -> None:
    slots = [slot_spec(n, autoload=False, port=port_of(n)) for n in names]
    apply_to_config(
        DesiredState(
            stacks=("t",),
            models={s.model_id: model_spec(s.model_id) for s in slots if s.model_id},
            slots={s.name: DesiredSlot(spec=s, stack="t") for s in slots},
        ),
        config,
        prune=True,
    )


def test_a_refresh_publishes_the_keys_it_changed(tmp_path: Path) -> None:
    config = tmp_path / "config"
    declare(config, "a")
    cache = DesiredCache(config)
    assert set(cache.snapshot.slots) == {"a"}
    heard: list[DesiredChange] = []
    cache.subscribe(heard.append)
    declare(config, "a", "b")
    assert set(cache.snapshot.slots) == {"a"}  # published only by a refresh
    fresh = cache.read_fresh()
    assert set(fresh.slots) == {"a", "b"} and not heard  # a writer's read: nobody told
    published = cache.refresh()
    assert set(published.slots) == {"a", "b"}
    assert heard == [DesiredChange.of(slots={"b"}, models={"b-m"})]  # only what changed
    assert cache.snapshot is published
    assert cache.refresh() is published and len(heard) == 1  # nothing changed: nobody told


def test_a_write_re_reads_only_the_files_it_names(tmp_path: Path) -> None:
    config = tmp_path / "config"
    declare(config, *(f"s{i}" for i in range(20)))
    cache = DesiredCache(config)
    cache.snapshot  # noqa: B018  (the first look reads)
    heard: list[DesiredChange] = []
    cache.subscribe(heard.append)
    path = config / "slots" / "s3.toml"
    path.write_text(path.read_text().replace("autoload = false", "autoload = false\npriority = 70"))
    (config / "slots" / "s4.toml").write_text("this is not toml [[[\n")  # not named: unseen
    cache.refresh_slots(["s3"])
    assert heard == [DesiredChange.of(slots={"s3"})]
    assert cache.snapshot.slots["s3"].spec.priority == 70 and not cache.snapshot.errors
    (config / "slots" / "s3.toml").unlink()
    cache.refresh_slots(["s3"])
    assert "s3" not in cache.snapshot.slots and heard[-1] == DesiredChange.of(slots={"s3"})
    cache.refresh()  # the whole dir: s4's broken file is seen (its last good spec kept)
    assert "s4" in cache.snapshot.slots and cache.broken == {"s4"}
    assert [p.file for p in cache.snapshot.errors] == [str(config / "slots" / "s4.toml")]


def test_a_broken_slot_file_keeps_its_last_good_spec(tmp_path: Path) -> None:
    config = tmp_path / "config"
    declare(config, "a", "b")
    cache = DesiredCache(config)
    good = cache.snapshot.slots["b"]
    (config / "slots" / "b.toml").write_text("this is not toml [[[\n")
    cache.refresh()
    assert cache.snapshot.slots["b"] == good  # still declared: not unloaded, not pruned
    assert cache.broken == {"b"}
    declare(config, "a", "b")
    cache.refresh()
    assert cache.broken == set()


async def test_the_reconciler_gitops_and_the_cr_source_share_one_owner(tmp_path: Path) -> None:
    config = tmp_path / "config"
    declare(config, "a")
    cache = DesiredCache(config)
    h = Harness(tmp_path)
    reconciler = Reconciler(h.manager, config, desired=cache)
    gitops = GitOps(tmp_path / "stacks", config, lambda _: None, desired=cache)
    source = CrSource()
    cache.add_source(source)
    assert reconciler.desired is gitops.desired is cache
    declare(config, "a", "b")
    await asyncio.gather(reconciler.refresh_async(), reconciler.refresh_async())
    assert set(reconciler.snapshot.slots) == {"a", "b"}  # the cache's snapshot, published
    assert set(h.manager.models) == {"a-m", "b-m"}  # its listener: the manager's catalogue
    assert reconciler.queue.is_dirty("b") and not reconciler.queue.is_dirty("a")
    assert not cache.synced  # the source has not had its first listing
    spec = {"provider": "demo", "model": {"default": "cr-m"}, "device": "cpu", "port": 18555}
    meta = {"namespace": "ns", "generation": 1, "creationTimestamp": "1"}
    source.prime(
        {
            "Model": [{"metadata": {"name": "cr-m", **meta}, "spec": {"source": "demo://m"}}],
            "Slot": [{"metadata": {"name": "c", **meta}, "spec": spec}],
        }
    )
    assert cache.synced and set(reconciler.snapshot.slots) == {"a", "b", "c"}
    assert reconciler.snapshot.slots["c"].stack == "kubernetes" and "cr-m" in h.manager.models
    assert reconciler.queue.is_dirty("c")
