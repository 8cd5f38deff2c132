"""The per-model views (``router/dispatch/model_views.py``) against the full recomputation over
every worker, through any sequence of workers joining, leaving and changing: they cannot drift."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from shoal.router.dispatch.workers import ConnState, Registry, WorkerConnection
from socketless import worker_connection

NAMES = [ModelName(n) for n in ("a", "b", "c")]
WORKERS = ["w0", "w1", "w2", "w3"]

model_infos = st.builds(
    ModelInfo,
    name=st.sampled_from(NAMES),
    endpoints=st.lists(st.sampled_from(list(Endpoint)), max_size=3, unique=True).map(tuple),
    context_length=st.sampled_from([None, 512, 2048]),
    resident_bytes=st.sampled_from([None, 1 << 30, 2 << 30]),
    load_seconds=st.sampled_from([None, 0.5, 3.0]),
    state=st.sampled_from([None, *BackendState]),
)
models = st.lists(model_infos, max_size=3).map(tuple)
ops = st.one_of(
    st.tuples(st.just("join"), st.sampled_from(WORKERS), models),
    st.tuples(st.just("leave"), st.sampled_from(WORKERS)),
    st.tuples(st.just("models"), st.sampled_from(WORKERS), models),
    st.tuples(st.just("state"), st.sampled_from(WORKERS), st.sampled_from(list(BackendState))),
    st.tuples(st.just("close"), st.sampled_from(WORKERS)),
)


def apply(registry: Registry, op: tuple[object, ...]) -> None:
    kind, worker_id = op[0], str(op[1])
    worker = registry.get(worker_id)
    if kind == "join":
        joined = worker_connection(worker_id, op[2])
        joined.connected_at = 1000.0 + len(registry) * 1.5
        registry.add(joined)  # (a reconnect under the same id replaces the old one)
    elif worker is None:
        return
    elif kind == "leave":
        registry.remove(worker)
    elif kind == "models":
        worker.set_models(op[2])
    elif kind == "state":
        worker.set_backend_state(op[2], "test", None)
    elif kind == "close" and worker.conn_state is ConnState.ACTIVE:
        worker.move(ConnState.CLOSED, "test")  # (then it leaves, as ``WorkerSide.on_lost``)
        registry.remove(worker)


def check(registry: Registry) -> None:
    """Every view equals what walking every worker gives (what the routes did before)."""
    workers: list[WorkerConnection] = list(registry)
    pairs = [(w, m) for w in workers for m in w.models]
    assert set(registry.model_names()) == {m.name for _, m in pairs}
    assert registry.ready() == sum(1 for w in workers if w.ready)
    for name in NAMES:
        mine = [(w, m) for w, m in pairs if m.name == name]
        view = registry.view(name)
        found = Counter((w.id, m.model_dump_json()) for w, m in registry.model_info(name))
        assert found == Counter((w.id, m.model_dump_json()) for w, m in mine), name
        if not mine:
            assert view is None
            continue
        assert view is not None
        assert view.states == Counter(m.state or w.backend_state for w, m in mine)
        assert view.endpoints == Counter(e for _, m in mine for e in m.endpoints)
        assert view.context == Counter(m.context_length for _, m in mine)
        sizes = Counter(m.resident_bytes for _, m in mine if m.resident_bytes is not None)
        assert view.resident_bytes == sizes
        times = Counter(m.load_seconds for _, m in mine if m.load_seconds is not None)
        assert view.load_seconds == times
        assert min(view.created) == int(min(w.connected_at for w, _ in mine))
        assert view.entries() == len(mine)
        for endpoint in Endpoint:
            serving = {w.id for w in workers if (name, endpoint) in w.served}
            assert {w.id for w in registry.serving(name, endpoint)} == serving
            contexts = Counter(m.context_length for _, m in mine if endpoint in m.endpoints)
            assert view.contexts.get(endpoint, Counter()) == contexts


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=25))
def test_the_views_equal_the_full_recomputation(steps: list[tuple[object, ...]]) -> None:
    registry = Registry()
    for op in steps:
        apply(registry, op)
        check(registry)


def test_a_worker_that_left_no_longer_changes_the_views() -> None:
    registry = Registry()
    info = ModelInfo(name=NAMES[0], endpoints=(Endpoint.CHAT,))
    gone = worker_connection("gone", [info])
    registry.add(gone)
    registry.remove(gone)
    gone.set_backend_state(BackendState.LOADING, "late", None)  # a frame after it left
    gone.set_models((info,))
    assert registry.view(NAMES[0]) is None and registry.ready() == 0
