"""A GPU check anyone with an NVIDIA GPU can run (not in CI): Shoal the way users get it.

One script, one table (and ``benchmarks/results/gpu_check.json``), in the order a new user goes:

  1. ``shoal doctor --json``: the GPUs, driver and CUDA version, the backend chosen and why,
     the llama-server found (a CPU build on a GPU machine is an error, with the fix).
  2. ``shoal llama-cpp install``: the build that choice names, as users get it (the CUDA
     release asset matching the driver, else a build from source for the GPUs present).
  3. ``shoal doctor --json`` again: the binary now drives the GPUs.
  4. ``shoal models pull``: the default model.
  5. ``benchmarks/overhead.py``: streamed TTFT, gap and throughput, straight to llama-server
     and through router + worker, for the worker's own llama-server and an attached one.
  6. A split: a router, a worker on the GPUs and a worker told to use none
     (``--gpu-devices none``, a CPU stage), the default model deployed over both. The plan's
     layout (which device of which worker holds which layers), the head's command line,
     greedy answers and tokens/s against the GPU worker's own llama-server.
  7. GPU telemetry: the router's ``shoal_gpu_*`` gauges for the GPU worker.

    python benchmarks/gpu_check.py                 # everything
    python benchmarks/gpu_check.py --skip-install  # llama.cpp is installed already

On a machine without a GPU it runs the same steps on the CPU (a plumbing check): doctor says
there is no GPU, the split's head computes on its CPU, and there is no telemetry.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from common import RESULTS, free_port, median, processes, wait_http, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shoal.models.default import DEFAULT_MODEL  # noqa: E402

HERE = Path(__file__).resolve().parent
SHOAL = [sys.executable, "-m", "shoal"]
PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
SPLIT = "gpu-check-split"
READY_S = 300.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-install", action="store_true", help="llama.cpp is installed")
    parser.add_argument("--rounds", type=int, default=10, help="overhead.py rounds")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per split request")
    parser.add_argument("--asks", type=int, default=3, help="split requests per path")
    parser.add_argument("--logs", type=Path, default=RESULTS / "logs" / "gpu_check")
    args = parser.parse_args()
    rows: list[tuple[str, str, str]] = []
    report: dict[str, Any] = {"steps": {}}
    steps = report["steps"]

    steps["doctor_before"] = doctor()
    rows.append(("doctor (before)", *doctor_row(steps["doctor_before"])))
    if not args.skip_install:
        steps["install"] = command([*SHOAL, "llama-cpp", "install"], 3600)
        rows.append(("llama-cpp install", ok(steps["install"]), f"{steps['install']['s']:.0f} s"))
    steps["doctor_after"] = doctor()
    rows.append(("doctor (after)", *doctor_row(steps["doctor_after"])))
    steps["pull"] = command([*SHOAL, "models", "pull", DEFAULT_MODEL.id], 1800)
    rows.append(
        ("models pull", ok(steps["pull"]), f"{DEFAULT_MODEL.id}, {steps['pull']['s']:.0f} s")
    )

    steps["overhead"] = overhead(args.rounds)
    rows += steps["overhead"]["rows"]

    steps["split"] = split(args)
    rows += steps["split"]["rows"]
    steps["telemetry"] = steps["split"].pop("telemetry")
    rows.append(("GPU telemetry", *telemetry_row(steps["telemetry"])))

    print("\nGPU check")
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for step, result, figures in rows:
        print(f"  {step.ljust(widths[0])}  {result.ljust(widths[1])}  {figures}")
    write_json("gpu_check", report)


def command(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run a shoal command as a user would; its exit status, time and the end of its output."""
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = -1, f"timed out after {timeout:g} s: {exc.output or ''}"
    return {"argv": argv[2:], "rc": code, "s": time.monotonic() - start, "tail": out[-2000:]}


def ok(result: dict[str, Any]) -> str:
    return "ok" if result["rc"] == 0 else f"FAILED (exit {result['rc']})"


def doctor() -> dict[str, Any]:
    result = command([*SHOAL, "doctor", "--json"], 120)
    try:
        result["report"] = json.loads(result["tail"][result["tail"].index("{") :])
    except ValueError:
        result["report"] = None
    return result


def doctor_row(result: dict[str, Any]) -> tuple[str, str]:
    checks = (result["report"] or {}).get("checks", [])
    if not checks:
        return ok(result), "no JSON report"
    bad = [c for c in checks if c["status"] == "error"]
    status = "ok" if not bad else f"{len(bad)} error(s): " + "; ".join(c["name"] for c in bad)
    found = {c["name"]: c["finding"] for c in checks}
    keys = [k for k in ("gpus", "backend", "binary") if k in found]
    return status, " | ".join(found[k] for k in keys)[:160]


