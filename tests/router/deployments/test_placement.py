"""plan: tables of cases, and properties checked against brute force on small instances."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.router.deployments.placement import ModelProfile, Node, NoFit, Plan, Strategy, plan

GIB = 1024**3
PROP = Strategy.PROPORTIONAL
BAL = Strategy.BALANCED


def profile(
    n: int,
    weight: int = 100,
    kv: int = 0,
    head: int = 0,
    tail: int = 0,
    compute: int = 0,
) -> ModelProfile:
    """A model whose layers are all alike."""
    return ModelProfile(n, (weight,) * n, (kv,) * n, head, tail, compute)


def nodes(*free: int) -> list[Node]:
    return [Node(chr(ord("a") + i), f) for i, f in enumerate(free)]


def place(
    p: ModelProfile,
    free: Sequence[int],
    ctx: int = 1,
    strategy: Strategy = PROP,
    headroom: float = 0.0,
) -> Plan:
    result = plan(p, nodes(*free), ctx, strategy, headroom=headroom)
    assert isinstance(result, Plan), result
    return result


# --- tables -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "n", "strategy", "counts"),
    [
        ((1000,), 4, PROP, (4,)),  # one node fits all
        ((1000,), 4, BAL, (4,)),
        ((10_000, 10_000), 8, PROP, (4, 4)),  # two equal nodes split evenly
        ((10_000, 10_000), 8, BAL, (4, 4)),
        ((1000, 2000), 9, PROP, (3, 6)),  # 1:2 memory gives 1:2 layers
        ((1000, 2000), 12, PROP, (4, 8)),
        ((1000, 2000, 3000), 12, PROP, (2, 4, 6)),
        ((1000, 3000), 8, PROP, (2, 6)),  # unequal nodes: the strategies differ
        ((1000, 3000), 8, BAL, (4, 4)),
        ((300, 3000), 8, BAL, (3, 5)),  # balanced as far as the small node allows
        ((5000, 5000, 5000), 10, BAL, (4, 3, 3)),  # ties: the extra layer near the head
        ((5000, 5000, 5000), 2, BAL, (1, 1)),  # fewer layers than nodes: the third is left out
        ((1000, 1000, 1000), 1, PROP, (1,)),
    ],
)
def test_layer_counts(
    free: tuple[int, ...], n: int, strategy: Strategy, counts: tuple[int, ...]
) -> None:
    result = place(profile(n), free, strategy=strategy)
    assert result.layer_counts == counts
    assert result.strategy is strategy


def test_balanced_minimises_the_largest_share_before_spreading() -> None:
    # (4, 1, 1) and (3, 0, 3) spread equally (squares add to 18), but (3, 0, 3) has the
    # smaller largest share. Node b (35 bytes) has room for one of the small layers only.
    p = ModelProfile(6, (46, 74, 51, 92, 15, 1), (0,) * 6, 78, 26, 3)
    result = place(p, (546, 35, 166), strategy=BAL)
    assert result.layer_counts == (3, 3)
    assert [s.node_id for s in result.shards] == ["a", "c"]


def test_head_bytes_shrink_the_heads_share() -> None:
    # The proportional target is 5:5, but the token embedding leaves room for 3 layers.
    result = place(profile(10, head=700), (1000, 1000))
    assert result.layer_counts == (3, 7)
    head, tail = result.shards
    assert (head.weight_bytes, head.total_bytes, head.margin_bytes) == (1000, 1000, 0)
    assert (tail.weight_bytes, tail.total_bytes, tail.margin_bytes) == (700, 700, 300)


def test_head_and_tail_bytes_on_the_right_nodes() -> None:
    p = profile(6, weight=100, kv=2, head=30, tail=50, compute=7)
    result = place(p, (10_000, 10_000, 10_000), ctx=10)
    assert [s.role for s in result.shards] == ["head", "stage", "tail"]
    assert [(s.first_layer, s.last_layer) for s in result.shards] == [(0, 1), (2, 3), (4, 5)]
    assert [s.weight_bytes for s in result.shards] == [230, 200, 250]
    assert [s.kv_bytes for s in result.shards] == [40, 40, 40]
    assert [s.compute_bytes for s in result.shards] == [7, 7, 7]
    assert [s.total_bytes for s in result.shards] == [277, 247, 297]
    assert [s.margin_bytes for s in result.shards] == [9723, 9753, 9703]


def test_a_single_node_is_the_head_and_holds_everything() -> None:
    result = place(profile(4, head=30, tail=50, compute=7), (1000,))
    (only,) = result.shards
    assert (only.role, only.first_layer, only.last_layer) == ("head", 0, 3)
    assert only.weight_bytes == 400 + 30 + 50
    assert only.total_bytes == 487


def test_a_node_too_small_for_anything_is_left_out() -> None:
    result = place(profile(4, head=10, compute=50), (40, 1000, 1000))
    assert [s.node_id for s in result.shards] == ["b", "c"]
    assert [s.role for s in result.shards] == ["head", "tail"]
    assert result.shards[0].weight_bytes == 2 * 100 + 10  # the new head has the embedding


def test_headroom_is_kept() -> None:
    p = profile(9)
    assert isinstance(plan(p, nodes(1000), 1), Plan)  # 900 fits in 1000 * 0.9
    assert isinstance(plan(p, nodes(999), 1), NoFit)
    assert isinstance(plan(p, nodes(900), 1, headroom=0.0), Plan)


def test_kv_scales_with_ctx() -> None:
    p = profile(2, weight=100, kv=3)
    assert place(p, (10_000,), ctx=1000).shards[0].kv_bytes == 6000
    assert isinstance(plan(p, nodes(6000), 1000, headroom=0.0), NoFit)


@pytest.mark.parametrize(
    ("counts_free", "n", "tensor_split"),
    [
        ((1000,), 4, (5,)),
        ((10_000, 10_000), 8, (4, 5)),
        ((1000, 2000, 3000), 12, (2, 4, 7)),
    ],
)
def test_tensor_split_counts_the_output_layer_on_the_last_node(
    counts_free: tuple[int, ...], n: int, tensor_split: tuple[int, ...]
) -> None:
    result = place(profile(n), counts_free)
    assert result.tensor_split == tensor_split
    assert llama_cpp_split(result.tensor_split, n) == result.layer_counts


def llama_cpp_split(tensor_split: Sequence[int], n_layer: int) -> tuple[int, ...]:
    """llama.cpp's layer split with ``-ngl all`` (``load_tensors``), repeating layers only."""
    cumulative = list(itertools.accumulate(tensor_split))
    splits = [c / cumulative[-1] for c in cumulative]
    counts = [0] * len(tensor_split)
    for il in range(n_layer):
        value = il / (n_layer + 1)
        counts[next(d for d, s in enumerate(splits) if s > value)] += 1  # upper_bound
    return tuple(counts)


