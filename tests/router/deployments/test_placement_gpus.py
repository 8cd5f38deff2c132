"""plan over nodes with GPUs: tables, and properties checked against brute force over every
device of every node (the CPU-only cases are ``test_placement``'s)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.router.deployments.placement import (
    CPU,
    Gpu,
    ModelProfile,
    Node,
    NoFit,
    Plan,
    Strategy,
    plan,
)

GIB = 2**30
MIB = 2**20
PROP = Strategy.PROPORTIONAL
BAL = Strategy.BALANCED


def profile(n: int, weight: int = 100, kv: int = 0, head: int = 0, tail: int = 0) -> ModelProfile:
    return ModelProfile(n, (weight,) * n, (kv,) * n, head, tail, 0)


def where(result: Plan) -> list[tuple[str, str, int, int]]:
    """``(node, device, first, last)`` of every device that holds something, in order."""
    return [
        (s.node_id, d.device, d.first_layer, d.last_layer) for s in result.shards for d in s.devices
    ]


def place(p: ModelProfile, nodes: list[Node], strategy: Strategy = PROP) -> Plan:
    result = plan(p, nodes, 1, strategy, headroom=0.0)
    assert isinstance(result, Plan), result
    return result


# --- tables -----------------------------------------------------------------------------


def test_the_seeds_example_70b_over_24_16_and_24_gb_gpus_fits_with_the_heads_gpu() -> None:
    """Llama 3.1 70B Q4_K_M's shape (80 layers, 43.2 GB) at ctx 4096 with the router's
    compute allowance: over three GPU workers the head's own GPU takes the first layers and
    the model fits; with the head offering only its 16 GiB of RAM (the old rule) it did not."""
    n, kv_per_token = 80, 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, f16
    embd, output = 591_000_000, 862_000_000
    layer = (43_164_757_634 - embd - output) // n
    compute = (43_164_757_634 + n * kv_per_token * 4096) // 10 + 64 * MIB  # profile.py's rule
    model = ModelProfile(n, (layer,) * n, (kv_per_token,) * n, embd, output, compute)
    gpus = [
        Node("box1", 16 * GIB, (Gpu("CUDA0", int(23.5 * GIB)),)),
        Node("box2", 16 * GIB, (Gpu("CUDA0", int(15.6 * GIB)),)),
        Node("box3", 16 * GIB, (Gpu("CUDA0", int(23.5 * GIB)),)),
    ]
    for strategy in Strategy:
        result = plan(model, gpus, 4096, strategy)
        assert isinstance(result, Plan), result
        assert where(result) == [
            ("box1", CPU, 0, -1),  # the token embedding, in the head's RAM
            ("box1", "CUDA0", 0, 30),
            ("box2", "CUDA0", 31, 49),
            ("box3", "CUDA0", 50, 79),
        ]
        head_ram = result.shards[0].devices[0]
        assert head_ram.weight_bytes == embd and head_ram.n_layers == 0
        assert all(d.margin_bytes >= 0.1 * d.free_bytes for s in result.shards for d in s.devices)
    # The old rule's nodes: the head's RAM, each stage's GPU memory.
    old = [Node("box1", 16 * GIB), Node("box2", int(15.6 * GIB)), Node("box3", int(23.5 * GIB))]
    assert isinstance(plan(model, old, 4096), NoFit)


@pytest.mark.parametrize(
    ("nodes", "strategy", "expected"),
    [
        # A GPU head: its layers on its GPU, nothing in its (larger) RAM.
        (
            [Node("a", 5000, (Gpu("CUDA0", 1000),)), Node("b", 1000)],
            PROP,
            [("a", "CUDA0", 0, 4), ("b", CPU, 5, 9)],
        ),
        # Two GPUs on one node: both take layers, in order, by free memory.
        (
            [Node("a", 9000, (Gpu("CUDA0", 1200), Gpu("CUDA1", 600))), Node("b", 0, ())],
            PROP,
            [("a", "CUDA0", 0, 6), ("a", "CUDA1", 7, 9)],
        ),
        (
            [Node("a", 9000, (Gpu("CUDA0", 1200), Gpu("CUDA1", 600)))],
            BAL,
            [("a", "CUDA0", 0, 4), ("a", "CUDA1", 5, 9)],
        ),
        # The head's GPU is too small: the head's RAM takes the first layers, as few as it
        # must (llama.cpp keeps the layers -ngl leaves behind on the CPU: the first ones).
        (
            [Node("a", 5000, (Gpu("CUDA0", 300),)), Node("b", 0, (Gpu("Vulkan0", 500),))],
            PROP,
            [("a", CPU, 0, 1), ("a", "CUDA0", 2, 4), ("b", "Vulkan0", 5, 9)],
        ),
        (
            [Node("a", 5000, (Gpu("CUDA0", 300),)), Node("b", 0, (Gpu("Vulkan0", 500),))],
            BAL,
            [("a", CPU, 0, 1), ("a", "CUDA0", 2, 4), ("b", "Vulkan0", 5, 9)],
        ),
        # A stage's RAM spills too, before its GPU; balanced spills no more than it must.
        (
            [Node("a", 0, (Gpu("CUDA0", 700),)), Node("b", 900, (Gpu("CUDA0", 100),))],
            BAL,
            [("a", "CUDA0", 0, 6), ("b", CPU, 7, 8), ("b", "CUDA0", 9, 9)],
        ),
        # A GPU node and a CPU node: the CPU node's RAM is an ordinary device.
        (
            [Node("a", 9000, (Gpu("ROCm0", 400),)), Node("b", 600)],
            PROP,
            [("a", "ROCm0", 0, 3), ("b", CPU, 4, 9)],
        ),
    ],
)
def test_devices_and_their_layers(
    nodes: list[Node], strategy: Strategy, expected: list[tuple[str, str, int, int]]
) -> None:
    assert where(place(profile(10), nodes, strategy)) == expected


def test_the_embedding_stays_in_the_heads_ram_and_must_fit_there() -> None:
    p = profile(4, head=50)
    result = place(p, [Node("a", 60, (Gpu("CUDA0", 1000),)), Node("b", 0)])
    assert where(result) == [("a", CPU, 0, -1), ("a", "CUDA0", 0, 3)]
    head = result.shards[0]
    assert (head.weight_bytes, head.total_bytes, head.free_bytes) == (450, 450, 1060)
    assert [d.total_bytes for d in head.devices] == [50, 400]
    # 40 bytes of RAM cannot hold the embedding: a is no head, b is.
    result = place(p, [Node("a", 40, (Gpu("CUDA0", 1000),)), Node("b", 1000)])
    assert where(result) == [("b", CPU, 0, 3)]
    assert result.shards[0].weight_bytes == 450


def test_the_output_layer_goes_with_the_last_device() -> None:
    result = place(profile(4, tail=30), [Node("a", 0, (Gpu("CUDA0", 300), Gpu("CUDA1", 300)))])
    cuda0, cuda1 = result.shards[0].devices
    assert (cuda0.n_layers, cuda1.n_layers) == (2, 2)
    assert (cuda0.weight_bytes, cuda1.weight_bytes) == (200, 230)


def test_no_fit_counts_gpus_and_ram() -> None:
    result = plan(profile(10), [Node("a", 150, (Gpu("CUDA0", 500),))], 1, headroom=0.0)
    assert isinstance(result, NoFit)
    assert (result.needed_bytes, result.available_bytes, result.shortfall_bytes) == (1000, 650, 350)
    assert "350 B short" in result.reason


def test_nonsense_gpus_raise() -> None:
    for make in (
        lambda: Gpu("", 1),
        lambda: Gpu("CPU", 1),
        lambda: Gpu("CUDA0,CUDA1", 1),
        lambda: Gpu("CUDA0", -1),
        lambda: Node("a", 1, (Gpu("CUDA0", 1), Gpu("CUDA0", 2))),
    ):
        with pytest.raises(ValueError):
            make()


# --- properties against brute force -----------------------------------------------------


@dataclass(frozen=True)
class Slot:
    node: int
    device: str
    free: int
    spill: bool


@dataclass(frozen=True)
class Case:
    profile: ModelProfile
    nodes: tuple[Node, ...]
    ctx: int
    headroom: float

    @property
    def slots(self) -> list[Slot]:
        out = []
        for i, node in enumerate(self.nodes):
            out.append(Slot(i, CPU, node.free_bytes, bool(node.gpus)))
            out += [Slot(i, g.name, g.free_bytes, False) for g in node.gpus]
        return out


def needs(case: Case, counts: Sequence[int]) -> list[int]:
    """Every device's bytes when the devices hold ``counts`` layers each, written out plainly:
    the embedding in the RAM of the node that holds layer 0, the output layer on the device
    that holds the last one."""
    p, slots = case.profile, case.slots
    out = [0] * len(slots)
    start = 0
    for j, c in enumerate(counts):
        if c:
            layers = range(start, start + c)
            out[j] += sum(
                p.layer_weight_bytes[k] + case.ctx * p.kv_bytes_per_token[k] for k in layers
            )
            out[j] += p.compute_bytes
            out[j] += p.tail_bytes if start + c == p.n_layers else 0
            if start == 0:
                ram = next(k for k, s in enumerate(slots) if s.node == slots[j].node)
                out[ram] += p.head_bytes
        start += c
    return out


def fits(case: Case, counts: Sequence[int]) -> bool:
    return all(
        need <= math.floor(s.free * (1 - case.headroom))
        for need, s in zip(needs(case, counts), case.slots, strict=True)
    )


def splits(n: int, m: int) -> Iterator[tuple[int, ...]]:
    for bars in itertools.combinations_with_replacement(range(n + 1), m - 1):
        cuts = (0, *bars, n)
        yield tuple(b - a for a, b in itertools.pairwise(cuts))


def valid(case: Case) -> list[tuple[int, ...]]:
    return [c for c in splits(case.profile.n_layers, len(case.slots)) if fits(case, c)]


def spilled(case: Case, counts: Sequence[int]) -> int:
    return sum(c for c, s in zip(counts, case.slots, strict=True) if s.spill)


def ordinary(case: Case, counts: Sequence[int]) -> list[tuple[int, Slot]]:
    return [(c, s) for c, s in zip(counts, case.slots, strict=True) if not s.spill]


def deviation(case: Case, counts: Sequence[int]) -> float:
    pairs = ordinary(case, counts)
    total = sum(s.free for _, s in pairs)
    n = case.profile.n_layers
    return 0.0 if total == 0 else sum((c - n * s.free / total) ** 2 for c, s in pairs)


def counts_of(case: Case, result: Plan) -> tuple[int, ...]:
    got = {(s.node_id, d.device): d.n_layers for s in result.shards for d in s.devices}
    return tuple(got.get((case.nodes[s.node].id, s.device), 0) for s in case.slots)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, 6))
    size = st.integers(0, 100)
    prof = ModelProfile(
        n,
        tuple(draw(st.lists(size, min_size=n, max_size=n))),
        tuple(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))),
        draw(size),
        draw(size),
        draw(st.integers(0, 50)),
    )
    nodes = []
    for i in range(draw(st.integers(1, 3))):
        gpus = tuple(
            Gpu(f"CUDA{k}", draw(st.integers(0, 900))) for k in range(draw(st.integers(0, 2)))
        )
        nodes.append(Node(chr(ord("a") + i), draw(st.integers(0, 900)), gpus))
    ctx = draw(st.integers(1, 20))
    return Case(prof, tuple(nodes), ctx, draw(st.sampled_from([0.0, 0.1, 0.25])))


def check_plan(case: Case, result: Plan) -> None:
    counts = counts_of(case, result)
    assert sum(counts) == case.profile.n_layers
    assert fits(case, counts)
    need = needs(case, counts)
    slots = case.slots
    order = [(case.nodes[s.node].id, s.device) for s in slots]
    listed = [(s.node_id, d.device) for s in result.shards for d in s.devices]
    assert listed == sorted(listed, key=order.index)  # llama.cpp's order, each device once
    layer = 0
    for shard in result.shards:
        assert shard.first_layer == layer
        for d in shard.devices:
            j = order.index((shard.node_id, d.device))
            assert d.total_bytes == need[j] == d.weight_bytes + d.kv_bytes + d.compute_bytes
            assert d.free_bytes == slots[j].free and d.margin_bytes == d.free_bytes - need[j]
            assert d.n_layers or (d.device == CPU and shard.role == "head" and layer == 0)
            if d.n_layers:
                assert d.first_layer == layer
                layer = d.last_layer + 1
        assert shard.last_layer == layer - 1
        assert shard.total_bytes == sum(d.total_bytes for d in shard.devices)
    assert layer == case.profile.n_layers


@settings(max_examples=300, deadline=None)
@given(cases())
def test_proportional_spills_least_then_follows_free_memory(case: Case) -> None:
    result = plan(case.profile, case.nodes, case.ctx, PROP, headroom=case.headroom)
    ok = valid(case)
    assert isinstance(result, Plan) == bool(ok)
    if isinstance(result, Plan):
        check_plan(case, result)
        counts = counts_of(case, result)
        least = min(spilled(case, c) for c in ok)
        assert spilled(case, counts) == least
        best = min(deviation(case, c) for c in ok if spilled(case, c) == least)
        assert deviation(case, counts) == pytest.approx(best)
    else:
        assert result.shortfall_bytes > 0
        assert result.shortfall_bytes >= result.needed_bytes - result.available_bytes


@settings(max_examples=300, deadline=None)
@given(cases())
def test_balanced_spills_least_then_minimises_the_largest_share(case: Case) -> None:
    result = plan(case.profile, case.nodes, case.ctx, BAL, headroom=case.headroom)
    ok = valid(case)
    assert isinstance(result, Plan) == bool(ok)
    if isinstance(result, Plan):
        check_plan(case, result)
        counts = counts_of(case, result)
        least = min(spilled(case, c) for c in ok)
        assert spilled(case, counts) == least

        def largest(c: Sequence[int]) -> int:
            return max((x for x, _ in ordinary(case, c)), default=0)

        fewest = [c for c in ok if spilled(case, c) == least]
        assert largest(counts) == min(largest(c) for c in fewest)
        squares = [
            sum(x * x for x, _ in ordinary(case, c))
            for c in fewest
            if largest(c) == largest(counts)
        ]
        assert sum(x * x for x, _ in ordinary(case, counts)) == min(squares)
