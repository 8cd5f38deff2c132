"""Running a long-lived async entry point: uvloop when present, signals cancel the main task
(SIGTERM may first ask it to drain: ``on_sigterm``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine
from typing import Any

try:
    import uvloop

    _loop_factory: Any = uvloop.new_event_loop
except ImportError:  # uvloop is Linux/macOS only; asyncio's loop works everywhere
    _loop_factory = None


async def _cancel_on_signals(
    main: Coroutine[Any, Any, None], on_sigterm: Callable[[], bool] | None
) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def sigterm() -> None:
        if on_sigterm is None or not on_sigterm():
            task.cancel()

    loop.add_signal_handler(signal.SIGTERM, sigterm)
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    # A signal cancels us; by the time the CancelledError arrives, everything has cleaned up.
    with contextlib.suppress(asyncio.CancelledError):
        await main


def run(main: Coroutine[Any, Any, None], on_sigterm: Callable[[], bool] | None = None) -> None:
    """Run ``main``; SIGINT cancels it, and so does SIGTERM unless ``on_sigterm`` returns True
    (it took the signal: a worker starts draining, and returns False the second time)."""
    with asyncio.Runner(loop_factory=_loop_factory) as runner:
        runner.run(_cancel_on_signals(main, on_sigterm))
