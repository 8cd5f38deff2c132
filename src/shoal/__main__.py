"""``python -m shoal`` and the ``shoal`` command.

A Ctrl-C while the command is imported (a second or more on a busy machine, before any signal
handler of a command is in place) is held until the imports are done, then exits with 130, as
one during a command does: raised in the middle of an import it printed a traceback of
whichever import it cut (or, inside pydantic's compiled core, a panic).

A reader that stops early (``shoal doctor --json | head``) closes the pipe under the command's
output; the command then ends quietly with 141, as one killed by SIGPIPE does, instead of a
``BrokenPipeError`` traceback.

When the command is done, every object left is frozen out of the garbage collector's reach:
the interpreter's last collection at exit walked the million objects a router or worker holds
(pydantic, SQLAlchemy, FastAPI) for one to two seconds after the command had finished, which
every stop, restart and ``shoal keys`` call waited through. Exit still flushes, runs the
``atexit`` handlers and joins threads; only that futile collection is skipped.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from types import FrameType

INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it."""

PIPE_CLOSED = 141
"""The exit status of a command whose reader went away (128 + SIGPIPE), as shells report it."""


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
    code: int | str | None
    try:
        try:
            code = main()
        except SystemExit as exit_:  # --help and argparse's errors end here: still flushed below
            code = exit_.code
        except KeyboardInterrupt:  # before the command's own handlers (main catches those after)
            code = INTERRUPTED
        sys.stdout.flush()  # what is still buffered may meet the closed pipe: inside the try
    except BrokenPipeError:
        code = _reader_gone()
    gc.freeze()
    sys.exit(code)


def _reader_gone() -> int:
    """Point stdout at /dev/null so the interpreter's own flush at exit does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return PIPE_CLOSED


if __name__ == "__main__":
    run()