def test_to_json() -> None:
    result = place(profile(4, head=1, tail=2), (1000, 1000), ctx=8)
    data = json.loads(result.to_json())
    assert data["ctx"] == 8
    assert data["strategy"] == "proportional"
    assert data["tensor_split"] == [2, 3]
    assert [s["node_id"] for s in data["shards"]] == ["a", "b"]
    assert data["shards"][1] == {
        "node_id": "b",
        "role": "tail",
        "first_layer": 2,
        "last_layer": 3,
        "weight_bytes": 202,
        "kv_bytes": 0,
        "compute_bytes": 0,
        "total_bytes": 202,
        "free_bytes": 1000,
        "margin_bytes": 798,
        "devices": [  # a node without GPUs: all on its CPU
            {
                "device": "CPU",
                "first_layer": 2,
                "last_layer": 3,
                "weight_bytes": 202,
                "kv_bytes": 0,
                "compute_bytes": 0,
                "total_bytes": 202,
                "free_bytes": 1000,
                "margin_bytes": 798,
            }
        ],
    }


@pytest.mark.parametrize(
    ("p", "free", "needed", "available", "shortfall"),
    [
        (profile(10), (900,), 1000, 900, 100),  # one node
        (profile(10, compute=10), (400, 400), 1020, 800, 220),  # two nodes, both full
        (profile(4, head=50, tail=50), (200, 200), 500, 400, 100),
        # 300 bytes of layers and 300 usable, but no node takes two 100-byte layers.
        (profile(3), (150, 150), 300, 300, 50),
    ],
)
def test_no_fit(
    p: ModelProfile, free: tuple[int, ...], needed: int, available: int, shortfall: int
) -> None:
    for strategy in Strategy:
        result = plan(p, nodes(*free), 1, strategy, headroom=0.0)
        assert isinstance(result, NoFit)
        assert (result.needed_bytes, result.available_bytes, result.shortfall_bytes) == (
            needed,
            available,
            shortfall,
        )


