"""``shoal up``'s composition root: one router and one worker in one task group."""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys

from pydantic import SecretStr

from shoal.keys import KeyStoreError, Scope, ensure_bootstrap_keys, open_store
from shoal.router.app import RouterConfigError, bind, serve
from shoal.router.settings import RouterSettings
from shoal.security import is_loopback
from shoal.settings import flag_and_variable
from shoal.up.settings import UpSettings
from shoal.worker.hardware import detect_profile
from shoal.worker.main import run_worker
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.plan import plan

log = logging.getLogger(__name__)


TRY_IT_MAX_TOKENS = 64
"""The banner's example asks for at most this many tokens: without a limit a small model may
go on to the end of its context, minutes on a busy CPU."""


class UpError(Exception):
    pass


def banner(
    url: str,
    model: str,
    new_keys: dict[Scope, str] | None,
    extra_key: str | None,
    worker_url: str | None = None,
) -> str:
    """What ``shoal up`` prints once everything is ready; new keys are shown this once.
    ``worker_url``: the --router-url a worker of another machine gives (None: this router
    listens on loopback only).

    The "Try it" lines export what every OpenAI client reads on its own (``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY``), as the README's examples do; the key's export only on the run that
    creates it (or when given with --api-key). No server reads those variables.
    """
    api_key = (new_keys or {}).get(Scope.INFERENCE) or extra_key
    if new_keys:
        keys = (
            f"API key:   {new_keys[Scope.INFERENCE]}   (inference: for clients)\n"
            f"Admin key: {new_keys[Scope.ADMIN]}   (dashboard and control plane)\n"
            "           Shown this once: Shoal keeps only their hashes. Keep them now.\n"
        )
    elif extra_key:
        keys = (
            f"API key:   the one given with {flag_and_variable(UpSettings, 'api_key')} "
            "(database keys work too)\n"
        )
    else:
        keys = (
            "API key:   the inference key the first run printed (Shoal keeps only its hash, so\n"
            "           it cannot be shown again; lost it? `shoal keys create --scope inference`)\n"
        )
    try_it = "Try it:\n" if api_key else "Try it, with that key in OPENAI_API_KEY:\n"
    try_it += f"  export OPENAI_BASE_URL={url}/v1\n"
    if api_key:
        try_it += f"  export OPENAI_API_KEY={api_key}\n"
    return (
        "\nShoal is up.\n"
        f"Endpoint:  {url}/v1   (OpenAI-compatible)\n"
        f"Dashboard: {url}/\n"
        f"Model:     {model}\n"
        f"{keys}"
        f"{try_it}"
        f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        '    -H "Authorization: Bearer $OPENAI_API_KEY" \\\n'
        f'    -d \'{{"model": "{model}", "max_tokens": {TRY_IT_MAX_TOKENS}, "stream": true, '
        '"messages": [{"role": "user", "content": "Say hello"}]}\'\n'
        f"{adding_a_worker(url, worker_url)}"
        "Press Ctrl-C to stop everything.\n"
    )


def adding_a_worker(url: str, worker_url: str | None) -> str:
    """How to add a worker: a worker key, then ``shoal worker`` with this router's address."""
    if worker_url is None:
        router_url = url.removeprefix("http://")
        where = "on this machine; other machines can join once shoal up runs with --host 0.0.0.0"
    else:
        router_url = worker_url
        where = "on the worker's machine" + (
            ", THIS_HOST being this machine's address" if "THIS_HOST" in worker_url else ""
        )
    return (
        "Add a worker (`shoal keys create --scope worker --name NAME` prints a worker key):\n"
        f"  shoal worker --router-url {router_url} --gpu-key WORKER_KEY\n"
        f"  ({where})\n"
    )


def image_banner(url: str) -> str:
    """How to try the image model, printed after the banner when ``--image-model`` is on."""
    return (
        "Images (the image model loads in the background; the first request waits for it):\n"
        f"  curl {url}/v1/images/generations -H 'Content-Type: application/json' \\\n"
        '    -H "Authorization: Bearer $OPENAI_API_KEY" \\\n'
        '    -d \'{"prompt": "a lighthouse at dusk", "size": "512x512"}\'\n'
    )


def _reachable_host(host: str) -> str:
    """How this machine reaches its own router: loopback for wildcard binds, brackets for v6."""
    if host in ("0.0.0.0", "::", "") or is_loopback(host):
        return "127.0.0.1" if ":" not in host else "[::1]"
    return f"[{host}]" if ":" in host else host


def _worker_url(host: str, port: int) -> str | None:
    """The --router-url of a worker on another machine; None when it cannot reach this one."""
    if is_loopback(host):
        return None
    if host in ("0.0.0.0", "::", ""):
        return f"THIS_HOST:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def run_up(settings: UpSettings, path_env: str | None) -> None:
    api_key = settings.api_key
    try:
        store = await asyncio.to_thread(open_store, settings.database_url)
    except KeyStoreError as exc:
        raise UpError(str(exc)) from None
    try:
        new_keys = await asyncio.to_thread(ensure_bootstrap_keys, store)
    finally:
        store.close()
    if new_keys:
        log.info("created an inference and an admin key in %s", store.db.display())
    gpu_key = secrets.token_urlsafe(24)  # this process's worker is its only worker
    router_settings = RouterSettings(
        host=settings.host,
        port=settings.port,
        api_key=(SecretStr(api_key),) if api_key else (),
        database_url=settings.database_url,
        gpu_key=(SecretStr(gpu_key),),
        cache_dir=settings.cache_dir,
        log_level=settings.log_level,
    )
    try:
        sock = bind(settings.host, settings.port)
    except RouterConfigError as exc:
        raise UpError(str(exc)) from None
    port = sock.getsockname()[1]
    local = _reachable_host(settings.host)
    worker_settings = WorkerSettings(
        router_url=f"{local}:{port}",
        gpu_key=SecretStr(gpu_key),
        name="local",
        model=settings.model,
        model_alias=settings.model_alias,
        image_model=settings.image_model,
        slots=settings.slots,
        ctx_size=settings.ctx_size,
        threads=settings.threads,
        llama_server_path=settings.llama_server_path,
        llama_cpp_backend=settings.llama_cpp_backend,
        llama_cpp_from=settings.llama_cpp_from,
        github_url=settings.github_url,
        github_token=settings.github_token,
        cache_dir=settings.cache_dir,
        log_level=settings.log_level,
    )
    machine = await asyncio.to_thread(detect_profile)
    the_plan = await asyncio.to_thread(plan, worker_settings, path_env, machine)
    url = f"http://{local}:{port}"
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(serve(router_settings, sock))
        tg.create_task(
            run_worker(
                worker_settings, the_plan, on_ready=ready.set, path_env=path_env, machine=machine
            )
        )
        await ready.wait()
        worker_url = _worker_url(settings.host, port)
        sys.stdout.write(banner(url, the_plan.model.name, new_keys, api_key, worker_url))
        if settings.image_model:
            sys.stdout.write(image_banner(url))
        sys.stdout.flush()
