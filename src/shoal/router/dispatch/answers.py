"""What a request is told while it has no worker: 404, 400, 503 and 429, for both dispatchers.

A model is looked for among this router's workers and, with Redis, every other router's
(``remote``): a router whose own workers serve nothing still answers from the cluster's view.
So is the context its workers' slots have (``context_need``): a request none of them could
hold is refused here, before it waits (``need.py`` says how that is known without tokens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from shoal.models.residency import Refuse
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import AGENT_ENDPOINTS, Endpoint, ErrorBody
from shoal.router.dispatch import need
from shoal.router.dispatch.directory import RemoteWorker
from shoal.router.dispatch.job import Job, JobState, Submission
from shoal.router.dispatch.scheduler import admission
from shoal.router.dispatch.workers import Registry
from shoal.router.errors import BadRequest, ModelDoesNotFit, ModelNotFound, QueueFull, Unavailable

RETRY_AFTER_QUEUE_FULL_S = 2.0
RETRY_AFTER_NO_WORKER_S = 5.0

UnavailableReason = Callable[[ModelName], str | None]
"""Why a model takes no request now and is only away for a while (a deployment being
redeployed, or draining for a rebalance while its head still serves the answers it runs): its
requests get a 503 with ``Retry-After`` instead of a 404 or a place in the queue."""


def never_away(model: ModelName) -> str | None:
    """For a router without deployments: a model nobody serves is simply not there."""
    return None


def unsupported_endpoint(model: ModelName, endpoint: Endpoint) -> BadRequest:
    """The 400 for a model that is served, but not for this endpoint."""
    flag = _HINTS.get(endpoint, "")
    return BadRequest(
        f"The model {model!r} is not served for {endpoint.path}{flag}.",
        param="model",
        code="unsupported_endpoint",
    )


_HINTS = {
    Endpoint.EMBEDDINGS: " (start a worker with --embedding)",
    **dict.fromkeys(
        AGENT_ENDPOINTS,
        " (workers serve it from their own llama-server; a worker attached to a server with "
        "--backend-url serves chat and completions only)",
    ),
}


def check_served(
    model: ModelName,
    endpoint: Endpoint,
    registry: Registry,
    remote: Sequence[RemoteWorker],
    away: UnavailableReason,
) -> None:
    """Raise the answer for a request no worker anywhere could take; return if one could."""
    why = away(model)
    if why:  # a deployment that is starting, degraded, or draining (its head still serves)
        raise Unavailable(why, retry_after=RETRY_AFTER_NO_WORKER_S)
    view = registry.view(model)
    others = [r for r in remote if r.serves(model)]
    if view is None and not others:
        available = sorted({*registry.model_names(), *(m.name for r in remote for m in r.models)})
        hint = (
            f"Available: {', '.join(available)}."
            if available
            else "No worker is connected yet; start one with `shoal worker`."
        )
        raise ModelNotFound(
            f"The model {model!r} is not served by any connected worker. {hint}", param="model"
        )
    if view is not None and endpoint in view.endpoints:
        return
    if any(r.serves(model, endpoint) for r in others):
        return
    raise unsupported_endpoint(model, endpoint)


def check_fits(
    model: ModelName, endpoint: Endpoint, registry: Registry, remote: Sequence[RemoteWorker]
) -> None:
    """Raise the 503 ``model_does_not_fit`` when every worker serving ``model`` as one of
    several text models could never load it (``scheduler.admission`` refuses it: too big for
    the worker's budget, or not beside its pinned models), naming the numbers: waiting would
    not help, so the client hears it now rather than after ``--max-wait``. Return when one
    worker could (or decides for itself: one model of its own, or a size it does not say)."""
    loads = [w.load() for w in registry.serving(model, endpoint)]
    loads += [r.load() for r in remote if r.serves(model, endpoint)]
    reasons: list[str] = []
    for w in loads:
        own = w.model(model)
        if own is None or own.resident_bytes is None or own.holds_memory:
            return
        decision = admission(w, own)
        if not isinstance(decision, Refuse):
            return
        reasons.append(f"worker {w.id}: {decision.reason}")
    if reasons:
        raise ModelDoesNotFit(
            f"No worker can load the model {model!r}: " + "; ".join(sorted(reasons)) + "."
        )


def contexts(
    model: ModelName, endpoint: Endpoint, registry: Registry, remote: Sequence[RemoteWorker]
) -> list[int | None]:
    """The context per slot of the workers serving ``model`` for ``endpoint``, here (each
    size once) and (with Redis) at every other router; None where a worker does not say."""
    view = registry.view(model)
    local = list(view.contexts.get(endpoint, ())) if view is not None else []
    others = [
        m.context_length
        for r in remote
        for m in r.models
        if m.name == model and endpoint in m.endpoints
    ]
    return local + others


def context_need(ask: Submission, registry: Registry, remote: Sequence[RemoteWorker]) -> int:
    """The tokens of context a worker's slot must have to be given ``ask`` (``need.tokens``);
    raise the 400 when certainly no worker serving its model has them."""
    model, endpoint = ask.model, ask.endpoint
    want = need.need_of(endpoint, ask.body)
    most = need.largest(contexts(model, endpoint, registry, remote))
    if most is None or not need.refused(want, most):
        return need.tokens(want, most)
    if want.output_field is not None and want.output >= most:
        detail = f"it asks for {want.output} tokens of answer ({want.output_field})"
        param = want.output_field
    else:
        prompt = want.floor - max(want.output, 1)
        asked = f" and asks for {want.output} of answer" if want.output_field else ""
        detail = f"its prompt is at least {prompt} tokens{asked}"
        param = need.prompt_field(endpoint)
    raise BadRequest(context_exceeded(model, most, detail), param=param, code=CONTEXT)


def too_long(
    job: Job, tokens: int, registry: Registry, remote: Sequence[RemoteWorker]
) -> ErrorBody | None:
    """The 400 for a job whose prompt a worker's llama-server refused as longer than its
    context, when no worker serving its model has the ``tokens`` it needs now (at least its
    prompt as llama-server counted it, and one); None when one has (or one does not say)."""
    most = need.largest(contexts(job.model, job.endpoint, registry, remote))
    if most is None or tokens <= most:
        return None
    detail = f"this one needs at least {tokens} (its prompt as the model counts it, and its answer)"
    message = context_exceeded(job.model, most, detail)
    return ErrorBody(message=message, type="invalid_request_error", code=CONTEXT)


CONTEXT = "context_length_exceeded"
"""The code of a request longer than any context (OpenAI's name for it)."""


def context_exceeded(model: ModelName, most: int, detail: str) -> str:
    """Why a request fits no worker serving ``model`` (``most``: the largest context per
    slot there is); ``detail`` says what it needs."""
    return (
        f"This request does not fit the context of any worker serving model {model!r}: "
        f"the largest holds {most} tokens per request, prompt and answer together, and "
        f"{detail}. Shorten the prompt, or lower max_tokens so that both fit."
    )


def queue_full(model: ModelName, max_queue: int) -> QueueFull:
    return QueueFull(
        f"Too many requests are waiting for model {model!r} ({max_queue}); "
        "retry later or add workers.",
        retry_after=RETRY_AFTER_QUEUE_FULL_S,
    )


def key_queue_full(model: ModelName, max_queued: int) -> QueueFull:
    """The 429 for a job whose API key already has ``max_queued`` requests waiting here."""
    waiting = (
        f"at most {max_queued} of its requests may wait for a worker at once"
        if max_queued
        else "its requests may not wait for a worker"
    )
    return QueueFull(
        f"This API key's queue is full: {waiting} (its max-queued limit), and model {model!r} "
        "has no free slot. Send it again once one of your requests is answered, or ask the "
        "router's administrator to raise the limit (`shoal keys update KEY --max-queued N`).",
        code="key_queue_full",
        retry_after=RETRY_AFTER_QUEUE_FULL_S,
    )


def no_worker(
    job: Job, max_wait: float, registry: Registry, remote: Sequence[RemoteWorker]
) -> Unavailable:
    """The 503 for a job no worker took within ``--max-wait``, naming the workers' states."""
    states = sorted(
        {w.backend_state.value for w, _ in registry.model_info(job.model)}
        | {r.state.value for r in remote if r.serves(job.model)}
    )
    return Unavailable(
        f"No worker could take this request for model {job.model!r} within "
        f"{max_wait:g} s (worker states: {', '.join(states) or 'none'}). "
        "Retry later or add workers.",
        retry_after=RETRY_AFTER_NO_WORKER_S,
    )


async def wait_assigned(
    job: Job,
    max_wait: float,
    withdraw: Callable[[Job], Awaitable[bool]],
    refusal: Callable[[], Unavailable],
) -> None:
    """Wait until a worker takes ``job``; past ``max_wait`` since it (last) queued, withdraw it
    from its queue and raise ``refusal()``. A job a worker took just as the limit passed
    (``withdraw`` answers False) is waited for instead."""
    if job.assigned.is_set():
        return  # placed as it came: no timer to arm and cancel
    remaining = max_wait - (time.monotonic() - job.queued_at)
    try:
        async with asyncio.timeout(max(remaining, 0.0)):
            await job.assigned.wait()
        return
    except TimeoutError:
        if job.state is not JobState.QUEUED:
            raise
    if not await withdraw(job):
        await job.assigned.wait()
        return
    job.transition(JobState.FAILED, "wait limit passed")
    raise refusal() from None
