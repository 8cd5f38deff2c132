"""How often an idle worker heartbeats, from the size of the fleet (pure).

Every heartbeat costs the router a frame to read, decode and act on. At the base interval
(``--heartbeat-interval``, 5 s) ten thousand workers send 2,000 a second, and a router that
serves nothing spends most of a core hearing that they are alive. So the router keeps the
idle fleet's heartbeats under a budget (``--heartbeat-rate``, heartbeats per second): the
interval an idle worker is told (``HeartbeatInterval``) is the base doubled as often as it
takes for every worker beating at it to stay within the budget, e.g. with the defaults

    workers        <= 1,250   2,500   5,000   10,000   20,000
    interval (s)        5       10      20       40       80

A worker running a job beats at the base interval whatever it was told (the stall rule and
the queue's leases assume it), and the router gives each worker the time its own interval
allows before taking it for lost (``--heartbeat-misses`` x its interval). The interval grows
as soon as the fleet passes a step and shrinks only when it is well below the step beneath
(``SHRINK_BELOW``), so a fleet at the edge of a step does not make the router tell every
worker a new interval each time one joins or leaves.
"""

from __future__ import annotations

import math

MAX_DOUBLINGS = 6
"""The longest interval is the base x 2**6 (320 s at 5 s): a worker lost while idle is still
noticed within minutes, and past that size the budget is exceeded rather than kept."""
SHRINK_BELOW = 0.75
"""A shorter interval is taken again only once it would keep the fleet within this share of
the budget (hysteresis: a fleet at the edge of a step keeps its interval)."""


def needed_interval(workers: int, base: float, rate: float) -> float:
    """The shortest of base, 2 x base, 4 x base ... at which ``workers`` idle workers send at
    most ``rate`` heartbeats a second (capped at ``MAX_DOUBLINGS`` doublings)."""
    if workers <= 0 or workers / base <= rate:
        return base
    doublings = math.ceil(math.log2(workers / (base * rate)))
    # log2 of a float may land a hair off an exact power of two: settle it by comparison.
    while doublings > 0 and workers / (base * 2 ** (doublings - 1)) <= rate:
        doublings -= 1
    while workers / (base * 2**doublings) > rate:
        doublings += 1
    return float(base * 2 ** min(doublings, MAX_DOUBLINGS))


def fleet_interval(workers: int, base: float, rate: float, current: float | None = None) -> float:
    """The interval idle workers should beat at, given the one they were told (``current``;
    None before any): longer at once when the fleet needs it, shorter only when the fleet
    would stay within ``SHRINK_BELOW`` of the budget at the shorter one."""
    need = needed_interval(workers, base, rate)
    if current is None or need >= current:
        return need
    return min(current, needed_interval(math.ceil(workers / SHRINK_BELOW), base, rate))


def idle_rate(workers: int, interval: float) -> float:
    """Heartbeats a second from ``workers`` idle workers beating every ``interval``."""
    return workers / interval


class HeartbeatPace:
    """The interval this router's idle workers were told, kept as its fleet grows and
    shrinks (``fleet_interval``); no I/O: the caller tells the workers."""

    def __init__(self, base: float, rate: float) -> None:
        self.base = base
        self.rate = rate
        self.interval = base
        """What idle workers beat at now (a worker that just registered was told the base)."""

    def after(self, workers: int) -> float | None:
        """The fleet now has ``workers``: the new interval if it changes, else None."""
        interval = fleet_interval(workers, self.base, self.rate, self.interval)
        if interval == self.interval:
            return None
        self.interval = interval
        return interval
