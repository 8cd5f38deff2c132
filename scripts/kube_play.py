"""Turn the rendered Kubernetes manifests into what ``podman kube play`` runs on one machine.

Used by ``scripts/container-check.sh``: keeps Shoal's own Deployments (router and worker),
one replica each, on the host's network (kube play has no Services or cluster DNS), with the
keys written in (no Kubernetes Secret there), the given Redis, the router's SQLite instead of
PostgreSQL, and the model cache on a podman volume. Everything else is as rendered.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

OURS = {"shoal-router", "shoal-worker"}


def _env(container: dict[str, Any], values: dict[str, str], drop: set[str]) -> None:
    env = [e for e in container.get("env", []) if e["name"] not in drop and e["name"] not in values]
    for entry in env:
        ref = entry.pop("valueFrom", None)
        if ref is not None and "fieldRef" in ref:
            entry["value"] = "kube-play-" + container["name"]
    container["env"] = env + [{"name": k, "value": v} for k, v in values.items()]


def adapt(doc: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    name = doc["metadata"]["name"]
    doc["metadata"]["name"] = f"{name}-check"
    spec = doc["spec"]
    spec["replicas"] = 1
    pod = spec["template"]["spec"]
    pod["hostNetwork"] = True
    keys = {
        "SHOAL_GPU_KEY": args.gpu_key,
        "SHOAL_ROUTER_API_KEY": args.api_key,
        "SHOAL_ADMIN_KEY": args.admin_key,
    }
    for container in pod["containers"]:
        container["image"] = args.image
        container.pop("ports", None)  # the host's network: nothing to map
        if name == "shoal-router":
            values = {
                "SHOAL_HOST": "127.0.0.1",
                "SHOAL_PORT": str(args.port),
                "SHOAL_REDIS_URL": args.redis_url,
                "SHOAL_REDIS_PREFIX": args.redis_prefix,
                **keys,
            }
            _env(container, values, drop={"SHOAL_DATABASE_URL"})
            for probe in ("readinessProbe", "livenessProbe"):
                container[probe]["httpGet"]["port"] = args.port
        else:
            values = {
                "SHOAL_ROUTER_URL": f"127.0.0.1:{args.port}",
                "SHOAL_THREADS": "1",
                "SHOAL_GPU_KEY": args.gpu_key,
            }
            _env(container, values, drop=set())
    for volume in pod.get("volumes", []):
        if volume["name"] == "model-cache":
            volume.pop("emptyDir", None)
            volume["persistentVolumeClaim"] = {"claimName": args.models_volume}
        elif "emptyDir" in volume:
            # podman 4.3 makes an emptyDir a named volume by its name: one per pod here, as
            # on Kubernetes, not one /tmp shared by the router's and the worker's pods.
            _rename(pod, volume["name"], f"shoal-check-{name}-{volume['name']}")
    return doc


def _rename(pod: dict[str, Any], old: str, new: str) -> None:
    for volume in pod["volumes"]:
        if volume["name"] == old:
            volume["name"] = new
    for container in pod["containers"]:
        for mount in container.get("volumeMounts", []):
            if mount["name"] == old:
                mount["name"] = new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rendered", type=Path)
    parser.add_argument("out", type=Path)
    for flag in ("image", "redis-url", "redis-prefix", "api-key", "admin-key", "gpu-key"):
        parser.add_argument(f"--{flag}", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--models-volume", required=True)
    args = parser.parse_args()
    docs = [d for d in yaml.safe_load_all(args.rendered.read_text()) if d]
    ours = [
        adapt(d, args) for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] in OURS
    ]
    args.out.write_text(yaml.safe_dump_all(ours, sort_keys=False))


if __name__ == "__main__":
    main()
