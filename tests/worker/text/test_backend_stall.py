"""When the worker's llama-server is taken for hung while it runs jobs (``worker/text/stall.py``,
named apart from the router's ``test_stall.py``): a table, and the properties the
supervisor's probe loop relies on."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from shoal.worker.settings import DEFAULT_STALL_TIMEOUT_S as DEFAULT_TIMEOUT_S
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.stall import deadline, hung, probe_every

NOW = 100.0


@pytest.mark.parametrize(
    ("last_answer", "busy_since", "timeout", "expected"),
    [
        (89.0, 80.0, 10.0, True),  # jobs for 20 s, last answer 11 s ago
        (90.0, 80.0, 10.0, True),  # exactly the timeout
        (91.0, 80.0, 10.0, False),  # answered 9 s ago
        (50.0, 95.0, 10.0, False),  # a job arrived 5 s ago: silence counts from then
        (50.0, 89.0, 10.0, True),  # ... and 11 s ago, with no answer since
        (50.0, None, 10.0, False),  # no job holds it: the idle health check applies
        (50.0, 80.0, 0.0, False),  # turned off
    ],
)
def test_the_hang_rule(
    last_answer: float, busy_since: float | None, timeout: float, expected: bool
) -> None:
    assert hung(NOW, last_answer, busy_since, timeout) is expected


@given(st.floats(1.0, 600.0), st.floats(0.0, 1000.0), st.floats(0.0, 1.0))
def test_a_llama_server_that_answers_every_probe_is_never_hung(
    timeout: float, busy_for: float, late: float
) -> None:
    """Its last answer came to the last probe (``probe_every`` ago), however late within
    half the timeout: not hung, however long jobs have held it."""
    last_answer = NOW - probe_every(timeout, 10.0) - late * timeout / 2
    assert not hung(NOW, last_answer, NOW - busy_for, timeout)


@given(st.floats(1.0, 600.0), st.floats(0.0, 100.0), st.floats(0.0, 100.0))
def test_hung_exactly_from_the_deadline_on(
    timeout: float, last_answer: float, busy_since: float
) -> None:
    due = deadline(last_answer, busy_since, timeout)
    assert hung(due, last_answer, busy_since, timeout)
    assert not hung(due - 0.001, last_answer, busy_since, timeout)


def test_probes_come_four_times_a_timeout_never_slower_than_the_idle_check() -> None:
    assert probe_every(DEFAULT_TIMEOUT_S, 10.0) == pytest.approx(2.5)
    assert probe_every(4.0, 10.0) == pytest.approx(1.0)
    assert probe_every(120.0, 10.0) == pytest.approx(10.0)


def test_the_setting_is_off_or_at_least_a_second() -> None:
    assert WorkerSettings().backend_stall_timeout == DEFAULT_TIMEOUT_S <= 10.0
    assert WorkerSettings(backend_stall_timeout=0).backend_stall_timeout == 0
    with pytest.raises(ValidationError, match="must be 0 \\(off\\) or at least 1 s"):
        WorkerSettings(backend_stall_timeout=0.5)
    with pytest.raises(ValidationError):
        WorkerSettings(backend_stall_timeout=-1)
