"""``shoal doctor``: is this machine right for ``shoal worker``, and if not, what fixes it.

It takes the worker's own options (flags and ``SHOAL_*`` variables alike), so it checks what
that worker would do here: the GPUs and their driver, the llama.cpp backend chosen and why,
the llama-server that would run and whether it drives the GPUs (a CPU build on a GPU machine
is an error, with the command that fixes it), the model it would serve and its fit, and,
with ``--router-url``, that the router answers and accepts this worker's key
(``--gpu-key``). Nothing is downloaded or built. Exit status 1 when a check found an error;
``--json`` for machines. The checks themselves are ``doctor_checks.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import urllib.request
from urllib.parse import urlsplit

from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import ClientConnection, connect

from shoal.cli import logs
from shoal.cli.doctor_checks import (
    Check,
    backend_check,
    binary_check,
    gpus_check,
    model_check,
    no_router_check,
    router_check,
    summary,
)
from shoal.cli.errors import settings_for
from shoal.hardware.detect import detect_machine, parse_gpu_devices
from shoal.hardware.profile import MachineProfile
from shoal.llama_cpp.backend import BackendChoice, MachineFacts, choose_backend
from shoal.llama_cpp.devices import list_devices
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.facts import gather
from shoal.llama_cpp.options import binaries
from shoal.llama_cpp.release import RELEASE_TAG, asset_name, runtime_asset_name
from shoal.models.catalog_file import load_catalog
from shoal.models.default import DEFAULT_MODEL
from shoal.models.errors import ModelError
from shoal.models.resolve import FitContext, decide
from shoal.protocol.messages import PROTOCOL_VERSION, RefusalCode
from shoal.worker.hardware import HardwareError, selected
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.residency.models_file import ModelsFileError, load_models_file
from shoal.worker.tls import Refusal, client_tls_context

ROUTER_TIMEOUT_S = 5.0
"""How long the router may take to answer ``/health`` and the worker socket's first frame."""
_PROBE = json.dumps({"protocol_version": PROTOCOL_VERSION, "type": "doctor"})
"""Not a registration: a router that accepts the key and the protocol refuses it as one,
which is the answer wanted (it registers nothing)."""
WIDTH = 10
NO_MODEL = "no --model: a worker serves the router's default model; this is Shoal's default"


def doctor(args: argparse.Namespace) -> int:
    settings = settings_for(WorkerSettings, args)
    logs.setup(settings.log_level if "log_level" in settings.model_fields_set else "error")
    checks = run_checks(settings, os.environ.get("PATH"))
    errors = sum(c.status == "error" for c in checks)
    if args.json:
        body = {"ok": errors == 0, "checks": [c.json() for c in checks]}
        print(json.dumps(body, indent=2))
    else:
        print(render(checks))
    return 1 if errors else 0


def render(checks: list[Check]) -> str:
    lines = ["shoal doctor: this machine, for `shoal worker` with these options", ""]
    for c in checks:
        lines.append(f"{c.status:<6} {c.name:<{WIDTH}} {c.finding}")
        lines.extend(f"{'':<6} {'':<{WIDTH}}   {d}" for d in c.details)
        if c.fix:
            lines.append(f"{'':<6} {'fix:':<{WIDTH}} {c.fix}")
    return "\n".join([*lines, "", summary(checks)])


def run_checks(settings: WorkerSettings, path_env: str | None) -> list[Check]:
    profile = detect_machine()
    facts = gather(profile.gpus, path_env=path_env, vulkan_sdk=os.environ.get("VULKAN_SDK"))
    checks = [gpus_check(facts)]
    choice: BackendChoice | None = None
    try:
        choice = choose_backend(facts, settings.llama_cpp_backend)
    except LlamaCppError as exc:
        checks.append(Check("backend", "error", str(exc), "leave --llama-cpp-backend on auto"))
    if choice is not None:
        checks.append(backend_check(choice, _assets(choice, facts)))
    try:
        used = selected(profile, settings.gpu_devices)  # the worker's own rule
    except HardwareError as exc:
        fix = "give the indices listed above, or none for the CPU only"
        return [*checks, Check("--gpu-devices", "error", str(exc), fix)]
    llama = _binary(settings, path_env, choice, used)
    checks.append(llama)
    checks.extend(_models(settings, profile, on_cpu_only=llama.status == "error"))
    checks.append(_router(settings))
    return checks


def _assets(choice: BackendChoice, facts: MachineFacts) -> list[str]:
    """The release files ``shoal llama-cpp install`` would download for ``choice``."""
    names = (
        f(RELEASE_TAG, facts.system, facts.machine, choice.backend, cuda_major=choice.cuda_major)
        for f in (asset_name, runtime_asset_name)
    )
    return [n for n in names if n is not None]


