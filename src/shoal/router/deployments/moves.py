"""Moving a serving deployment to a better plan, in the router: which workers joined, whether
the plan over the workers there are now is worth a move (``rebalance.better``, the pure
decision), and the answers the head still runs, which finish before the switch.

The controller (``controller``) owns the state machine and asks: a worker that registers is
``registered`` (one whose backend is not ready yet joins when it is: ``became_ready``), which
sets each serving deployment's ``rebalance_at`` to the end of the quiet period, pushed on by
every later join; at that time the controller asks ``judge``, and while it drains,
``in_flight``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from shoal.models.gguf_info import GGUFInfo
from shoal.protocol.ids import WorkerId
from shoal.router.deployments.deployment import Deployment, DeploymentState
from shoal.router.deployments.nodes import deployment_nodes
from shoal.router.deployments.placement import Plan
from shoal.router.deployments.profile import plan_for
from shoal.router.deployments.rebalance import better, layout, quality, reclaimed
from shoal.router.dispatch.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)


class Moves:
    def __init__(
        self,
        registry: Registry,
        info: Callable[[Deployment], GGUFInfo | None],
        quiet_s: float,
    ) -> None:
        """``info``: a deployment's model's structure as the controller last found it."""
        self.registry = registry
        self.info = info
        self.quiet_s = quiet_s
        self.joining: set[WorkerId] = set()
        """Workers that registered before their backend was ready: they join when it is."""

    def registered(self, worker: WorkerConnection, items: Iterable[Deployment]) -> None:
        if worker.ready:
            self._joined(worker, items)
        else:
            self.joining.add(worker.id)

    def became_ready(self, worker: WorkerConnection, items: Iterable[Deployment]) -> None:
        if worker.id in self.joining:
            self.joining.discard(worker.id)
            self._joined(worker, items)

    def lost(self, worker: WorkerConnection) -> None:
        self.joining.discard(worker.id)

    def _joined(self, worker: WorkerConnection, items: Iterable[Deployment]) -> None:
        quiet_until = time.monotonic() + self.quiet_s
        for d in items:
            if (
                d.state is DeploymentState.SERVING
                and d.spec.workers is None  # pinned to its workers: a newcomer cannot help
                and d.shard_of(worker.id) is None
            ):
                d.rebalance_at = quiet_until  # a later join pushes it on
                log.debug(
                    "deployment %s: worker %s joined; judging a rebalance in %g s",
                    d.name,
                    worker.id,
                    self.quiet_s,
                )

    def judge(self, d: Deployment) -> str | None:
        """Why serving ``d`` should move to a plan over the workers there are now, or None."""
        assert d.plan is not None
        nodes = deployment_nodes(self.registry, d.spec.workers)
        if isinstance(nodes, str):
            log.debug("deployment %s: no rebalance: %s", d.name, nodes)
            return None
        there = {n.id for n in nodes}
        if away := [s.node_id for s in d.plan.shards if s.node_id not in there]:
            # e.g. its own llama-server unloaded after idling: a plan without it is no better
            log.debug("deployment %s: no rebalance: %s not ready", d.name, ", ".join(away))
            return None
        nodes = reclaimed(nodes, d.plan)
        info = self.info(d)
        if info is None:  # not found now: it keeps serving; a redeploy would say why
            log.debug("deployment %s: no rebalance: its model is not found", d.name)
            return None
        new = plan_for(info, nodes, d.spec.ctx, d.spec.strategy).result
        why = None
        if not isinstance(new, Plan) or layout(new) != layout(d.plan):
            why = better(quality(d.plan, nodes), new, nodes)
        if why is None:
            log.debug("deployment %s: the workers that joined would not improve its plan", d.name)
        return why

    def in_flight(self, d: Deployment) -> int:
        """The answers of ``d`` its head's worker runs now."""
        head = self.registry.get(WorkerId(d.head.worker_id)) if d.head is not None else None
        if head is None:
            return 0
        return sum(1 for job in head.running.values() if job.model == d.name)
