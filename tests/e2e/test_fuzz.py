"""Schemathesis against the router's own OpenAPI document: no 5xx, no hang, answers as declared.

A real router (with the model store embedded, holding a tiny GGUF) and a real worker running
llama-server. Schemathesis's engine (what ``st run`` drives) sends every operation in
``/openapi.json`` its examples, boundary cases (coverage phase) and random schema-valid and
schema-breaking requests (fuzzing phase), with the API key, which is also the store's admin
key so uploads are fuzzed past the key check. Generation stays cheap: the router caps
``max_tokens`` (``--max-tokens-limit``) and fills it in for requests that name none.

Each problem is reported with a curl command that reproduces it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import schemathesis
from schemathesis.engine import Status, events, from_schema
from schemathesis.openapi import from_url

from cluster import API_KEY, MODEL, Cluster, Proc, Router
from data.stores import TINY_ID, write_tiny_gguf

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
CALL_TIMEOUT_S = 30.0
"""A call that takes longer than this is a hang."""
EXAMPLES_PER_OPERATION = 100
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
)
EXPECTED_OPERATIONS = {
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/embeddings",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "GET /health",
    "GET /api/v1/workers",
    "POST /api/v1/pipeline/plan",
    "GET /api/v1/models/registry",
    "GET /api/v1/models/{model_id}/metadata",
    "GET /api/v1/models/{model_id}/tensors",
    "POST /api/v1/models/{model_id}/pull",
    "GET /api/v1/models/{model_id}/file",
    "HEAD /api/v1/models/{model_id}/file",
    "POST /api/v1/storage/upload",
    "GET /api/v1/storage/upload/{sha256}",
}
ANSWERED = {"POST /v1/chat/completions", "POST /v1/completions", "GET /api/v1/models/registry"}
"""Operations that must have answered 200 at least once: the fuzzing reached the worker/store."""


@dataclass(frozen=True)
class Fuzzed:
    router: Router
    worker: Proc


@pytest.fixture(scope="module")
def fuzz_router(
    session_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fuzzed]:
    """A router of its own (stopped after this module) with one worker and a tiny store."""
    storage = tmp_path_factory.mktemp("fuzz-store")
    write_tiny_gguf(storage / f"{TINY_ID}.gguf")
    router = session_cluster.router(
        *("--storage", str(storage), "--admin-key", API_KEY),
        *("--max-tokens-limit", str(MAX_TOKENS), "--max-body-bytes", str(64 * 1024)),
        *("--default-model", MODEL, "--max-wait", "20"),
    )
    worker = session_cluster.worker(router, "--slots", "2", "--ctx-size", "1024", name="fuzz")
    router.wait_workers(1)
    yield Fuzzed(router, worker)
    worker.stop()
    router.proc.stop()


@pytest.fixture(scope="module")
def router_schema(fuzz_router: Fuzzed) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "headers": fuzz_router.router.headers,
            "request-timeout": CALL_TIMEOUT_S,
            "continue-on-failure": True,
            "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
            "generation": {
                "mode": "all",
                "max-examples": EXAMPLES_PER_OPERATION,
                "database": "none",  # nothing written into the work tree
            },
            "cache": {"enabled": False},
            "phases": {"stateful": {"enabled": False}},
            "parameters": {"model_id": TINY_ID},  # the stored model, so its routes answer
        }
    )
    return from_url(fuzz_router.router.url + "/openapi.json", config=config)


def _problems(event: events.EngineEvent) -> list[str]:
    """What a finished scenario (or an error event) found, each with its reproducer."""
    if isinstance(event, events.NonFatalError):
        return [f"{event.label}: {event.info.format()}"]
    if not isinstance(event, events.ScenarioFinished) or event.status not in BAD:
        return []
    found = []
    for case_id, checks in event.recorder.checks.items():
        response = event.recorder.find_response(case_id=case_id)
        answer = (
            f"{response.status_code} {response.content[:300].decode(errors='replace')}"
            if response
            else "no response"
        )
        for check in checks:
            if check.failure_info is not None:
                failure = check.failure_info.failure
                found.append(
                    f"{event.label} [{check.name}] {failure.title}: {failure.message}\n"
                    f"    answered: {answer}\n    {check.failure_info.code_sample}"
                )
    return found or [f"{event.label}: {event.status} in phase {event.phase}"]


BAD = {Status.FAILURE, Status.ERROR}


# Hypothesis warns when a generated example's repr is large (a 100 kB body is a fair input); the
# warning is about its reporting cost, not about the router, so it must not fail the run.
@pytest.mark.filterwarnings(
    "ignore:Generating overly large repr:hypothesis.errors.HypothesisWarning"
)
def test_the_router_survives_fuzzing(
    router_schema: schemathesis.BaseSchema, fuzz_router: Fuzzed
) -> None:
    problems: list[str] = []
    statuses: dict[str, Counter[int]] = {}
    for event in from_schema(router_schema).execute():
        if isinstance(event, events.FatalError):
            raise event.exception
        problems += _problems(event)
        if isinstance(event, events.ScenarioFinished) and event.label:
            seen = statuses.setdefault(event.label, Counter())
            seen.update(
                i.response.status_code for i in event.recorder.interactions.values() if i.response
            )
    report = "\n".join(dict.fromkeys(problems))
    worker = fuzz_router.worker
    assert worker.alive(), f"a request killed the worker:\n{worker.log()[-3000:]}\n{report}"
    tested = {label for label, seen in statuses.items() if seen}
    assert tested >= EXPECTED_OPERATIONS, f"never called: {EXPECTED_OPERATIONS - tested}"
    assert all(statuses[label][200] for label in ANSWERED), statuses
    assert not problems, report
