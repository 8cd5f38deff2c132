"""Running a long-lived async entry point: uvloop when present, signals cancel the main task."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any

try:
    import uvloop

    _loop_factory: Any = uvloop.new_event_loop
except ImportError:  # uvloop is Linux/macOS only; asyncio's loop works everywhere
    _loop_factory = None


async def _cancel_on_signals(main: Coroutine[Any, Any, None]) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    # A signal cancels us; by the time the CancelledError arrives, everything has cleaned up.
    with contextlib.suppress(asyncio.CancelledError):
        await main


def run(main: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=_loop_factory) as runner:
        runner.run(_cancel_on_signals(main))
