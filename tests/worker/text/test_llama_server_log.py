"""llama-server's log file, as the worker writes it: whole up to the ready line once READY
(a split model's head reads the placement from it then). Real llama-server, real model."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shoal.protocol.messages import BackendState
from shoal.worker.text.llama_server import LlamaServer, LlamaServerConfig


async def test_the_log_holds_every_line_up_to_the_ready_marker_when_ready(
    llama_server: Path, model_path: Path, tmp_path: Path
) -> None:
    log_file = tmp_path / "llama-server.log"
    config = LlamaServerConfig(
        binary=llama_server,
        model_path=model_path,
        alias="smol",
        slots=1,
        ctx_size=512,
        log_file=log_file,
        threads=1,
        max_restarts=0,
        extra_args=("-lv", "4"),
    )
    seen: list[str] = []
    ready = asyncio.Event()

    def on_state(state: BackendState, detail: str) -> None:
        if state is BackendState.READY:
            seen.append(log_file.read_text(errors="replace"))  # at once, as the head does
            ready.set()

    server = LlamaServer(config, on_state)
    task = asyncio.create_task(server.run())
    try:
        async with asyncio.timeout(120):
            await ready.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    [text] = seen
    assert "compute buffer size" in text and "listening on http" in text, text[-2000:]
