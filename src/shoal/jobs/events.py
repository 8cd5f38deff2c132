"""A job's outcome: its output and its hand-offs. The one vocabulary for it in the router (what
a request waiting for its job reads) and on the Redis queue (encoded as compact JSON).

A holder publishes ``Data`` chunks (an SSE ``data:`` payload each), then ends with ``Done``;
or one ``Result`` (a whole JSON body, which also ends the job); or ``Failed``. The queue
itself writes ``Assigned`` when a consumer takes the job and ``Requeued`` when the job goes
back to wait; the consumer then writes ``Assigned`` again with the ``worker`` it runs the job
on (before any output), so the router the client called can name it (``x-shoal-worker``).
A reader stops after a final event (``is_final``).

Wire form, one JSON object per event (``t`` is the tag)::

    {"t":"data","d":"..."}  {"t":"result","body":"..."}  {"t":"done"}
    {"t":"failed","status":502,"error":{"message":"...","type":"...","code":"..."}}
    {"t":"assigned","consumer":"w1","attempt":1}  {"t":"requeued","reason":"..."}
    {"t":"assigned","consumer":"w1","attempt":1,"worker":"gpu-1-ab12cd"}
    {"t":"requeued","reason":"...","need":3527}  {"t":"loading","model":"qwen-7b"}

``worker`` is optional: readers that do not know it ignore it, and an event without it (from
the queue, or an older consumer) names no worker. So is ``need``: the context a job whose
prompt a worker refused as too long needs from now on. ``Loading`` says the job waits while
its worker loads its model (``JobLoading``): a streamed answer shows the client an SSE
comment; it is not output (unnumbered in the stream, like ``Assigned``) and the job can
still run again after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from shoal.protocol.messages import ErrorBody, JobDone, JobFailed, JobResult


@dataclass(frozen=True, slots=True)
class Data:
    data: str


@dataclass(frozen=True, slots=True)
class Result:
    body: str


@dataclass(frozen=True, slots=True)
class Done:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    status: int
    error: ErrorBody


@dataclass(frozen=True, slots=True)
class Loading:
    """The job waits while its worker loads ``model`` (it was not resident there)."""

    model: str


@dataclass(frozen=True, slots=True)
class Assigned:
    consumer: str
    attempt: int
    worker: str | None = None
    """The worker running the job, once its consumer placed it (None: not said)."""


@dataclass(frozen=True, slots=True)
class Requeued:
    reason: str
    need: int | None = None
    """The tokens of context it needs from now on, when a worker's llama-server refused its
    prompt as too long (the router the client called answers the 400 if no worker has it)."""


@dataclass(frozen=True, slots=True)
class Trail:
    """What the client has of the answer, for another worker to go on if the holder dies
    (``queue.answer``): the token ids completed since the last trail, whether the client's
    text is now exactly the text of every id, and the answer's id and creation time (once).
    Kept in the job's hash, never in its output stream."""

    tokens: tuple[int, ...]
    exact: bool
    answer_id: str | None = None
    created: int | None = None


OutputEvent = Data | Result | Done | Failed | Loading
"""What a job's holder publishes."""

Published = OutputEvent | Assigned | Trail
"""What a consumer publishes: the job's output, which of its workers runs it, and what the
client has of the answer."""

JobEvent = OutputEvent | Assigned | Requeued
"""What a reader of a job's output sees."""

ClientEvent = OutputEvent | Requeued
"""What the request waiting for a job sees (``Job.events`` in the router): its output, and
that it went back to wait (so a client's keep-alive comments go on)."""


@dataclass(frozen=True, slots=True)
class Delivered:
    """An event read from a job's output, with its entry id (pass it to resume reading)."""

    id: str
    event: JobEvent


class BadEvent(ValueError):
    """An output stream entry that is not an event of this version (a bug or a foreign key)."""


def is_final(event: JobEvent) -> bool:
    return isinstance(event, Result | Done | Failed)


def starts_answer(event: OutputEvent) -> bool:
    """Output the client may already have seen: the job can no longer be run again."""
    return isinstance(event, Data | Result)


def from_worker(msg: JobDone | JobResult | JobFailed) -> Done | Result | Failed:
    """A worker's final wire message as the outcome it is: the one place the two meet."""
    match msg:
        case JobDone():
            return Done()
        case JobResult(body=body):
            return Result(body)
        case JobFailed(status=status, error=error):
            return Failed(status, error)


def worker_lost(why: str) -> Failed:
    """The outcome of a job whose worker was lost after it had answered in part."""
    return Failed(
        502,
        ErrorBody(
            message=f"The worker serving this request was lost ({why}); "
            "the answer is incomplete. Retry the request.",
            type="server_error",
            code="worker_lost",
        ),
    )


def encode(event: JobEvent | Trail) -> bytes:
    match event:
        case Trail(tokens=tokens, exact=exact, answer_id=answer_id, created=created):
            trail: dict[str, object] = {"t": "trail", "k": tokens, "x": exact}
            if answer_id is not None:
                trail["h"] = {"id": answer_id, "created": created}
            return orjson.dumps(trail)
        case Data(data=data):
            return orjson.dumps({"t": "data", "d": data})
        case Result(body=body):
            return orjson.dumps({"t": "result", "body": body})
        case Done():
            return b'{"t":"done"}'
        case Failed(status=status, error=error):
            return orjson.dumps(
                {"t": "failed", "status": status, "error": error.model_dump(mode="json")}
            )
        case Assigned(consumer=consumer, attempt=attempt, worker=worker):
            obj: dict[str, object] = {"t": "assigned", "consumer": consumer, "attempt": attempt}
            if worker is not None:
                obj["worker"] = worker
            return orjson.dumps(obj)
        case Requeued() | Loading():
            return _waiting(event)


def _waiting(event: Requeued | Loading) -> bytes:
    """The events that say a job waits on (not output)."""
    if isinstance(event, Loading):
        return orjson.dumps({"t": "loading", "model": event.model})
    requeued: dict[str, object] = {"t": "requeued", "reason": event.reason}
    if event.need is not None:
        requeued["need"] = event.need
    return orjson.dumps(requeued)


def decode(raw: bytes | str) -> JobEvent:
    try:
        obj: Any = orjson.loads(raw)
        return _from_dict(obj)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise BadEvent(f"not a job event: {raw!r:.200}") from exc


def _from_dict(obj: dict[str, Any]) -> JobEvent:
    match obj["t"]:
        case "data":
            return Data(str(obj["d"]))
        case "result":
            return Result(str(obj["body"]))
        case "done":
            return Done()
        case "failed":
            return Failed(int(obj["status"]), ErrorBody.model_validate(obj["error"]))
        case "assigned":
            worker = obj.get("worker")
            return Assigned(
                str(obj["consumer"]), int(obj["attempt"]), None if worker is None else str(worker)
            )
        case "loading":
            return Loading(str(obj["model"]))
        case "requeued":
            need = obj.get("need")
            return Requeued(str(obj["reason"]), None if need is None else int(need))
    raise ValueError(f"unknown event type {obj['t']!r}")
