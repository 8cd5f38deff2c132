"""Workers named in the deployments API by the ``--name`` they were started with, not only by
their ids (which carry a random suffix): a plan and a deploy by names over real workers,
and a name two workers share refused with both ids."""

from __future__ import annotations

import httpx
import pytest
from split_models import deployment, status

import http_calls
from cluster import MODEL, Cluster, Router, wait_until

pytestmark = pytest.mark.e2e


def post(router: Router, route: str, **body: object) -> httpx.Response:
    return http_calls.post(
        f"{router.url}/api/v1/pipeline/{route}", json=body, headers=router.headers, timeout=30
    )


def test_plan_and_deploy_by_names_and_a_shared_name_is_refused(cluster: Cluster) -> None:
    router = cluster.router()
    for name in ("box1", "box2"):
        cluster.worker(router, "--slots", "1", "--ctx-size", "1024", name=name)
    ids = {w["name"]: w["id"] for w in router.wait_workers(2)}
    assert ids["box1"].startswith("box1-")  # ids carry a suffix nobody typed

    plan = post(router, "plan", model=MODEL, ctx=1024, workers=["box2", "box1"])
    assert plan.status_code == 200, plan.text
    shards = [(s["worker"], s["worker_name"]) for s in plan.json()["shards"]]
    assert shards == [(ids["box2"], "box2"), (ids["box1"], "box1")]

    body = {"model": str(cluster.model_path), "ctx": 1024, "workers": ["box1", "box2"]}
    r = post(router, "deploy", name="by-name", **body)
    assert r.status_code == 202, r.text
    served = wait_until(
        lambda: (d := deployment(router, "by-name"))["state"] == "serving" and d,
        120,
        "the split deployed by names to serve",
    )
    shown = [(s["worker"], s["worker_name"]) for s in served["shards"]]
    assert shown == [(ids["box1"], "box1"), (ids["box2"], "box2")]
    assert served["workers"] == ["box1", "box2"]  # kept as named: ids change on a restart

    cluster.worker(router, "--slots", "1", "--ctx-size", "1024", name="box2")
    twins = wait_until(
        lambda: (t := sorted(w["id"] for w in router.workers() if w["name"] == "box2"))[1:] and t,
        60,
        "a second worker named box2 to register",
    )
    for route, extra in (("plan", {}), ("deploy", {"name": "twin"})):
        r = post(router, route, **body, **extra)
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert error["param"] == "workers" and error["type"] == "invalid_request_error"
        shared = f"named 'box2': {twins[0]}, {twins[1]}; name the one you mean by its id"
        assert shared in error["message"]
    assert [d["name"] for d in status(router)] == ["by-name"]  # "twin" was not stored
    assert deployment(router, "by-name")["state"] == "serving"  # and the split runs on

    by_id = post(router, "plan", model=MODEL, ctx=1024, workers=["box1", twins[1]])
    assert by_id.status_code == 200, by_id.text
    assert [s["worker"] for s in by_id.json()["shards"]] == [ids["box1"], twins[1]]
    unknown = post(router, "plan", model=MODEL, workers=["box3"])
    assert unknown.status_code == 400
    assert f"'box3'; connected: box1 ({ids['box1']}), box2 ({twins[0]})" in unknown.text
