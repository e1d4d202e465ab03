"""The fair wait queue (issue 23): weights between classes, round-robin between keys of a
class, FIFO inside a key, aging so that nothing starves, class limits."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.scheduling.fairqueue import ClassSpec, FairQueue, QueueRefusal, Waiter

CLASSES = {
    "interactive": ClassSpec("interactive", 8.0),
    "batch": ClassSpec("batch", 1.0),
}


def queue(age_s: float = math.inf, **classes: ClassSpec) -> FairQueue[int]:
    return FairQueue(classes or CLASSES, age_s=age_s)


def test_weights_between_backlogged_classes() -> None:
    q = queue()
    for i in range(200):
        q.push(Waiter("ui", "interactive", 0.0, i))
        q.push(Waiter("ci", "batch", 0.0, i))
    served = Counter(q.pop(0.0).cls for _ in range(90))  # type: ignore[union-attr]
    assert served == {"interactive": 80, "batch": 10}


def test_one_keys_flood_does_not_starve_another_key_of_its_class() -> None:
    q = queue()
    for i in range(50):
        q.push(Waiter("flood", "batch", 0.0, i))
    q.push(Waiter("small", "batch", 0.0, 999))
    first = [q.pop(0.0) for _ in range(3)]
    assert [w.key for w in first if w] == ["flood", "small", "flood"]


def test_an_idle_class_gets_no_credit_for_the_time_it_did_not_wait() -> None:
    q = queue()
    for i in range(100):
        q.push(Waiter("ci", "batch", 0.0, i))
    for _ in range(50):  # batch alone: its pass runs far ahead... of an idle class's
        q.pop(0.0)
    q.push(Waiter("ui", "interactive", 0.0, 1))
    q.push(Waiter("ui", "interactive", 0.0, 2))
    order = [q.pop(0.0).cls for _ in range(3)]  # type: ignore[union-attr]
    # interactive joins at batch's pass: its weight's share from now (its two waiters
    # first), not 50 turns of credit
    assert order == ["interactive", "interactive", "batch"]
    q.push(Waiter("ui", "interactive", 0.0, 3))
    for _ in range(8):
        q.push(Waiter("ui", "interactive", 0.0, 4))
    order = [q.pop(0.0).cls for _ in range(10)]  # type: ignore[union-attr]
    assert Counter(order) == {"interactive": 9, "batch": 1}


def test_aging_serves_the_oldest_first_once_it_waited_too_long() -> None:
    q = queue(age_s=10.0)
    q.push(Waiter("ci", "batch", 0.0, 1))
    for i in range(20):
        q.push(Waiter("ui", "interactive", 5.0, i))
    assert q.pop(6.0).cls == "interactive"  # type: ignore[union-attr]
    aged = q.pop(11.0)
    assert aged is not None and aged.key == "ci" and aged.item == 1


def test_a_class_limit_refuses_beyond_it_and_remove_frees_a_place() -> None:
    q = queue(interactive=ClassSpec("interactive", 4.0), batch=ClassSpec("batch", 1.0, limit=2))
    a, b, c = (Waiter("ci", "batch", 0.0, i) for i in range(3))
    assert q.push(a) is None and q.push(b) is None
    assert q.push(c) == QueueRefusal("batch", 2, 2)
    assert q.push(Waiter("ui", "interactive", 0.0, 0)) is None  # other classes unaffected
    assert q.remove(a) and not q.remove(a)
    assert q.push(c) is None and len(q) == 3
    assert [w.item for w in q if w.cls == "batch"] == [1, 2]


def test_an_empty_queue_and_unknown_classes() -> None:
    q = queue()
    assert q.pop(0.0) is None and len(q) == 0
    with pytest.raises(KeyError):
        q.push(Waiter("k", "nope", 0.0, 0))
    with pytest.raises(ValueError):
        FairQueue({})


_ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "push", "push", "pop", "remove"]),
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["interactive", "batch", "bulk"]),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, age=st.sampled_from([3.0, 10.0, math.inf]))
def test_queue_properties(ops: list[tuple[str, str, str]], age: float) -> None:
    """FIFO inside a key; a waiter older than ``age`` is never passed by a younger one;
    every waiter is served or removed once the queue is drained."""
    q: FairQueue[int] = FairQueue({**CLASSES, "bulk": ClassSpec("bulk", 0.5, limit=10)}, age_s=age)
    now, pushed, served, removed = 0.0, [], [], []
    for n, (op, key, cls) in enumerate(ops):
        now += 1.0
        if op == "push":
            waiter = Waiter(key, cls, now, n)
            if q.push(waiter) is None:
                pushed.append(waiter)
        elif op == "pop":
            _check_pop(q, now, served)
        else:
            waiting = [w for w in pushed if not w.served and not w.removed and w.key == key]
            if waiting and q.remove(waiting[0]):
                removed.append(waiting[0])
    while len(q):
        now += 1.0
        _check_pop(q, now, served)
    assert {w.item for w in served} | {w.item for w in removed} == {w.item for w in pushed}
    assert not {w.item for w in served} & {w.item for w in removed}
    for key in "abc":  # FIFO inside a key (and class)
        for cls in ("interactive", "batch", "bulk"):
            mine = [w.seq for w in served if w.key == key and w.cls == cls]
            assert mine == sorted(mine), (key, cls)


def _check_pop(q: FairQueue[int], now: float, served: list[Waiter[int]]) -> None:
    before = list(q)
    waiter = q.pop(now)
    if waiter is None:
        assert not before
        return
    served.append(waiter)
    older = [w for w in before if w.seq < waiter.seq and now - w.since > q.age_s]
    assert not older, (waiter, older)  # an aged waiter is never passed


def test_weights_hold_over_many_keys() -> None:
    """Three classes backlogged by several keys each: shares within one turn of the weights."""
    weights = {"interactive": 8.0, "batch": 1.0, "bulk": 3.0}
    q: FairQueue[int] = FairQueue({n: ClassSpec(n, w) for n, w in weights.items()})
    for i in range(2000):
        for cls in weights:
            q.push(Waiter(f"{cls}-{i % 7}", cls, 0.0, i))
    served = Counter(q.pop(0.0).cls for _ in range(1200))  # type: ignore[union-attr]
    total = sum(weights.values())
    for cls, weight in weights.items():
        assert abs(served[cls] - 1200 * weight / total) <= 2, served
