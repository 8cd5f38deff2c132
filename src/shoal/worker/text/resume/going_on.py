"""Going on with an answer another worker began, on our own llama-server, exactly.

The job carries what the client already has (``Continuation``: the token ids, their
log-probabilities); ``continuation.py`` builds the request that goes on from there (pure).
Here it is run: the chat template applied (``/apply-template``), the slot's cache prefilled
the way the original run computed it, the produced text read back for a non-streamed answer
(``/detokenize``), then the rest streamed through a ``Splice`` so the client sees one answer.
An answer that cannot go on ends with a ``worker_lost`` 502 that says so.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from shoal.protocol.messages import (
    Continuation,
    Endpoint,
    ErrorBody,
    JobDone,
    JobFailed,
    JobResult,
    JobStart,
)
from shoal.worker.jobs.sink import JobSink
from shoal.worker.text.backend_errors import error_from_body
from shoal.worker.text.pinning import Pin
from shoal.worker.text.resume.continuation import (
    NotResumable,
    Splice,
    TokenTrail,
    WholeAnswer,
    client_wants_logprobs,
    continuation,
    prefill_prompts,
    remaining_tokens,
    template_request,
)
from shoal.worker.text.streams import Progress, Rename, collect, relay

log = logging.getLogger(__name__)

Post = Callable[[str, bytes], Awaitable[aiohttp.ClientResponse]]
"""POSTs a body to a URL of the backend (``loopback.post`` with the job's headers)."""


@dataclass(frozen=True)
class GoingOn:
    """How a backend goes on with answers: where it is, how to post to it, and whether it
    can (only our own llama-server reports token ids)."""

    base_url: Callable[[], str]
    post: Post
    rename: Rename
    resumable: bool

    async def run(self, job: JobStart, resume: Continuation, out: JobSink, pin: Pin | None) -> None:
        """Go on with an answer another worker began (``continuation``), in ``pin``'s slot."""
        if not self.resumable:
            out.send(_not_resumable(job, "this worker's backend is not its own llama-server"))
            return
        chat = job.endpoint is Endpoint.CHAT
        options = job.body.get("stream_options")
        splice = Splice(
            job.endpoint,
            resume,
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        )
        left = remaining_tokens(job.body, len(resume.tokens))
        if left is not None and left <= 0 and job.stream:  # lost between its end and [DONE]
            for chunk in splice.chunks(_length_end(chat)):
                out.chunk(job.job_id, orjson.dumps(chunk).decode(), ())
            out.send(JobDone(job_id=job.job_id))
            return
        try:
            prompt = await self._chat_prompt(job.body) if chat else None
            body = continuation(job.body, job.endpoint, resume, prompt)
            before = "" if job.stream else await self._text_of(resume.tokens)
            if pin is not None:
                body["id_slot"] = pin.slot
            await self._prefill(body, len(resume.tokens), pin)
        except NotResumable as exc:
            out.send(_not_resumable(job, str(exc)))
            return
        if not job.stream:
            splice.include_usage = True  # the whole answer has its usage
            if left is not None and left <= 0:  # lost between its last token and its end
                collected = WholeAnswer(None, splice, before, before_logprobs=resume.logprobs)
                collected.take(_length_end(chat))
                body_out = orjson.dumps(collected.answer(job.endpoint)).decode()
                out.send(JobResult(job_id=job.job_id, body=self.rename(body_out)))
                return
        log.info(
            "job %s model=%s: going on after %d tokens", job.job_id, job.model, len(resume.tokens)
        )
        url = self.base_url() + Endpoint.COMPLETIONS.path
        async with await self.post(url, orjson.dumps(body)) as resp:
            if resp.status != 200:
                raw = await resp.read()
                error = error_from_body(resp.status, raw)
                out.send(_not_resumable(job, error.message))
                return
            strip = not client_wants_logprobs(job.body, job.endpoint)
            trail = TokenTrail(strip=strip, chat=False)
            if not job.stream:
                collected = WholeAnswer(trail, splice, before, before_logprobs=resume.logprobs)
                await collect(job, resp, out, collected, Progress(started=True), self.rename)
                return
            await relay(job, resp, out, trail, splice, Progress(started=True), self.rename)

    async def _prefill(self, body: dict[str, Any], produced: int, pin: Pin | None) -> None:
        """Put the continuation's prompt into the slot's cache the way the original run
        computed it (``prefill_prompts``: the prompt, then the produced ids a few at a time),
        so that the continuation is exactly the uninterrupted answer."""
        url = self.base_url() + "/completion"
        for prompt in prefill_prompts(body["prompt"], produced):
            step: dict[str, Any] = {"prompt": prompt, "n_predict": 0, "cache_prompt": True}
            if pin is not None:
                step["id_slot"] = pin.slot
            async with await self.post(url, orjson.dumps(step)) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise NotResumable(error_from_body(resp.status, raw).message)

    async def _text_of(self, tokens: tuple[int, ...]) -> str:
        """The text of ``tokens`` as llama-server spells them: what a non-streamed answer had
        produced before its worker was lost (exactly: ids are sent only where the text so
        far is exactly theirs)."""
        return await self._ask_text("/detokenize", {"tokens": list(tokens)}, "content")

    async def _chat_prompt(self, body: dict[str, Any]) -> str:
        return await self._ask_text("/apply-template", template_request(body), "prompt")

    async def _ask_text(self, path: str, payload: dict[str, Any], field: str) -> str:
        """The text ``field`` of llama-server's answer to ``payload`` at ``path``; raises
        ``NotResumable`` when it refuses or answers without it."""
        async with await self.post(self.base_url() + path, orjson.dumps(payload)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise NotResumable(error_from_body(resp.status, raw).message)
        text = orjson.loads(raw).get(field)
        if not isinstance(text, str):
            raise NotResumable(f"{path} gave no {field}")
        return text


def _length_end(chat: bool) -> dict[str, Any]:
    """The last chunk of an answer that reached its token limit (as llama-server ends it)."""
    if chat:
        return {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]}
    return {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}]}


def _not_resumable(job: JobStart, why: str) -> JobFailed:
    log.warning("job %s model=%s: cannot go on with its answer: %s", job.job_id, job.model, why)
    return JobFailed(
        job_id=job.job_id,
        status=502,
        started=True,
        error=ErrorBody(
            message=f"The worker serving this request was lost and its answer could not be "
            f"resumed ({why}); the answer is incomplete. Retry the request.",
            type="server_error",
            code="worker_lost",
        ),
    )
