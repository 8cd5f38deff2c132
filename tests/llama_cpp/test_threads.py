"""Threads and OpenMP spin for the llama.cpp processes a worker starts: a new llama-server
beside the servers already on the machine, and the processes of a split model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.hardware.profile import CpuInfo
from shoal.llama_cpp.threads import (
    SPINCOUNT,
    ServerThreads,
    oversubscription,
    server_threads,
    spin_env,
    stage_threads,
)


@pytest.mark.parametrize(
    ("cores", "others", "configured", "threads", "oversubscribed"),
    [
        (2, [], None, 2, False),  # alone: every core
        (16, [], None, 16, False),
        (2, [2], None, 1, True),  # the box: the first took both cores
        (2, [2, 1], None, 1, True),
        (2, [1], None, 1, False),  # the first was given --threads 1: one core is left
        (8, [2, 2], None, 4, False),
        (8, [6], None, 2, False),
        (8, [9], None, 1, True),
        (1, [], None, 1, False),
        (2, [], 1, 1, False),  # --threads always wins
        (2, [], 4, 4, True),  # ... and is warned about when it is more than the cores
        (2, [2], 1, 1, True),
        (2, [1], 1, 1, False),
        (16, [4, 4], 8, 8, False),
    ],
)
def test_a_new_llama_server_takes_the_cores_left_unless_told(
    cores: int, others: list[int], configured: int | None, threads: int, oversubscribed: bool
) -> None:
    decided = server_threads(cores, others, configured)
    assert (decided.threads, decided.batch_threads) == (threads, threads)
    assert decided.oversubscribed is oversubscribed
    assert decided.configured is (configured is not None)
    assert (oversubscription(decided) is not None) is oversubscribed


@given(
    cores=st.integers(1, 256),
    others=st.lists(st.integers(1, 64), max_size=8),
    configured=st.none() | st.integers(1, 512),
)
def test_never_more_threads_than_free_cores_unless_told_or_none_is_free(
    cores: int, others: list[int], configured: int | None
) -> None:
    decided = server_threads(cores, others, configured)
    assert decided.threads >= 1 and decided.batch_threads == decided.threads
    if configured is not None:
        assert decided.threads == configured
    elif sum(others) < cores:
        assert decided.threads == cores - sum(others)  # all that is free, never more
        assert not decided.oversubscribed
    else:
        assert decided.threads == 1
        assert decided.oversubscribed


def test_the_warning_names_the_numbers_and_the_fix() -> None:
    warning = oversubscription(server_threads(2, [2, 1], None))
    assert warning is not None
    assert warning.startswith("3 llama.cpp server(s) on 2 usable cores compute with 4 threads")
    assert "(this llama-server 1, the others here 3)" in warning
    assert "--threads 1 for each of 3" in warning and "one worker per machine" in warning
    told = oversubscription(ServerThreads(4, 4, 2, (), configured=True))
    assert told is not None and "this llama-server 4 (--threads)" in told


def test_stages_take_the_workers_threads_else_one_per_physical_core() -> None:
    assert stage_threads(3, CpuInfo(model="x", logical_cores=16, physical_cores=8)) == 3
    assert stage_threads(None, CpuInfo(model="x", logical_cores=16, physical_cores=8)) == 8
    assert stage_threads(None, CpuInfo(model="x", logical_cores=4)) == 4
    assert stage_threads(None, CpuInfo(model="x", logical_cores=0, physical_cores=0)) == 1


def test_a_short_spin_unless_the_user_chose_the_openmp_wait() -> None:
    assert spin_env({"PATH": "/usr/bin"}) == {"GOMP_SPINCOUNT": str(SPINCOUNT)}
    assert spin_env({"GOMP_SPINCOUNT": "300000"}) == {}
    assert spin_env({"OMP_WAIT_POLICY": "active"}) == {}
