"""Which workers a deployment is planned over, and what memory each offers (no I/O)."""

from __future__ import annotations

from shoal.router.deployments.placement import Gpu, Node
from shoal.router.dispatch.worker_names import UnknownWorkers, resolve_workers
from shoal.router.dispatch.workers import Registry, WorkerConnection
from shoal.router.errors import BadRequest


def deployment_nodes(registry: Registry, wanted: tuple[str, ...] | None) -> list[Node] | str:
    """The planner's nodes for a deployment over this router's ready workers (``wanted``: ids
    or names, in shard order; None: every worker that can run shards, by name), or why there
    are none."""
    workers = [w for w in registry if w.ready]
    if wanted is not None:
        try:
            ids = resolve_workers(wanted, registry.names())
        except UnknownWorkers as exc:  # they may connect later
            return f"waiting for worker(s) {', '.join(exc.refs)}"
        except BadRequest as exc:  # a shared name, or one named twice: the user must redeploy
            return exc.message
        ready = {w.id: w for w in workers}
        waiting = [ref for ref, i in zip(wanted, ids, strict=True) if i not in ready]
        if waiting:
            return f"waiting for worker(s) {', '.join(waiting)}"
        workers = [ready[i] for i in ids]
        unable = [f"{w.name}: {w.no_shards}" for w in workers if w.no_shards]
        if unable:
            return "; ".join(unable)
    else:
        workers = sorted((w for w in workers if not w.no_shards), key=lambda w: (w.name, w.id))
    if not workers:
        return "waiting for workers that can run parts of split models"
    return shard_nodes(workers)


def shard_nodes(workers: list[WorkerConnection]) -> list[Node]:
    """Planner nodes for ``workers`` in shard order: the first is the head, the rest stages.

    Every worker offers the same, head or stage: its free RAM and the GPUs its llama.cpp
    build drives (``Register.shard_devices``: llama.cpp's names, free memory). The head runs
    its first layers on its own GPUs (``--device`` puts them before the stages'), a stage
    on its ``ggml-rpc-server``'s; the planner spills layers to a GPU worker's RAM only when
    the model does not fit otherwise. A GPU that shares the RAM (unified memory) offers its
    part of it: the RAM offers what is left.
    """
    return [node_of(w) for w in workers]


def node_of(w: WorkerConnection) -> Node:
    gpus = tuple(Gpu(d.name, d.free_bytes) for d in w.shard_devices)
    shared = sum(d.free_bytes for d in w.shard_devices if d.unified_memory)
    ram = w.ram_available_bytes
    if w.shard_ram_bytes is not None:  # the worker offers split models no more (--shard-ram)
        ram = min(ram, w.shard_ram_bytes)
    return Node(id=w.id, free_bytes=max(0, ram - shared), gpus=gpus)


def planning_nodes(registry: Registry, wanted: list[str] | None) -> list[Node]:
    """The nodes a dry-run plan is made over: ``wanted`` workers (ids or names), else every
    worker that can run parts of split models. Raises ``BadRequest`` naming what is wrong."""
    workers: dict[str, WorkerConnection] = {w.id: w for w in registry}
    if not workers:
        raise BadRequest("No worker is connected; start workers before planning.")
    if wanted is None:
        ids = sorted(i for i, w in workers.items() if not w.no_shards)
        if not ids:
            reasons = "; ".join(f"{w.name}: {w.no_shards}" for w in workers.values())
            raise BadRequest(f"No connected worker can run parts of split models ({reasons}).")
        return shard_nodes([workers[i] for i in ids])
    chosen = [workers[i] for i in resolve_workers(wanted, registry.names())]
    unable = [f"{w.name}: {w.no_shards}" for w in chosen if w.no_shards]
    if unable:
        raise BadRequest("; ".join(unable), param="workers")
    return shard_nodes(chosen)