def test_no_fit_reason_tells_what_to_do() -> None:
    p = profile(32, weight=GIB // 2, kv=64 * 1024, compute=512 * 1024**2)
    result = plan(p, nodes(8 * GIB), 8192)
    assert isinstance(result, NoFit)
    assert result.shortfall_bytes == result.needed_bytes - result.available_bytes
    assert "needs 32.50 GiB" in result.reason
    assert "7.20 GiB" in result.reason  # usable after 10% headroom
    assert "25.30 GiB short" in result.reason
    assert "16.00 GiB KV cache" in result.reason
    for option in ("Add a worker", "lower ctx", "smaller quantization"):
        assert option in result.reason
    small = plan(profile(3, weight=100 * 1024**2), nodes(*(150 * 1024**2,) * 2), 1, headroom=0)
    assert isinstance(small, NoFit)
    assert "50.0 MiB short" in small.reason
    assert "whole layer" in small.reason


@pytest.mark.parametrize(
    "make",
    [
        lambda: ModelProfile(0, (), (), 0, 0, 0),
        lambda: ModelProfile(2, (1,), (1, 1), 0, 0, 0),
        lambda: ModelProfile(2, (1, 1), (1,), 0, 0, 0),
        lambda: ModelProfile(1, (-1,), (1,), 0, 0, 0),
        lambda: ModelProfile(1, (1,), (-1,), 0, 0, 0),
        lambda: ModelProfile(1, (1,), (1,), -1, 0, 0),
        lambda: ModelProfile(1, (1,), (1,), 0, -1, 0),
        lambda: ModelProfile(1, (1,), (1,), 0, 0, -1),
        lambda: Node("a", -1),
        lambda: Node("", 1),
        lambda: plan(profile(1), [], 1),
        lambda: plan(profile(1), nodes(100), 0),
        lambda: plan(profile(1), [Node("a", 100), Node("a", 100)], 1),
        lambda: plan(profile(1), nodes(100), 1, headroom=1.0),
        lambda: plan(profile(1), nodes(100), 1, headroom=-0.1),
        lambda: plan(profile(1), nodes(100), 1, headroom=math.nan),
    ],
)
def test_nonsense_input_raises(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


# --- properties against brute force -----------------------------------------------------


@dataclass(frozen=True)
class Case:
    profile: ModelProfile
    nodes: tuple[Node, ...]
    ctx: int
    headroom: float

    def budget(self, i: int) -> float:
        return self.nodes[i].free_bytes * (1 - self.headroom)


def need(case: Case, counts: Sequence[int], i: int) -> int:
    """Node ``i``'s bytes when the nodes hold ``counts`` layers each, written out plainly."""
    if counts[i] == 0:
        return 0
    p = case.profile
    start = sum(counts[:i])
    layers = range(start, start + counts[i])
    used = [j for j, c in enumerate(counts) if c > 0]
    total = sum(p.layer_weight_bytes[k] + case.ctx * p.kv_bytes_per_token[k] for k in layers)
    total += p.compute_bytes
    total += p.head_bytes if i == used[0] else 0
    total += p.tail_bytes if i == used[-1] else 0
    return total


def splits(n: int, m: int) -> Iterator[tuple[int, ...]]:
    """Every way to give ``m`` nodes, in order, ``n`` layers (zero allowed)."""
    for bars in itertools.combinations_with_replacement(range(n + 1), m - 1):
        cuts = (0, *bars, n)
        yield tuple(b - a for a, b in itertools.pairwise(cuts))


def fits(case: Case, counts: Sequence[int]) -> bool:
    return all(need(case, counts, i) <= case.budget(i) for i in range(len(counts)))


def valid_splits(case: Case) -> list[tuple[int, ...]]:
    return [c for c in splits(case.profile.n_layers, len(case.nodes)) if fits(case, c)]


def counts_of(case: Case, result: Plan) -> tuple[int, ...]:
    by_id = {s.node_id: s.n_layers for s in result.shards}
    return tuple(by_id.get(node.id, 0) for node in case.nodes)


def deviation(case: Case, counts: Sequence[int]) -> float:
    total = sum(node.free_bytes for node in case.nodes)
    n = case.profile.n_layers
    if total == 0:
        return 0.0
    return sum(
        (c - n * node.free_bytes / total) ** 2 for c, node in zip(counts, case.nodes, strict=True)
    )


@st.composite
def cases(draw: st.DrawFn, max_layers: int = 8, max_nodes: int = 3) -> Case:
    n = draw(st.integers(1, max_layers))
    size = st.integers(0, 100)
    prof = ModelProfile(
        n,
        tuple(draw(st.lists(size, min_size=n, max_size=n))),
        tuple(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))),
        draw(size),
        draw(size),
        draw(st.integers(0, 50)),
    )
    frees = draw(st.lists(st.integers(0, 1200), min_size=1, max_size=max_nodes))
    ctx = draw(st.integers(1, 20))
    headroom = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5]))
    return Case(prof, tuple(nodes(*frees)), ctx, headroom)


