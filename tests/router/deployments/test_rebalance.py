"""rebalance: whether a candidate plan is worth moving a serving deployment to (tables)."""

from __future__ import annotations

import pytest

from shoal.router.deployments.placement import (
    Gpu,
    ModelProfile,
    Node,
    NoFit,
    Plan,
    Strategy,
    plan,
)
from shoal.router.deployments.rebalance import MIN_GAIN, Quality, better, quality, reclaimed

PROFILE = ModelProfile(10, (100,) * 10, (0,) * 10, 0, 0, 0)
"""Ten layers of 100 bytes each, nothing else."""


def planned(*nodes: Node) -> Plan:
    result = plan(PROFILE, nodes, 1, Strategy.PROPORTIONAL, headroom=0.0)
    assert isinstance(result, Plan), result
    return result


def cpu(name: str, free: int) -> Node:
    return Node(name, free)


def gpu_node(name: str, ram: int, vram: int) -> Node:
    return Node(name, ram, (Gpu("CUDA0", vram),))


NO_FIT = NoFit(needed_bytes=1000, available_bytes=500, shortfall_bytes=500, reason="short")


@pytest.mark.parametrize(
    ("serving", "now", "expected"),
    [
        # A third CPU worker: the fullest worker drops from 100 % to 67 %.
        ((cpu("a", 500), cpu("b", 500)), (cpu("a", 500), cpu("b", 500), cpu("c", 500)), "drops"),
        # A worker too small to take a share: the fullest stays as full.
        ((cpu("a", 500), cpu("b", 500)), (cpu("a", 500), cpu("b", 500), cpu("c", 50)), None),
        # Plenty of room already: 10 % to 7 % is below MIN_GAIN.
        ((cpu("a", 5000), cpu("b", 5000)), (cpu("a", 5000), cpu("b", 5000), cpu("c", 5000)), None),
        # The same workers: the same plan, nothing to do.
        ((cpu("a", 500), cpu("b", 500)), (cpu("a", 500), cpu("b", 500)), None),
        # A GPU worker's layers spilled to RAM; a second GPU worker takes them.
        (
            (gpu_node("a", 1000, 600),),
            (gpu_node("a", 1000, 600), gpu_node("b", 1000, 600)),
            "fewer layer(s) in the RAM",
        ),
        # Worker b's memory shrank under its shard since; c takes its layers.
        ((cpu("a", 500), cpu("b", 500)), (cpu("a", 500), cpu("b", 200), cpu("c", 800)), "over"),
    ],
)
def test_better_tables(
    serving: tuple[Node, ...], now: tuple[Node, ...], expected: str | None
) -> None:
    current = quality(planned(*serving), now)
    candidate = plan(PROFILE, now, 1, Strategy.PROPORTIONAL, headroom=0.0)
    why = better(current, candidate, now)
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why


def test_a_candidate_that_does_not_fit_is_never_better() -> None:
    current = Quality(spilled_layers=5, over_budget=("a",), peak_share=1.5)
    assert better(current, NO_FIT, [cpu("a", 100)]) is None


def test_more_spilled_layers_are_worse_whatever_else_improves() -> None:
    now = [gpu_node("a", 1000, 1000), cpu("b", 10_000)]
    current = Quality(spilled_layers=0, over_budget=("a",), peak_share=0.99)
    spilling = planned(gpu_node("a", 1000, 100))  # 9 layers in a's RAM
    assert quality(spilling, now).spilled_layers > 0
    assert better(current, spilling, now) is None


def test_a_candidate_over_budget_is_not_better() -> None:
    now = [cpu("a", 300), cpu("b", 300)]
    current = Quality(spilled_layers=0, over_budget=("a",), peak_share=2.0)
    over = planned(cpu("a", 500), cpu("b", 500))  # 500 bytes each, more than a and b offer
    assert quality(over, now).over_budget == ("a", "b")
    assert better(current, over, now) is None


def test_min_gain_is_the_threshold() -> None:
    now = [cpu("a", 1000), cpu("b", 1000), cpu("c", 1000)]
    candidate = planned(*now)  # 4, 3, 3 layers: the fullest holds 40 %
    at = Quality(spilled_layers=0, over_budget=(), peak_share=0.40 + MIN_GAIN)
    below = Quality(spilled_layers=0, over_budget=(), peak_share=0.40 + MIN_GAIN - 0.01)
    assert better(at, candidate, now) is not None
    assert better(below, candidate, now) is None


def test_quality_counts_a_missing_node_as_over_budget() -> None:
    serving = planned(cpu("a", 500), cpu("b", 500))
    q = quality(serving, [cpu("a", 500)])
    assert q.over_budget == ("b",) and q.peak_share == float("inf")


def test_reclaimed_gives_back_what_the_serving_plan_holds_up_to_what_was_free() -> None:
    serving = planned(cpu("a", 500), cpu("b", 1500))  # 3 and 7 layers: 300 and 700 bytes
    assert serving.layer_counts == (3, 7)
    # a shows its shard as used; b lost 1000 more to something else; c holds nothing of it.
    now = [cpu("a", 200), cpu("b", 500), cpu("c", 900)]
    assert [n.free_bytes for n in reclaimed(now, serving)] == [500, 1200, 900]


def test_reclaimed_never_takes_memory_away() -> None:
    serving = planned(cpu("a", 1000))
    assert reclaimed([cpu("a", 2000)], serving)[0].free_bytes == 2000


def test_reclaimed_gives_back_gpu_memory_per_device() -> None:
    serving = planned(gpu_node("a", 1000, 600))  # 6 layers on CUDA0, 4 in RAM
    now = [gpu_node("a", 600, 0)]
    [back] = reclaimed(now, serving)
    assert back.gpus[0].free_bytes == 600 and back.free_bytes == 1000
