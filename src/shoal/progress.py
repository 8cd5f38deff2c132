"""Progress reporting for long set-up steps (downloads, extraction, builds).

On a terminal (stderr is a TTY) this draws a rich progress bar; elsewhere (CI, a log file)
it logs one line at each 10 % step, so logs show progress without a line per chunk.
This module is the one place library code writes to the user's terminal.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Self

from rich import filesize
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as RichProgress

logger = logging.getLogger(__name__)

LOG_STEP_PERCENT = 10
"""Without a terminal, one log line per this many percent of progress."""

BYTES_UNIT = "B"
"""Unit that makes amounts print as file sizes (``38.2 MB``)."""


def _stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def _stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def step(message: str) -> None:
    """Report one set-up step: printed to stderr on a terminal, logged otherwise."""
    if _stderr_is_tty():
        _stderr_console().print(message, markup=False)
    else:
        logger.info("%s", message)


def _format_amount(amount: float, unit: str) -> str:
    if unit == BYTES_UNIT:
        return filesize.decimal(int(amount))
    text = f"{amount:g}"
    return f"{text} {unit}" if unit else text


class Progress:
    """Progress of one task with a known (or unknown) total, used as a context manager.

    >>> with Progress("Extracting model", total=98_362_432, unit="B") as p:
    ...     p.advance(1_048_576)
    """

    def __init__(
        self,
        description: str,
        total: float | None,
        unit: str = "",
        *,
        interactive: bool | None = None,
    ) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.completed: float = 0.0
        self._interactive = _stderr_is_tty() if interactive is None else interactive
        self._rich: RichProgress | None = None
        self._task: TaskID | None = None
        self._last_logged_step = 0
        self._started = 0.0

    def __enter__(self) -> Self:
        self._started = time.monotonic()
        if self._interactive:
            self._rich = RichProgress(*self._columns(), console=_stderr_console())
            self._rich.start()
            self._task = self._rich.add_task(self.description, total=self.total)
        else:
            logger.info("%s: started", self.description)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        elapsed = time.monotonic() - self._started
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        if exc_type is None:
            logger.info("%s: done in %.1f s", self.description, elapsed)
        else:
            logger.info("%s: stopped after %.1f s", self.description, elapsed)

    def update(self, completed: float) -> None:
        """Set the amount done so far."""
        self.completed = completed
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, completed=completed)
        else:
            self._log_step()

    def advance(self, n: float = 1) -> None:
        """Add ``n`` to the amount done."""
        self.update(self.completed + n)

    def _log_step(self) -> None:
        if not self.total:
            return
        percent = min(100.0, 100.0 * self.completed / self.total)
        reached = int(percent // LOG_STEP_PERCENT) * LOG_STEP_PERCENT
        if reached <= self._last_logged_step:
            return
        self._last_logged_step = reached
        if self.unit == "%":
            logger.info("%s: %d%%", self.description, reached)
            return
        logger.info(
            "%s: %d%% (%s of %s)",
            self.description,
            reached,
            _format_amount(self.completed, self.unit),
            _format_amount(self.total, self.unit),
        )

    def _columns(self) -> list[ProgressColumn]:
        columns: list[ProgressColumn] = [
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
        ]
        if self.total is None:
            return [*columns, TimeElapsedColumn()]
        columns.append(BarColumn())
        if self.unit == BYTES_UNIT:
            columns += [DownloadColumn(), TransferSpeedColumn()]
        elif self.unit and self.unit != "%":
            columns += [MofNCompleteColumn(), TextColumn(self.unit, markup=False)]
        else:
            columns.append(TaskProgressColumn())
        return [*columns, TimeRemainingColumn(), TimeElapsedColumn()]
