"""What a split model's deploy costs: time and bytes through the router, cold vs pre-seeded.

A real router and three real workers on this machine (a head and two stages) deploy the test
model of ``tests/big_gguf.py`` (3 layers, 11 MiB FFN tensors: over llama.cpp's 10 MiB RPC
hash threshold) through ``/api/v1/pipeline/deploy``, balanced, one layer per shard, in
relayed mode (the head's RPC crosses the router's tunnel) and direct mode. Per round:

  cold      the stages run with ``--rpc-cache-max 0``: no cache, the head sends every weight
  seeded    the stages start with an empty RPC cache: each reads its layers from its copy of
            the GGUF into the cache before ``ggml-rpc-server`` starts (a first deploy)
  warm      the same stages deploy again with their cache filled (a redeploy, e.g. after a
            stage died): the stage only checks its entries

Figures: the deploy's seconds (STARTING to SERVING, ``last_deploy.seconds`` in the status),
the bytes the tunnel carried to the stages during it (relayed only; ``last_deploy``), as a
share of the stages' hashed weights, and the stages' own seeding seconds. Medians over the
rounds. On loopback the network is free, so cold deploys are fast here; the bytes column is
what a real network would carry (a 40 GB model split three ways: ~27 GB per cold deploy).

    python benchmarks/rpc_preseed.py --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from common import Processes, free_port, median, print_table, processes, wait_http, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from big_gguf import big_tensor_gguf  # noqa: E402
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.gguf_info import inspect  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.models.stage_tensors import stage_tensors  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402

ADMIN = "bench-admin-key"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
NAME = "big-split"
KINDS = ("cold", "seeded", "warm")


class Bench:
    def __init__(self, procs: Processes, llama_server: Path, gguf: Path, base: Path) -> None:
        self.procs, self.llama_server, self.gguf, self.base = procs, llama_server, gguf, base
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cache = base / "rpc-cache"

    def router(self) -> None:
        self.procs.shoal(
            "router", "router", "--port", str(self.port), "--admin-key", ADMIN,
            "--heartbeat-interval", "1",
        )  # fmt: skip
        wait_http(self.url + "/health")

    def worker(self, name: str, *args: str) -> None:
        self.procs.shoal(
            name, "worker", "--router-url", f"127.0.0.1:{self.port}", "--name", name,
            "--cache-dir", str(self.base / "cache"), "--threads", "1",
            "--llama-server-path", str(self.llama_server), "--model", str(self.gguf),
            "--model-alias", f"big-{name}", "--slots", "1", "--ctx-size", "512",
            "--rpc-host", "127.0.0.1", *args,
        )  # fmt: skip

    def stages(self, cache: bool) -> None:
        for name in ("s1", "s2"):
            if name in self.procs.named:
                self.procs.stop_named(name)
            args = ("--rpc-cache-dir", str(self.cache)) if cache else ("--rpc-cache-max", "0")
            self.worker(name, *args)
        self.wait_workers(3)

    def wait_workers(self, count: int) -> None:
        def ready() -> bool:
            data = httpx.get(self.url + "/api/v1/workers", headers=HEADERS).json()["data"]
            names = {w["name"] for w in data if w["state"] == "ready"}
            return len(names) >= count

        _wait(ready, 120, f"{count} workers")

    def deploy(self, mode: str) -> dict[str, Any]:
        body = {
            "model": str(self.gguf),
            "name": NAME,
            "workers": ["h", "s1", "s2"],
            "ctx": 512,
            "strategy": "balanced",
            "mode": mode,
        }
        r = httpx.post(self.url + "/api/v1/pipeline/deploy", json=body, headers=HEADERS)
        r.raise_for_status()
        served: dict[str, Any] = _wait(self._serving, 300, "the split to serve")
        r = httpx.post(self.url + "/api/v1/pipeline/undeploy", json={"name": NAME}, headers=HEADERS)
        r.raise_for_status()
        return served

    def _serving(self) -> dict[str, Any] | None:
        data = httpx.get(self.url + "/api/v1/pipeline/status", headers=HEADERS).json()["data"]
        d: dict[str, Any] | None = next((x for x in data if x["name"] == NAME), None)
        return d if d is not None and d["state"] == "serving" else None


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (httpx.HTTPError, KeyError, ValueError):
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _figures(d: dict[str, Any]) -> dict[str, Any]:
    seeds = [s["seed"] for s in d["shards"][1:] if s["seed"]]
    return {
        "seconds": d["last_deploy"]["seconds"],
        "to_stages": d["last_deploy"]["tunnel_bytes"]["to_stages"],
        "seed_seconds": max((s["seconds"] for s in seeds), default=0.0),
        "cached": sum(s["cached"] for s in seeds),
    }


def run_mode(bench: Bench, mode: str, rounds: int) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    bench.stages(cache=False)
    for _ in range(rounds):
        runs["cold"].append(_figures(bench.deploy(mode)))
    bench.stages(cache=True)
    for _ in range(rounds):
        shutil.rmtree(bench.cache, ignore_errors=True)  # a first deploy: nothing cached
        runs["seeded"].append(_figures(bench.deploy(mode)))
        runs["warm"].append(_figures(bench.deploy(mode)))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="relayed,direct")
    args = parser.parse_args()
    cache_dir = CommonSettings().cache_dir
    llama_server = resolve(
        explicit=None, cache_dir=cache_dir, path_env=None, allow_build=False
    ).llama_server
    tokenizer = resolve_model(DEFAULT_MODEL.id, cache_dir, download=False).path
    gguf = big_tensor_gguf(cache_dir / "test-models", tokenizer)
    info = inspect(gguf)
    share = sum(
        t.nbytes for t in stage_tensors(info, 1, 1, False) + stage_tensors(info, 2, 2, True)
    )
    base = Path(tempfile.mkdtemp(prefix="shoal-bench-preseed-"))
    results: dict[str, Any] = {}
    try:
        with processes(base / "logs") as procs:
            bench = Bench(procs, llama_server, gguf, base)
            bench.router()
            bench.worker("h")
            for mode in args.modes.split(","):
                results[mode] = run_mode(bench, mode, args.rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    summary: dict[str, Any] = {}
    for mode, runs in results.items():
        for kind in KINDS:
            secs = median([r["seconds"] for r in runs[kind]])
            sent = median([r["to_stages"] for r in runs[kind]])
            seed_s = median([r["seed_seconds"] for r in runs[kind]])
            summary[f"{mode}/{kind}"] = {
                "deploy_s": secs,
                "tunnel_to_stages_bytes": sent,
                "of_share": sent / share,
                "seed_s": seed_s,
            }
            shown = (
                f"{sent / 1e6:.1f} MB ({100 * sent / share:.1f} %)" if mode == "relayed" else "-"
            )
            rows.append((mode, kind, secs, shown, seed_s))
    print_table(
        f"deploy of {gguf.name} over a head and two stages; stages' hashed weights "
        f"{share / 1e6:.1f} MB; medians of {args.rounds} rounds",
        ("mode", "stages", "deploy s", "tunnel to stages", "seed s"),
        rows,
    )
    write_json(
        "rpc_preseed",
        {
            "config": {"rounds": args.rounds, "model": gguf.name, "share_bytes": share},
            "summary": summary,
            "runs": results,
        },
    )


if __name__ == "__main__":
    main()
