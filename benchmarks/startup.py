"""Start-up and stop: how long Shoal's own processes take to be ready and to be gone.

Every restart, rolling update, `shoal up` and `shoal keys` call waits through these, and so
does every end-to-end test (a suite of several hundred router and worker starts). Measured
here, in rounds, for each source tree given (``--tree``, default: this checkout), trees
alternating within a round so that drift on a noisy machine hits them alike:

* ``--help``: `shoal --help`, start to exit;
* ``keys list``: `shoal keys list` on a fresh SQLite database, start to exit;
* router ready / stop: `shoal router` until ``/health`` answers 200; SIGTERM until it exits;
* worker ready / stop: `shoal worker` (the default model, one thread) until the router lists it
  ready; SIGTERM until it exits (an idle worker: its drain ends at once).

    python benchmarks/startup.py                              # this checkout, 5 rounds
    python benchmarks/startup.py --tree before=/tmp/old/src --tree after=src --rounds 7
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from common import free_port, median, print_table, write_json

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from shoal.llama_cpp.locate import resolve  # noqa: E402
from shoal.models.default import DEFAULT_MODEL  # noqa: E402
from shoal.models.resolve import resolve_model  # noqa: E402
from shoal.settings import CommonSettings  # noqa: E402

POLL_S = 0.01


def _env(src: Path, data: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(src)
    env["SHOAL_DATABASE_URL"] = f"sqlite:///{data / 'shoal.db'}"
    env["XDG_DATA_HOME"] = str(data)
    return env


def _shoal(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "shoal", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _until(check: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if check():
                return time.monotonic() - start
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(POLL_S)
    raise RuntimeError(f"{what} did not happen within {timeout} s")


def _stop(proc: subprocess.Popen[bytes]) -> float:
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    return time.monotonic() - start


def one_round(src: Path, server: Path, model: Path, http: httpx.Client) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="shoal-startup-") as tmp:
        data = Path(tmp)
        env = _env(src, data)
        log = data / "log"
        got: dict[str, float] = {}

        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "shoal", "--help"],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        got["--help"] = time.monotonic() - start

        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "shoal", "keys", "list"],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        got["keys list"] = time.monotonic() - start

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        router = _shoal(["router", "--port", str(port)], env, log)
        try:
            got["router ready"] = _until(
                lambda: http.get(url + "/health").status_code == 200, 120, "router /health"
            )
            worker = _shoal(
                [
                    "worker",
                    "--router-url",
                    f"127.0.0.1:{port}",
                    "--threads",
                    "1",
                    "--llama-server-path",
                    str(server),
                    "--model",
                    str(model),
                    "--cache-dir",
                    str(data / "cache"),
                ],
                env,
                log,
            )
            try:
                got["worker ready"] = _until(
                    lambda: any(
                        w["state"] == "ready"
                        for w in http.get(url + "/api/v1/workers").json()["data"]
                    ),
                    120,
                    "the worker ready",
                )
            finally:
                got["worker stop"] = _stop(worker)
        finally:
            got["router stop"] = _stop(router)
        return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        help="NAME=SRC_DIR: a source tree to measure (repeat); default this one",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--results-name", default="startup")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent / "src"
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(here)}
    cache = CommonSettings().cache_dir
    server = resolve(explicit=None, cache_dir=cache, path_env=None, allow_build=False)
    model = resolve_model(DEFAULT_MODEL.id, cache, download=False).path

    samples: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    with httpx.Client(timeout=5) as http:
        for n in range(args.rounds):
            order = list(trees.items())
            if n % 2:
                order.reverse()
            for name, src in order:
                for key, value in one_round(Path(src), server.llama_server, model, http).items():
                    samples[name].setdefault(key, []).append(value)
            print(f"round {n + 1}/{args.rounds} done", file=sys.stderr)

    keys = list(next(iter(samples.values())))
    rows = [[key, *(median(samples[name][key]) for name in trees)] for key in keys]
    load = os.getloadavg()
    print_table(
        f"seconds, median of {args.rounds} (load average {load[0]:.1f})",
        ["step", *trees],
        rows,
    )
    write_json(
        args.results_name,
        {
            "rounds": args.rounds,
            "trees": trees,
            "load_average": load,
            "median_s": {name: {k: median(v) for k, v in s.items()} for name, s in samples.items()},
            "samples_s": samples,
        },
    )


if __name__ == "__main__":
    main()
