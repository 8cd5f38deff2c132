"""Image generation: the tiny Stable Diffusion pipeline on CPU, through router + worker versus
calling the diffusers engine directly in this process.

Both paths run the same requests (64x64, ``--steps`` steps, fixed seeds) on the same pipeline
folder (built by scripts/make_tiny_sd_pipeline.py). Rounds alternate between the paths (and
which goes first) so drift on a shared machine hits both; the two never run at once. Seconds per
step are the gaps between step callbacks (direct) and between streamed progress events (router).

    python benchmarks/images.py --rounds 6 --images 4 --steps 8

What it shows: what Shoal's relay (HTTP, queue, WebSocket, base64 PNG) adds to an image job.
On this tiny pipeline a step is milliseconds, so the overhead is a visible share; on a real
model (seconds per step) the same fixed cost disappears in the noise.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from common import (
    free_port,
    median,
    pct,
    print_table,
    processes,
    wait_http,
    wait_workers,
    write_json,
)

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "src"))
from shoal.protocol.images import ImageJob  # noqa: E402
from shoal.worker.images.diffusers_engine import DiffusersEngine  # noqa: E402


@dataclass
class Samples:
    seconds_per_image: list[float] = field(default_factory=list)
    step_gaps: list[float] = field(default_factory=list)
    images_per_s: list[float] = field(default_factory=list)


def _marker(marks: list[float]) -> Callable[[int, int], None]:
    return lambda _done, _total: marks.append(time.perf_counter())


async def direct_round(engine: DiffusersEngine, images: int, steps: int, out: Samples) -> None:
    start = time.perf_counter()
    for i in range(images):
        marks: list[float] = []
        t0 = time.perf_counter()
        job = ImageJob(prompt="a red cat", width=64, height=64, steps=steps, seed=i)
        await engine.generate(job, i, _marker(marks))
        out.seconds_per_image.append(time.perf_counter() - t0)
        out.step_gaps += [b - a for a, b in zip(marks, marks[1:], strict=False)]
    out.images_per_s.append(images / (time.perf_counter() - start))


def router_round(client: httpx.Client, url: str, images: int, steps: int, out: Samples) -> None:
    start = time.perf_counter()
    for i in range(images):
        body = {"prompt": "a red cat", "size": "64x64", "steps": steps, "seed": i, "stream": True}
        marks: list[float] = []
        t0 = time.perf_counter()
        with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and "image_generation.progress" in line[:60]:
                    marks.append(time.perf_counter())
                elif line.startswith("data: {"):
                    assert orjson.loads(line[6:])["data"][0]["b64_json"]
        out.seconds_per_image.append(time.perf_counter() - t0)
        out.step_gaps += [b - a for a, b in zip(marks, marks[1:], strict=False)]
    out.images_per_s.append(images / (time.perf_counter() - start))


def summarize(s: Samples) -> dict[str, float]:
    return {
        "images_per_s_median": median(s.images_per_s),
        "seconds_per_image_p50": median(s.seconds_per_image),
        "seconds_per_image_p99": pct(s.seconds_per_image, 99),
        "seconds_per_step_p50": median(s.step_gaps),
        "images": len(s.seconds_per_image),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--images", type=int, default=4, help="images per round and path")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Path(tmp) / "tiny-sd"
        script = ROOT / "scripts" / "make_tiny_sd_pipeline.py"
        subprocess.run([sys.executable, str(script), str(pipeline)], check=True)
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        logs = Path(__file__).parent / "results" / "logs" / "images"
        samples = {"direct": Samples(), "router": Samples()}
        engine = DiffusersEngine(pipeline)
        with (
            processes(logs) as procs,
            httpx.Client(timeout=300) as client,
            asyncio.Runner() as loop,  # one loop: its worker thread (and torch's pools) stay warm
        ):
            procs.shoal("router", "router", "--port", str(port), "--log-level", "warning")
            wait_http(router + "/health")
            procs.shoal(
                "worker",
                "worker",
                "--router-url",
                f"127.0.0.1:{port}",
                "--image-model",
                str(pipeline),
                "--cache-dir",
                str(Path(tmp) / "cache"),
                "--log-level",
                "warning",
            )
            wait_workers(router, 1)
            url = router + "/v1/images/generations"

            def run(name: str, out: Samples, images: int) -> None:
                if name == "direct":
                    loop.run(direct_round(engine, images, args.steps, out))
                else:
                    router_round(client, url, images, args.steps, out)

            for name in samples:  # warm up both paths
                run(name, Samples(), 1)
            for r in range(args.rounds):
                order = list(samples) if r % 2 == 0 else list(samples)[::-1]
                for name in order:
                    print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
                    run(name, samples[name], args.images)
    results = {name: summarize(s) for name, s in samples.items()}
    d, rt = results["direct"], results["router"]
    results["added"] = {
        "seconds_per_image_p50": rt["seconds_per_image_p50"] - d["seconds_per_image_p50"],
        "seconds_per_step_p50": rt["seconds_per_step_p50"] - d["seconds_per_step_p50"],
        "throughput_ratio": rt["images_per_s_median"] / d["images_per_s_median"],
    }
    rows = [
        [
            name,
            results[name]["images_per_s_median"],
            results[name]["seconds_per_image_p50"],
            results[name]["seconds_per_image_p99"],
            results[name]["seconds_per_step_p50"],
            results[name]["images"],
        ]
        for name in ("direct", "router")
    ]
    print_table(
        f"tiny SD pipeline, 64x64, {args.steps} steps, CPU",
        ["path", "images/s", "s/image p50", "s/image p99", "s/step p50", "images"],
        rows,
    )
    print(f"router/direct throughput: {results['added']['throughput_ratio']:.3f}")
    write_json(
        "images",
        {
            "config": {"rounds": args.rounds, "images": args.images, "steps": args.steps},
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
