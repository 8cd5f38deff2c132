"""The deployment files hold together, checked without a cluster or a kustomize binary.

Every YAML parses; every kustomization's resources, patches and components exist; the
overlays patch what the base defines and name the image the Deployments use; every probe of
a Shoal container asks ``/health`` (HTTP) or runs the image's healthcheck; the Secret keys
the manifests read are the ones the README tells you to create; the workers' grace period
covers their drain; the compose file's secrets exist and its services use the image's
commands. (``scripts/container-check.sh`` renders and runs them for real with podman.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
KUSTOMIZATIONS = sorted(KUBE.rglob("kustomization.yaml"))


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def resources(kustomization: Path) -> list[dict[str, Any]]:
    """What a kustomization builds, before patches: its own files and its bases'."""
    spec = docs(kustomization)[0]
    found: list[dict[str, Any]] = []
    for entry in spec.get("resources", []) + spec.get("components", []):
        target = (kustomization.parent / entry).resolve()
        if target.is_dir():
            found += resources(target / "kustomization.yaml")
        else:
            found += docs(target)
    return found


def containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        c
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    ]


def test_every_yaml_parses() -> None:
    files = sorted(KUBE.rglob("*.yaml")) + [DEPLOY / "compose.yaml"]
    assert len(files) > 8
    for path in files:
        assert docs(path), path


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: str(p.parent.name))
def test_references_resolve(kustomization: Path) -> None:
    spec = docs(kustomization)[0]
    assert spec["kind"] in ("Kustomization", "Component")
    for entry in spec.get("resources", []) + spec.get("components", []):
        assert (kustomization.parent / entry).exists(), (kustomization, entry)
    built = {(o["kind"], o["metadata"]["name"]) for o in resources(kustomization)}
    for patch in spec.get("patches", []):
        for target in docs(kustomization.parent / patch["path"]):
            assert (target["kind"], target["metadata"]["name"]) in built, (patch, built)
    for image in spec.get("images", []):
        used = {c["image"] for c in containers(resources(kustomization))}
        assert image["name"] in used, (image, used)


def test_probes_ask_health_and_workers_drain_within_their_grace() -> None:
    base = resources(KUBE / "base" / "kustomization.yaml")
    shoal = [c for c in containers(base) if c["image"] == "shoal"]
    assert {c["name"] for c in shoal} == {"router", "worker"}
    for container in shoal:
        probes = [container[k] for k in container if k.endswith("Probe")]
        assert probes, container["name"]
        for probe in probes:
            http = probe.get("httpGet")
            assert (http and http["path"] == "/health") or probe["exec"]["command"] == [
                "shoal-healthcheck"
            ], (container["name"], probe)
    [worker] = [
        o for o in base if o["kind"] == "Deployment" and o["metadata"]["name"] == "shoal-worker"
    ]
    pod = worker["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert float(env["SHOAL_DRAIN_TIMEOUT"]) < pod["terminationGracePeriodSeconds"]
    kinds = {o["kind"] for o in base}
    assert {"PodDisruptionBudget", "Service", "Deployment"} <= kinds


def test_the_secret_keys_read_are_the_ones_the_readme_creates() -> None:
    read = set()
    for path in KUBE.rglob("*.yaml"):
        read |= set(re.findall(r"name: shoal-keys, key: ([a-z-]+)", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    created = set(re.findall(r"--from-literal=([a-z-]+)=", readme))
    assert read and read == created, (read, created)


def test_compose_secrets_exist_and_services_run_shoal_commands() -> None:
    [compose] = docs(DEPLOY / "compose.yaml")
    declared = set(compose["secrets"])
    made = set(re.findall(r"make (\w+) ", (DEPLOY / "make-secrets.sh").read_text()))
    assert declared == made, (declared, made)
    services = compose["services"]
    assert {"router", "redis", "postgres", "worker-1", "worker-2"} <= set(services)
    for name, service in services.items():
        assert set(service.get("secrets", [])) <= declared, name
        if "build" in service:
            assert service["command"][0] in ("router", "worker", "up", "data"), name
            assert (ROOT / service["build"]["dockerfile"]).is_file()
    assert services["worker-1"]["environment"]["SHOAL_ROUTER_URL"] == "router:8000"
