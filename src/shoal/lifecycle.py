"""Every lifecycle in Shoal as an explicit state machine: one checked table per machine.

A machine declares its moves once, next to its enum of states::

    ALLOWED = Transitions({Light.OFF: {Light.ON}, Light.ON: {Light.OFF, Light.BROKEN},
                           Light.BROKEN: set()})

The table is checked as it is declared (every state of the enum listed, every target one of
them; a terminal state lists none), so a typo fails at import. A move the table does not
allow raises ``IllegalTransition``, naming the machine, the state it was in and the one it was
told to take: a bug in the caller, never a condition to handle. Every move logs one line,
``<who>: <from> -> <to> <why>``, where ``who`` names the machine and its ids (``job j1
model=m worker=w``).

``Lifecycle`` holds the state of a machine that owns it (llama-server, the router link); a
machine whose state is a field of a record (a job, an async job's frozen record) calls
``Transitions.move`` with the old state and keeps the new one itself.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """A state machine was told to make a move its table does not allow."""

    def __init__(self, who: object, old: enum.Enum, new: enum.Enum) -> None:
        super().__init__(f"{who}: {old} -> {new} is not allowed")
        self.who, self.old, self.new = who, old, new


class Transitions(Mapping[S, frozenset[S]], Generic[S]):
    """One machine's table: each state -> the states it may move to (terminal: none)."""

    def __init__(self, allowed: Mapping[S, Iterable[S]], *, level: int = logging.INFO) -> None:
        """``level``: of the line each move logs (``DEBUG`` for a machine on the hot path)."""
        if not allowed:
            raise ValueError("a transition table needs at least one state")
        states = type(next(iter(allowed)))
        table = {old: frozenset(targets) for old, targets in allowed.items()}
        missing = [s for s in states if s not in table]
        if missing:
            raise ValueError(f"{states.__name__}: the transition table leaves out {missing}")
        strays = [t for targets in table.values() for t in targets if not isinstance(t, states)]
        strays += [s for s in table if not isinstance(s, states)]
        if strays:
            raise ValueError(f"{states.__name__}: the transition table names {strays}")
        self.states: type[S] = states
        self._table = table
        self.level = level

    def __getitem__(self, state: S) -> frozenset[S]:
        return self._table[state]

    def __iter__(self) -> Iterator[S]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def terminal(self, state: S) -> bool:
        """Whether ``state`` is the end: no move leaves it."""
        return not self._table[state]

    def sources(self, new: S) -> tuple[S, ...]:
        """The states that may move to ``new`` (the table read backwards)."""
        return tuple(old for old, targets in self._table.items() if new in targets)

    def check(self, who: object, old: S, new: S) -> None:
        """Raise ``IllegalTransition`` unless the table allows ``old`` -> ``new``. ``who``
        names the machine and its ids when made a string (only then: a log line's
        arguments are formatted only if it is written)."""
        if new not in self._table[old]:
            raise IllegalTransition(who, old, new)

    def move(self, who: object, old: S, new: S, why: str, log: logging.Logger) -> S:
        """Check the move and log its one line on ``log`` (the machine's module's logger);
        ``new``, for the caller to keep."""
        self.check(who, old, new)
        log.log(self.level, "%s: %s -> %s %s", who, old, new, why)
        return new


class Lifecycle(Generic[S]):
    """The state of one machine that holds it, moved only through its table."""

    def __init__(self, name: str, allowed: Transitions[S], state: S, log: logging.Logger) -> None:
        """``name`` starts every log line (``llama-server qwen2.5-0.5b``); ``log`` is the
        owning module's logger."""
        self.name = name
        self.allowed = allowed
        self._state = state
        self._log = log

    @property
    def state(self) -> S:
        return self._state

    def move(self, new: S, why: str = "") -> None:
        """Move to ``new``, or raise ``IllegalTransition`` if the table does not allow it."""
        self._state = self.allowed.move(self.name, self._state, new, why, self._log)
