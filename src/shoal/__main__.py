"""``python -m shoal`` and the ``shoal`` command.

A Ctrl-C while the command is imported (a second or more on a busy machine, before any signal
handler of a command is in place) is held until the imports are done, then exits with 130, as
one during a command does: raised in the middle of an import it printed a traceback of
whichever import it cut (or, inside pydantic's compiled core, a panic).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it."""


def run() -> None:
    interrupted = False

    def hold(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        interrupted = True

    previous = signal.getsignal(signal.SIGINT)
    holding = previous not in (signal.SIG_IGN, None)  # a background job ignores Ctrl-C: kept
    if holding:
        signal.signal(signal.SIGINT, hold)
    try:
        from shoal.cli.main import main
    finally:
        if holding:
            signal.signal(signal.SIGINT, previous)
    if interrupted:
        sys.exit(INTERRUPTED)
    try:
        code = main()
    except KeyboardInterrupt:  # before the command's own handlers (main catches those after)
        code = INTERRUPTED
    sys.exit(code)


if __name__ == "__main__":
    run()