def _binary(
    settings: WorkerSettings,
    path_env: str | None,
    choice: BackendChoice | None,
    profile: MachineProfile,
) -> Check:
    if settings.backend_url:
        return Check("llama.cpp", "skip", f"not used: attached to {settings.backend_url}")
    try:
        found = binaries(settings, path_env, allow_build=False, gpus=profile.gpus, choice=choice)
    except LlamaCppError as exc:
        return binary_check(str(exc), (), profile.gpus, choice)
    try:
        listed = list_devices(found.llama_server)
    except LlamaCppError as exc:
        return binary_check(found, str(exc), profile.gpus, choice)
    return binary_check(found, listed, profile.gpus, choice)


def _models(settings: WorkerSettings, profile: MachineProfile, *, on_cpu_only: bool) -> list[Check]:
    """One check per text model: each ``--model`` (repeated or comma-separated), each entry
    of ``--models-file``, else the default model."""
    if settings.models_file is not None:
        try:
            named: list[str | None] = [s.model for s in load_models_file(settings.models_file)]
        except ModelsFileError as exc:
            return [Check("model", "error", str(exc), "fix the models file (--models-file)")]
    else:
        named = list(settings.models) or [None]
    return [_model(settings, profile, m, on_cpu_only=on_cpu_only) for m in named]


def _model(
    settings: WorkerSettings, profile: MachineProfile, given: str | None, *, on_cpu_only: bool
) -> Check:
    if settings.backend_url:
        return Check("model", "skip", f"served by {settings.backend_url}")
    if settings.model_path is not None:
        if settings.model_path.is_file():
            return Check("model", "ok", f"{settings.model_path} (its fit is not estimated here)")
        return Check("model", "error", f"{settings.model_path} is missing", "check --model-path")
    model = given or DEFAULT_MODEL.id
    note = () if given else (NO_MODEL,)
    entry = load_catalog().get(model)
    if settings.model_store or entry is None:
        return model_check(model, None, on_cpu_only, note)
    fit = FitContext(
        profile,
        ctx_total=settings.ctx_size * settings.slots,
        slots=settings.slots,
        gpu_indices=None
        if settings.gpu_devices is None
        else parse_gpu_devices(settings.gpu_devices),
    )
    try:
        decision = decide(entry, settings.cache_dir, quantization=settings.quantization, fit=fit)
    except ModelError as exc:
        return model_check(model, str(exc), on_cpu_only, note)
    return model_check(model, decision, on_cpu_only, note)


def _router(settings: WorkerSettings) -> Check:
    if settings.redis_url is not None:
        return no_router_check("pull mode (--redis-url) dials no router")
    if "router_url" not in settings.model_fields_set:
        return no_router_check("give --router-url (SHOAL_ROUTER_URL), as to the worker")
    key = settings.gpu_key.get_secret_value() if settings.gpu_key else None
    checks = [router_check(url, *probe_router(url, key, settings)) for url in settings.ws_urls]
    return next((c for c in checks if c.status == "error"), checks[0])


def probe_router(
    ws_url: str, key: str | None, settings: WorkerSettings
) -> tuple[str | None, str | None]:
    """(what went wrong, or None; the router's version) for the router at ``ws_url``: its
    ``/health``, then its worker socket with ``key``."""
    try:
        tls = client_tls_context(settings.tls_ca)
    except Refusal as exc:
        return str(exc), None
    parts = urlsplit(ws_url)
    secure = parts.scheme == "wss"
    health = f"{'https' if secure else 'http'}://{parts.netloc}/health"
    try:
        with urllib.request.urlopen(
            health, timeout=ROUTER_TIMEOUT_S, context=tls if secure else None
        ) as r:
            version = str(json.load(r).get("version", "?"))
    except (OSError, ValueError) as exc:
        return f"no answer from {health}: {exc}", None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with connect(
            ws_url,
            additional_headers=headers,
            open_timeout=ROUTER_TIMEOUT_S,
            ssl=tls if secure else None,
        ) as ws:
            return _exchange(ws), version
    except (OSError, TimeoutError, WebSocketException) as exc:
        return f"the worker socket failed: {exc}", version


def _exchange(ws: ClientConnection) -> str | None:
    """Send the probe and read the router's answer: it refuses a wrong key at once, before
    reading anything (so the send may find the socket closed), else it refuses the probe."""
    with contextlib.suppress(ConnectionClosed):
        ws.send(_PROBE)
    try:
        return _refusal(ws.recv(timeout=ROUTER_TIMEOUT_S))
    except ConnectionClosed as exc:
        reason = exc.rcvd.reason if exc.rcvd is not None else ""
        return f"the router closed the worker socket: {reason or exc}"


def _refusal(reply: str | bytes) -> str | None:
    """What the router's answer to the probe says: None when only the probe was refused."""
    try:
        answer = json.loads(reply)
        code, reason = answer["code"], answer["reason"]
    except (ValueError, KeyError, TypeError):
        return f"an unexpected answer on the worker socket: {reply!r:.200}"
    if code == RefusalCode.BAD_REGISTRATION:
        return None
    if code == RefusalCode.BAD_KEY:
        return "the router refuses this GPU key (missing or wrong)"
    return f"the router refuses this worker: {reason}"
