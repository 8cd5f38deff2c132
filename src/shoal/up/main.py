"""``shoal up``'s composition root: one router and one worker in one task group."""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys

from pydantic import SecretStr

from shoal.router.app import RouterConfigError, bind, serve
from shoal.router.settings import RouterSettings
from shoal.security import is_loopback
from shoal.up.settings import UpSettings
from shoal.worker.main import plan, run_worker
from shoal.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class UpError(Exception):
    pass


def banner(url: str, model: str, api_key: str | None) -> str:
    auth = f' \\\n  -H "Authorization: Bearer {api_key}"' if api_key else ""
    key_line = (
        f"API key:  {api_key}   (shown once; clients send it as a Bearer token)\n"
        if (api_key)
        else "API key:  none needed (listening on loopback only)\n"
    )
    return (
        "\nShoal is up.\n"
        f"Endpoint: {url}/v1   (OpenAI-compatible)\n"
        f"Model:    {model}\n"
        f"{key_line}"
        "Try it:\n"
        f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f'    -d \'{{"model": "{model}", "stream": true, '
        '"messages": [{"role": "user", "content": "Say hello"}]}\'\n'
        "Press Ctrl-C to stop everything.\n"
    )


def _reachable_host(host: str) -> str:
    """How this machine reaches its own router: loopback for wildcard binds, brackets for v6."""
    if host in ("0.0.0.0", "::", "") or is_loopback(host):
        return "127.0.0.1" if ":" not in host else "[::1]"
    return f"[{host}]" if ":" in host else host


async def run_up(settings: UpSettings, path_env: str | None) -> None:
    api_key = settings.api_key
    if api_key is None and not is_loopback(settings.host):
        api_key = "sk-shoal-" + secrets.token_urlsafe(24)
    gpu_key = secrets.token_urlsafe(24)  # this process's worker is its only worker
    router_settings = RouterSettings(
        host=settings.host,
        port=settings.port,
        api_key=(SecretStr(api_key),) if api_key else (),
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
        slots=settings.slots,
        ctx_size=settings.ctx_size,
        threads=settings.threads,
        llama_server_path=settings.llama_server_path,
        cache_dir=settings.cache_dir,
        log_level=settings.log_level,
    )
    the_plan = await asyncio.to_thread(plan, worker_settings, path_env)
    url = f"http://{local}:{port}"
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(serve(router_settings, sock))
        tg.create_task(run_worker(worker_settings, the_plan, on_ready=ready.set))
        await ready.wait()
        sys.stdout.write(banner(url, the_plan.model.name, api_key))
        sys.stdout.flush()
