"""Stored responses and the follow-ups that name them (the Responses API's ``store: true`` and
``previous_response_id``).

llama-server keeps no conversation (it refuses ``previous_response_id``), so the router does:
a response asked for with ``store: true`` is kept (``response_store.py``) with the whole
conversation that made it, its input items (those of the responses before it included) and
its output items. A follow-up naming it is sent on as one stateless request whose ``input`` is
that conversation followed by the follow-up's own input, so the worker gets everything (and
the scheduler, which routes by the request's content, sends it to the worker whose slot holds
the conversation so far). As OpenAI's API does, a follow-up does not inherit the earlier
``instructions`` or tools. A response is only read, continued or deleted with the key that
created it; for any other key it does not exist (404).

The functions here are pure; ``prepare`` and ``Keeper`` do the store's I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from shoal.router.errors import NotFound
from shoal.router.responses.store.interface import ResponseStore, StoredResponse

log = logging.getLogger(__name__)

PREVIOUS = "previous_response_id"


def input_items(given: object) -> list[dict[str, Any]]:
    """A Responses request's ``input`` as a list of items (a string is one user message)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if isinstance(given, list):
        return [item for item in given if isinstance(item, dict)]
    return []


def follow_up(body: dict[str, Any], previous: StoredResponse) -> dict[str, Any]:
    """The stateless request a follow-up of ``previous`` stands for."""
    sent = {name: value for name, value in body.items() if name != PREVIOUS}
    sent["input"] = [*previous.items, *input_items(body.get("input"))]
    return sent


def stored_of(
    owner: str | None, sent: dict[str, Any], answer: str, previous_id: str | None
) -> StoredResponse | None:
    """What to keep of a response: ``answer`` is its whole body, or the last event of its
    stream (``response.completed``); ``sent`` the request as the worker got it. None when the
    answer is not a completed response."""
    try:
        event = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    response = event.get("response") if event.get("type") == "response.completed" else event
    if not (
        isinstance(response, dict)
        and response.get("object") == "response"
        and isinstance(response.get("id"), str)
    ):
        return None
    output = response.get("output")
    items = [*input_items(sent.get("input")), *(output if isinstance(output, list) else ())]
    kept = {**response, PREVIOUS: previous_id, "store": True}
    return StoredResponse(owner, kept, items)


async def find(store: ResponseStore, response_id: str, owner: str | None) -> StoredResponse:
    """The stored response ``response_id`` of the key ``owner``; a 404 otherwise."""
    stored = await store.get(response_id)
    if stored is None or stored.owner != owner:
        raise NotFound(
            f"No stored response {response_id!r}. A response is kept only when it was asked "
            "for with store: true, for the router's --job-ttl, and only for the key that made "
            "it; send the whole conversation in 'input' instead.",
            param=PREVIOUS,
        )
    return stored


@dataclass
class Keeper:
    """Keeps one response once it completes (``JobResponse`` calls it before the client gets
    the answer's last bytes, so that a follow-up sent at once finds it)."""

    store: ResponseStore
    owner: str | None
    sent: dict[str, Any]
    previous_id: str | None

    async def keep(self, answer: str) -> None:
        stored = stored_of(self.owner, self.sent, answer, self.previous_id)
        if stored is None:
            log.warning("a response asked to be stored did not complete as one; not stored")
            return
        await self.store.put(stored)


async def prepare(
    store: ResponseStore, owner: str | None, body: dict[str, Any]
) -> tuple[dict[str, Any], Keeper | None]:
    """The body to send for a Responses request (a follow-up made whole), and what keeps its
    response when it asked for ``store: true``."""
    previous_id = body.get(PREVIOUS)
    if isinstance(previous_id, str):  # its type was checked (agent_requests)
        body = follow_up(body, await find(store, previous_id, owner))
    keeper = Keeper(store, owner, body, previous_id) if body.get("store") is True else None
    return body, keeper
