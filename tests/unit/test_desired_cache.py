"""The desired state's one owner (issue 27, item 3): ``DesiredCache`` reads the config dir,
keeps the last good of what fails validation, publishes, tells its listeners; the
reconciler, GitOps and the operator's CR source share the daemon's one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.daemon.gitops import GitOps
from controller.operator.source import CrSource
from controller.reconcile.apply import apply_to_config
from controller.reconcile.reconciler import Reconciler
from controller.spec.configdir import ConfigSnapshot
from controller.spec.desired import DesiredCache
from controller.spec.loader import DesiredSlot, DesiredState
from tests.unit.manager_fixtures import Harness, model_spec, slot_spec


def declare(config: Path, *names: str) -> None:
    slots = [slot_spec(n, autoload=False) for n in names]
    apply_to_config(
        DesiredState(
            stacks=("t",),
            models={s.model_id: model_spec(s.model_id) for s in slots if s.model_id},
            slots={s.name: DesiredSlot(spec=s, stack="t") for s in slots},
        ),
        config,
        prune=True,
    )


def test_a_refresh_publishes_and_tells_every_listener(tmp_path: Path) -> None:
    config = tmp_path / "config"
    declare(config, "a")
    cache = DesiredCache(config)
    assert set(cache.snapshot.slots) == {"a"}
    heard: list[ConfigSnapshot] = []
    cache.subscribe(heard.append)
    declare(config, "a", "b")
    assert set(cache.snapshot.slots) == {"a"}  # published only by a refresh
    fresh = cache.read_fresh()
    assert set(fresh.slots) == {"a", "b"} and not heard  # a writer's read: nobody told
    published = cache.refresh()
    assert set(published.slots) == {"a", "b"} and heard == [published]
    assert cache.snapshot is published


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
    source = CrSource(config, desired=cache)
    assert reconciler.desired is gitops.desired is source.desired is cache
    declare(config, "a", "b")
    await asyncio.gather(reconciler.refresh_async(), reconciler.refresh_async())
    assert set(reconciler.snapshot.slots) == {"a", "b"}  # the cache's snapshot, published
    assert set(h.manager.models) == {"a-m", "b-m"}  # its listener: the manager's catalogue
