"""When a worker that holds jobs is taken for frozen (``router/dispatch/stall.py``): a table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from shoal.router.dispatch.stall import frozen, next_check
from shoal.router.settings import RouterSettings

NOW = 100.0


@pytest.mark.parametrize(
    ("last_seen", "holds_jobs", "others", "timeout", "expected"),
    [
        (90.0, True, [99.0], 8.0, True),  # silent 10 s, another worker heard 1 s ago
        (95.0, True, [99.0], 8.0, False),  # silent 5 s: under the stall timeout
        (90.0, False, [99.0], 8.0, False),  # holds nothing: the heartbeat timeout applies
        (90.0, True, [], 8.0, False),  # the only worker: never (the router may be the stuck one)
        (90.0, True, [91.0], 8.0, False),  # everybody went quiet: not this worker's fault
        (90.0, True, [99.0], 0.0, False),  # turned off
    ],
)
def test_the_stall_rule(
    last_seen: float, holds_jobs: bool, others: list[float], timeout: float, expected: bool
) -> None:
    assert frozen(NOW, last_seen, holds_jobs, others, timeout) is expected


@given(
    st.floats(0.1, 30.0),
    st.floats(0.0, 100.0),
    st.lists(st.floats(0.0, 100.0), max_size=5),
)
def test_a_worker_heard_within_the_timeout_is_never_frozen(
    timeout: float, silent_for: float, others: list[float]
) -> None:
    """A live worker heartbeats more often than the stall timeout, so it never stalls."""
    last_seen = NOW - min(silent_for, timeout * 0.999)
    assert not frozen(NOW, last_seen, True, [NOW - o for o in others], timeout)


def test_the_watchdog_looks_again_when_the_silence_would_reach_the_timeout() -> None:
    assert next_check(NOW, 97.0, 8.0) == pytest.approx(5.0)
    assert next_check(NOW, 90.0, 8.0) == pytest.approx(2.0)  # overdue: a quarter later


def test_a_stall_timeout_at_or_under_the_heartbeat_interval_is_refused() -> None:
    with pytest.raises(ValidationError, match="must be above --heartbeat-interval"):
        RouterSettings(stall_timeout=5, heartbeat_interval=5)
    assert RouterSettings(stall_timeout=0, heartbeat_interval=5).stall_timeout == 0
    assert RouterSettings().stall_timeout > RouterSettings().heartbeat_interval