def run(case: Case, strategy: Strategy) -> Plan | NoFit:
    return plan(case.profile, case.nodes, case.ctx, strategy, headroom=case.headroom)


def check_plan(case: Case, result: Plan) -> None:
    shards = result.shards
    assert shards, "a plan holds at least one shard"
    assert shards[0].first_layer == 0
    assert shards[-1].last_layer == case.profile.n_layers - 1
    for before, after in itertools.pairwise(shards):
        assert after.first_layer == before.last_layer + 1  # contiguous, each layer once
    order = [node.id for node in case.nodes]
    positions = [order.index(s.node_id) for s in shards]
    assert positions == sorted(set(positions))  # node order, each node at most once
    roles = [s.role for s in shards]
    assert roles == (
        ["head"] if len(shards) == 1 else ["head", *["stage"] * (len(shards) - 2), "tail"]
    )
    counts = counts_of(case, result)
    for i, s in zip(positions, shards, strict=True):
        assert s.n_layers >= 1
        assert s.total_bytes == s.weight_bytes + s.kv_bytes + s.compute_bytes
        assert s.total_bytes == need(case, counts, i)
        assert s.free_bytes == case.nodes[i].free_bytes
        assert s.margin_bytes == s.free_bytes - s.total_bytes
        assert s.total_bytes <= s.free_bytes * (1 - case.headroom)
    assert sum(result.layer_counts) == case.profile.n_layers
    assert result.tensor_split == (*result.layer_counts[:-1], result.layer_counts[-1] + 1)
    assert llama_cpp_split(result.tensor_split, case.profile.n_layers) == result.layer_counts
    assert result.ctx == case.ctx


def check_no_fit(case: Case, result: NoFit) -> None:
    assert valid_splits(case) == []  # truly nothing fits
    least_overflow = min(
        sum(max(0, need(case, c, i) - math.floor(case.budget(i))) for i in range(len(case.nodes)))
        for c in splits(case.profile.n_layers, len(case.nodes))
    )
    assert result.shortfall_bytes == least_overflow > 0
    assert result.shortfall_bytes >= result.needed_bytes - result.available_bytes
    assert result.available_bytes == sum(math.floor(case.budget(i)) for i in range(len(case.nodes)))
    assert "short" in result.reason


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from(Strategy))
def test_plan_is_valid_or_nothing_fits(case: Case, strategy: Strategy) -> None:
    result = run(case, strategy)
    if isinstance(result, Plan):
        check_plan(case, result)
        assert result.strategy is strategy
    else:
        check_no_fit(case, result)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_balanced_minimises_the_largest_share(case: Case) -> None:
    result = run(case, BAL)
    valid = valid_splits(case)
    assert isinstance(result, Plan) == bool(valid)
    if isinstance(result, Plan):
        assert max(result.layer_counts) == min(max(c) for c in valid)
        best_spread = min(
            sum(x * x for x in c) for c in valid if max(c) == max(result.layer_counts)
        )
        assert sum(x * x for x in counts_of(case, result)) == best_spread


@settings(max_examples=200, deadline=None)
@given(cases())
def test_proportional_is_as_close_to_free_memory_as_capacity_allows(case: Case) -> None:
    result = run(case, PROP)
    valid = valid_splits(case)
    assert isinstance(result, Plan) == bool(valid)
    if isinstance(result, Plan):
        best = min(deviation(case, c) for c in valid)
        assert deviation(case, counts_of(case, result)) == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(cases(max_layers=64, max_nodes=6), st.sampled_from(Strategy))
def test_larger_plans_are_valid(case: Case, strategy: Strategy) -> None:
    result = run(case, strategy)
    if isinstance(result, Plan):
        check_plan(case, result)
    else:
        assert result.shortfall_bytes > 0
        assert result.shortfall_bytes >= result.needed_bytes - result.available_bytes
