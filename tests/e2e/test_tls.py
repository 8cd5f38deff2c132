"""TLS end to end: a real router serving HTTPS and WSS with --tls-cert/--tls-key, a real
worker dialing it over wss:// with --tls-ca, and the official openai client over HTTPS.

The CA and the certificate for 127.0.0.1 are made at test time (``certs.make_certs``).
"""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest

import http_calls
from certs import Certs, make_certs
from cluster import API_KEY, MODEL, STARTUP_TIMEOUT_S, Cluster, Proc, Router, wait_until

pytestmark = pytest.mark.e2e

EXIT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def https_router(cluster: Cluster, certs: Certs) -> Router:
    tls = ("--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    return cluster.router(*tls, tls_ca=certs.ca)


def test_the_router_serves_https_to_clients_that_trust_its_ca(
    cluster: Cluster, certs: Certs
) -> None:
    router = https_router(cluster, certs)
    assert router.url.startswith("https://")
    trusting = ssl.create_default_context(cafile=certs.ca)
    with httpx.Client(verify=trusting, timeout=10) as client:
        health = client.get(router.url + "/health")
        models = client.get(router.url + "/v1/models", headers=router.headers)
    assert health.status_code == 200 and models.status_code == 200
    with (
        httpx.Client(timeout=10) as system_cas,
        pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        system_cas.get(router.url + "/health")
    assert f"on https://127.0.0.1:{router.port}" in router.proc.log()


def wait_ready(router: Router, worker: Proc) -> None:
    def ready() -> bool:
        assert worker.alive(), f"the worker exited:\n{worker.log()[-3000:]}"
        return any(w["state"] == "ready" for w in router.workers())

    wait_until(ready, STARTUP_TIMEOUT_S, "the worker to join over wss://")


@pytest.mark.parametrize("trust", ["--tls-ca", "system store"])
def test_a_worker_joins_over_wss_and_serves_the_openai_client_over_https(
    cluster: Cluster, certs: Certs, trust: str
) -> None:
    router = https_router(cluster, certs)
    if trust == "--tls-ca":
        worker = cluster.worker(router, "--tls-ca", str(certs.ca), "--slots", "1")
    else:  # the CA installed system-wide, as OpenSSL finds it
        worker = cluster.worker(router, "--slots", "1", env={"SSL_CERT_FILE": str(certs.ca)})
    wait_ready(router, worker)
    assert f"wss://127.0.0.1:{router.port}" in worker.log()
    with (
        httpx.Client(verify=ssl.create_default_context(cafile=certs.ca)) as http,
        openai.OpenAI(
            base_url=router.url + "/v1", api_key=API_KEY, http_client=http, max_retries=0
        ) as client,
    ):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        streamed = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=8,
            stream=True,
        )
        chunks = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert answer.model == MODEL and answer.choices[0].message.content
    assert "".join(chunks)


def test_a_worker_that_cannot_verify_the_router_exits_2_with_advice(
    cluster: Cluster, certs: Certs
) -> None:
    router = https_router(cluster, certs)
    for trust in ((), ("--tls-ca", str(certs.other_ca))):
        worker = cluster.worker(router, *trust, model=False)
        assert worker.wait(EXIT_TIMEOUT_S) == 2, worker.log()
        log = worker.log()
        assert "cannot verify the TLS certificate of the router" in log
        assert "--tls-ca" in log and "Traceback" not in log
        assert log.count("reconnecting in") == 0, "a certificate error is not retried"
    assert router.workers() == []


def test_the_router_refuses_to_start_with_half_or_mismatched_tls(
    cluster: Cluster, certs: Certs
) -> None:
    cases = {
        "--tls-cert needs --tls-key": ("--tls-cert", str(certs.cert)),
        "does not belong to the certificate": (
            *("--tls-cert", str(certs.cert)),
            *("--tls-key", str(certs.other_key)),
        ),
    }
    for expected, args in cases.items():
        router = cluster.router(*args, wait=False)
        assert router.proc.wait(EXIT_TIMEOUT_S) == 2
        log = router.proc.log()
        assert expected in log and "Traceback" not in log, log


def test_a_worker_given_host_port_and_its_ca_dials_wss(cluster: Cluster, certs: Certs) -> None:
    """The README's form: --router-url HOST:PORT with --tls-ca means wss://, and the log says so."""
    router = https_router(cluster, certs)
    host_port = f"127.0.0.1:{router.port}"
    worker = cluster.worker(
        router, "--router-url", host_port, "--tls-ca", str(certs.ca), "--slots", "1"
    )
    wait_ready(router, worker)
    log = worker.log()
    assert f"dialing {host_port} over wss://: --tls-ca is given" in log
    assert f"wss://{host_port}/ws/worker" in log


def test_plain_http_to_the_tls_port_is_answered_and_named_once(
    cluster: Cluster, certs: Certs
) -> None:
    """A worker dialing ws:// (no scheme, no --tls-ca) and a client using http:// get a 400
    saying to use TLS; the router names the peer in one WARNING line, not one per retry; the
    worker, which never joins, warns once what to check."""
    router = https_router(cluster, certs)
    plain = f"http://127.0.0.1:{router.port}"
    answer = http_calls.get(plain + "/health", timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "tls_required"
    assert "use https://" in answer.json()["error"]["message"]

    worker = cluster.worker(router, "--router-url", f"127.0.0.1:{router.port}", model=False)
    wait_until(
        lambda: "has not joined a router after" in worker.log(),
        STARTUP_TIMEOUT_S,
        "the worker to warn that it cannot join",
    )
    wait_until(
        lambda: worker.log().count("reconnecting in") >= 4,
        STARTUP_TIMEOUT_S,
        "the worker to retry once more",
    )
    worker_log = worker.log()
    assert worker_log.count("has not joined a router after") == 1, worker_log
    assert f"dialing ws://127.0.0.1:{router.port}/ws/worker" in worker_log
    assert "needs wss://" in worker_log

    warnings = [line for line in router.proc.log().splitlines() if "sent plain HTTP" in line]
    assert len(warnings) == 1, router.proc.log()
    assert "WARNING" in warnings[0] and "127.0.0.1:" in warnings[0]
    assert "use https://" in warnings[0] and "wss://HOST:PORT" in warnings[0]
    assert router.workers() == []