def overhead(rounds: int) -> dict[str, Any]:
    """``overhead.py`` for both paths in one run; its own JSON read back for the table."""
    name = "gpu_check-overhead"
    argv = [sys.executable, str(HERE / "overhead.py"), "--rounds", str(rounds)]
    result = command([*argv, "--results-name", name], 1800)
    result["argv"] = argv[1:]
    path = RESULTS / f"{name}.json"
    rows: list[tuple[str, str, str]] = []
    if result["rc"] == 0 and path.exists():
        result["results"] = json.loads(path.read_text())
        for r in result["results"].get("rows", []):
            figures = (
                f"TTFT p50 {r['direct_ttft_ms']:.1f} -> {r['shoal_ttft_ms']:.1f} ms "
                f"({r['added_ttft_ms']:+.2f}), gap {r['added_gap_ms']:+.2f} ms, "
                f"{r['throughput_ratio']:.3f}x"
            )
            rows.append((f"overhead {r['backend']} x{r['streams']}", r["verdict"], figures))
    else:
        rows.append(("overhead", ok(result), result["tail"].strip().splitlines()[-1][-160:]))
    return {**result, "rows": rows}


def split(args: argparse.Namespace) -> dict[str, Any]:
    """The default model over this machine's GPUs (the head) and a CPU stage."""
    rows: list[tuple[str, str, str]] = []
    out: dict[str, Any] = {}
    with processes(args.logs) as procs:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs.shoal("router", "router", "--port", str(port), "--heartbeat-interval", "1")
        wait_http(url + "/health")
        common = ["--router-url", f"127.0.0.1:{port}", "--rpc-host", "127.0.0.1"]
        procs.shoal("worker-gpu", "worker", *common, "--name", "gpu", "--model", DEFAULT_MODEL.id)
        procs.shoal("worker-cpu", "worker", *common, "--name", "cpu-stage", "--gpu-devices", "none")
        wait_ready(url, 2)
        body = {"name": SPLIT, "model": DEFAULT_MODEL.id, "workers": ["gpu", "cpu-stage"]}
        r = httpx.post(url + "/api/v1/pipeline/deploy", json={**body, "mode": "direct"}, timeout=30)
        if r.status_code != 202:
            rows.append(("split deploy", f"FAILED ({r.status_code})", r.text[:160]))
            return {"rows": rows, "telemetry": gpu_gauges(url)}
        served = wait_serving(url)
        out["deployment"] = served
        if served is None:
            rows.append(("split deploy", "FAILED", "did not serve within 300 s; see the logs"))
            return {"rows": rows, "telemetry": gpu_gauges(url)}
        layout = "; ".join(served.get("layout", []))
        rows.append(("split layout", "ok", layout[:160]))
        head = (
            f"--device {','.join(served.get('devices', []))} "
            f"--tensor-split {','.join(str(t) for t in served.get('tensor_split', []))} "
            f"--n-gpu-layers {served.get('n_gpu_layers')}"
        )
        rows.append(("split head", "ok", head))
        single = [ask(url, DEFAULT_MODEL.id, args.tokens) for _ in range(args.asks)]
        parts = [ask(url, SPLIT, args.tokens) for _ in range(args.asks)]
        out["single"], out["split"] = single, parts
        same = single[0]["text"] == parts[0]["text"]
        speed = (
            f"split {median([p['tok_s'] for p in parts]):.0f} tok/s, "
            f"one worker {median([s['tok_s'] for s in single]):.0f} tok/s"
        )
        rows.append(("split answers", "same text" if same else "text differs", speed))
        return {**out, "rows": rows, "telemetry": gpu_gauges(url)}


def wait_ready(url: str, count: int) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        data = httpx.get(url + "/api/v1/workers", timeout=5).json()["data"]
        if sum(w["state"] == "ready" for w in data) >= count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{count} workers were not ready within {READY_S:g} s")


def wait_serving(url: str) -> dict[str, Any] | None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        status = httpx.get(url + "/api/v1/pipeline/status", timeout=10).json()
        found = [d for d in status.get("data", []) if d.get("name") == SPLIT]
        if found and found[0].get("state") == "serving":
            return dict(found[0])
        time.sleep(1)
    return None


def ask(url: str, model: str, tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
    }
    start = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    took = time.monotonic() - start
    answer = r.json()
    made = answer["usage"]["completion_tokens"]
    return {
        "text": answer["choices"][0]["message"]["content"],
        "tokens": made,
        "tok_s": made / took,
    }


def gpu_gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    gauges = {}
    for line in text.splitlines():
        if line.startswith("shoal_gpu_") and not line.startswith("shoal_gpu_info"):
            name, _, value = line.rpartition(" ")
            gauges[name] = float(value)
    return gauges


def telemetry_row(gauges: dict[str, float]) -> tuple[str, str]:
    if not gauges:
        return "none", "no shoal_gpu_* gauges (no GPU sampled)"
    shown = [f"{k.split('{')[0].removeprefix('shoal_gpu_')}={v:g}" for k, v in gauges.items()]
    return "ok", ", ".join(shown)[:160]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
