"""Worker references (a name or an id) resolved to ids: one pure function, table-tested."""

from __future__ import annotations

import pytest

from shoal.protocol.ids import WorkerId
from shoal.router.dispatch.worker_names import UnknownWorkers, resolve_workers
from shoal.router.errors import BadRequest

CONNECTED = {
    WorkerId("box1-582e20"): "box1",
    WorkerId("box2-879166"): "box2",
    WorkerId("twin-aaaaaa"): "twin",
    WorkerId("twin-bbbbbb"): "twin",
    WorkerId("box1"): "odd",  # an id that is also another worker's name
}


@pytest.mark.parametrize(
    ("refs", "ids"),
    [
        (["box1-582e20"], ["box1-582e20"]),  # ids work as they always did
        (["box2"], ["box2-879166"]),  # a name one worker has
        (["box2", "box1-582e20"], ["box2-879166", "box1-582e20"]),  # mixed, order kept
        (["twin-bbbbbb", "twin-aaaaaa"], ["twin-bbbbbb", "twin-aaaaaa"]),  # a shared name's ids
        (["box1"], ["box1"]),  # an id wins over a name
        (["odd"], ["box1"]),
    ],
)
def test_names_and_ids_resolve_to_ids_in_order(refs: list[str], ids: list[str]) -> None:
    assert resolve_workers(refs, CONNECTED) == ids


@pytest.mark.parametrize(
    ("refs", "message"),
    [
        ([], "workers is empty: name at least one worker"),
        (
            ["box2", "twin"],
            "2 connected workers are named 'twin': twin-aaaaaa, twin-bbbbbb; "
            "name the one you mean by its id.",
        ),
        (["twin", "nobody"], "named 'twin'"),  # a shared name is said before an unknown one
        (["box2", "box2-879166"], "workers names box2 (box2-879166) more than once"),
        (["box2", "box2"], "more than once; name each worker once."),
        (["box3", "box2", "box3"], "workers names 'box3' more than once"),  # unknown ones too
    ],
)
def test_refused_references_say_what_to_do(refs: list[str], message: str) -> None:
    with pytest.raises(BadRequest) as caught:
        resolve_workers(refs, CONNECTED)
    assert not isinstance(caught.value, UnknownWorkers)
    assert message in caught.value.message
    assert caught.value.param == "workers" and caught.value.status == 400


@pytest.mark.parametrize(
    ("refs", "connected", "unknown", "listed"),
    [
        (
            ["box2", "box3", "w0-582e20"],
            CONNECTED,
            ("box3", "w0-582e20"),
            "connected: box1 (box1-582e20), box2 (box2-879166), odd (box1), "
            "twin (twin-aaaaaa), twin (twin-bbbbbb). Name workers by their --name or their id",
        ),
        (["box1"], {}, ("box1",), "connected: none."),
    ],
)
def test_unknown_references_list_the_connected_workers(
    refs: list[str], connected: dict[WorkerId, str], unknown: tuple[str, ...], listed: str
) -> None:
    with pytest.raises(UnknownWorkers) as caught:
        resolve_workers(refs, connected, param="worker")
    assert caught.value.refs == unknown
    assert listed in caught.value.message
    assert caught.value.param == "worker" and caught.value.status == 400
