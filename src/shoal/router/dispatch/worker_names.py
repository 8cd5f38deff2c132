"""Workers named in the API: by the id they registered with, or by their ``--name`` (pure).

A worker's id is its name plus a random suffix made when the worker process starts
(``protocol.ids.new_worker_id``): it stays the same across reconnects and changes when the
process restarts. Users know the names they gave; ``resolve_workers`` turns what they wrote
into ids, the same way for every route that takes workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shoal.protocol.ids import WorkerId
from shoal.router.errors import BadRequest


class UnknownWorkers(BadRequest):
    """Some references name no connected worker (``refs``: those, as written)."""

    def __init__(self, refs: Sequence[str], connected: Mapping[WorkerId, str], param: str):
        named = ", ".join(repr(r) for r in refs)
        listed = ", ".join(f"{name} ({i})" for i, name in sorted(connected.items(), key=_by_name))
        super().__init__(
            f"No connected worker has the name or id {named}; connected: {listed or 'none'}. "
            "Name workers by their --name or their id "
            "(GET /api/v1/workers lists both).",
            param=param,
        )
        self.refs = tuple(refs)


def resolve_workers(
    refs: Sequence[str], connected: Mapping[WorkerId, str], param: str = "workers"
) -> list[WorkerId]:
    """The ids of the workers ``refs`` name, in order. ``connected``: each connected
    worker's id -> name.

    A reference is a worker's id, else a name exactly one connected worker has. Raises
    ``BadRequest`` (with ``param``) for an empty list, a name several workers share (their
    ids listed) or a worker named twice, checked in that order; then ``UnknownWorkers``.
    """
    if not refs:
        raise BadRequest(
            f"{param} is empty: name at least one worker, or leave it out for every worker.",
            param=param,
        )
    by_name: dict[str, list[WorkerId]] = {}
    for worker_id, name in sorted(connected.items()):
        by_name.setdefault(name, []).append(worker_id)
    found: dict[str, WorkerId] = {}
    for ref in refs:
        if ref in connected:
            found[ref] = WorkerId(ref)
            continue
        ids = by_name.get(ref, [])
        if len(ids) > 1:
            raise BadRequest(
                f"{len(ids)} connected workers are named {ref!r}: {', '.join(ids)}; "
                "name the one you mean by its id.",
                param=param,
            )
        if ids:
            found[ref] = ids[0]
    keys = [found.get(r, r) for r in refs]  # unknown ones as written
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        named = (f"{connected[WorkerId(k)]} ({k})" if k in connected else repr(k) for k in twice)
        raise BadRequest(
            f"{param} names {', '.join(named)} more than once; name each worker once.",
            param=param,
        )
    unknown = [r for r in refs if r not in found]
    if unknown:
        raise UnknownWorkers(unknown, connected, param)
    return [found[r] for r in refs]


def _by_name(item: tuple[WorkerId, str]) -> tuple[str, str]:
    return item[1], item[0]
