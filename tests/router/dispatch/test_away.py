"""check_served: a model that is away for a while (a split model starting, degraded or
draining) gets a 503 with Retry-After, even while a worker still serves it."""

from __future__ import annotations

import pytest

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import Endpoint, ModelInfo
from shoal.router.dispatch.answers import check_served, never_away
from shoal.router.dispatch.workers import Registry
from shoal.router.errors import ModelNotFound, Unavailable
from socketless import worker_connection

M = ModelName("split")


def serving_registry() -> Registry:
    registry = Registry()
    registry.add(worker_connection("head", [ModelInfo(name=M, endpoints=(Endpoint.CHAT,))]))
    return registry


def test_a_draining_split_model_refuses_new_requests_while_its_head_still_serves() -> None:
    with pytest.raises(Unavailable) as caught:
        check_served(M, Endpoint.CHAT, serving_registry(), [], lambda m: f"{m} is draining")
    assert "draining" in caught.value.message and "Retry-After" in caught.value.headers


def test_a_served_model_that_is_not_away_is_taken() -> None:
    check_served(M, Endpoint.CHAT, serving_registry(), [], never_away)


def test_a_model_nobody_serves_and_not_away_is_not_found() -> None:
    with pytest.raises(ModelNotFound):
        check_served(M, Endpoint.CHAT, Registry(), [], never_away)
