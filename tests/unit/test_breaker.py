"""The crash-loop breaker (SPEC §1): backoff 1, 2, 4 ... capped, retry_after_s, block, reset."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.model.errors import SlotCrashLooping
from controller.scheduling.breaker import Breaker


def test_fresh_breaker_allows_a_load() -> None:
    b = Breaker()
    b.check("s", now=0.0, max_failures=5)
    assert b.retry_after(0.0) == 0.0


def test_backoff_doubles_from_one_second() -> None:
    b = Breaker()
    assert [b.record_failure(0.0, "boom") for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    assert b.failures == 6
    assert b.last_error == "boom"


def test_backoff_is_capped() -> None:
    b = Breaker(base_s=1.0, cap_s=300.0)
    backoffs = [b.record_failure(0.0, "x") for _ in range(12)]
    assert backoffs[8] == 256.0
    assert backoffs[9:] == [300.0, 300.0, 300.0]
    assert max(backoffs) == 300.0


def test_custom_base_and_cap() -> None:
    b = Breaker(base_s=0.5, cap_s=3.0)
    assert [b.record_failure(0.0, "x") for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_load_inside_the_window_is_refused_with_retry_after() -> None:
    b = Breaker()
    b.record_failure(100.0, "exit 1")
    with pytest.raises(SlotCrashLooping) as err:
        b.check("s", now=100.25, max_failures=5)
    assert err.value.retry_after_s == pytest.approx(0.75)
    assert err.value.details["retry_after_s"] == pytest.approx(0.75)
    assert err.value.details["blocked"] is False
    assert err.value.details["failures"] == 1
    assert err.value.code == "slot.crash_looping"
    assert b.retry_after(100.25) == pytest.approx(0.75)
    b.check("s", now=101.0, max_failures=5)  # the window has passed
    assert b.retry_after(101.0) == 0.0


def test_each_failure_extends_the_window_from_its_own_time() -> None:
    b = Breaker()
    b.record_failure(0.0, "x")  # blocked until 1
    b.check("s", now=1.0, max_failures=5)
    b.record_failure(1.0, "x")  # blocked until 3
    with pytest.raises(SlotCrashLooping) as err:
        b.check("s", now=2.0, max_failures=5)
    assert err.value.retry_after_s == pytest.approx(1.0)
    b.check("s", now=3.0, max_failures=5)
    b.record_failure(3.0, "x")  # blocked until 7
    assert b.retry_after(3.0) == 4.0


def test_open_after_max_failures_for_the_cap_then_half_open() -> None:
    b = Breaker()
    for i in range(3):
        assert b.record_failure(float(i), "oom", max_failures=3) == (300.0 if i == 2 else 2.0**i)
    with pytest.raises(SlotCrashLooping) as err:
        b.check("s", now=2.0 + 299.0, max_failures=3)
    assert err.value.details["blocked"] is True
    assert err.value.details["failures"] == 3
    assert err.value.retry_after_s == pytest.approx(1.0)
    assert "oom" in err.value.message
    assert "next try in 1s" in err.value.message
    assert "slotctl slot reset s" in err.value.message
    # Open long enough: exactly one try goes through (half-open) ...
    b.check("s", now=302.0, max_failures=3)
    # ... and a failure opens it for another whole cap.
    assert b.record_failure(302.0, "oom", max_failures=3) == 300.0
    with pytest.raises(SlotCrashLooping):
        b.check("s", now=303.0, max_failures=3)
    b.check("s", now=602.0, max_failures=3)


def test_reset_clears_everything() -> None:
    b = Breaker()
    for _ in range(5):
        b.record_failure(10.0, "x")
    b.reset()
    assert (b.failures, b.blocked_until, b.last_error) == (0, 0.0, "")
    b.check("s", now=10.0, max_failures=5)
    assert b.record_failure(10.0, "x") == 1.0  # the sequence starts over


@given(
    failures=st.integers(min_value=1, max_value=40),
    base=st.floats(min_value=0.01, max_value=10.0),
    cap=st.floats(min_value=0.01, max_value=1000.0),
)
def test_backoff_is_monotonic_and_bounded(failures: int, base: float, cap: float) -> None:
    b = Breaker(base_s=base, cap_s=cap)
    backoffs = [b.record_failure(0.0, "x") for _ in range(failures)]
    assert all(0 < x <= cap for x in backoffs)
    assert backoffs == sorted(backoffs)
    assert backoffs[0] == min(base, cap)
