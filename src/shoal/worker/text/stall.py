"""When the worker's own llama-server is taken for hung while it runs jobs (pure).

A llama-server that stops (SIGSTOP, a frozen cgroup, a machine swapping itself to death)
keeps its connections open and sends nothing; its worker is fine and keeps heartbeating,
so the router's stall rule (``router/dispatch/stall.py``) never fires, and before this rule the
job waited for the idle health check: three failed ``/health`` probes 10 s apart, then
SIGTERM and a 5 s grace (37 s measured). The rule:

    while jobs hold llama-server, it is hung when it has not answered ``/health`` for
    ``--backend-stall-timeout`` seconds (counted from the later of its last answer and the
    moment jobs began to hold it).

Why ``/health`` and not the job's own output: llama-server answers ``/health`` on its HTTP
threads, whatever its main loop is doing, so a long prompt being computed (nothing streams
before the first token) or another slot's prompt batch (every stream pauses for it) never
looks like a hang. A silence bound on the output cannot tell those from one: llama-server
reports prompt progress (``return_progress``) only after each ``--batch-size`` batch (2048
tokens by default: tens of seconds on a CPU for a large model), and a batch of another
request's prompt pauses every running stream for as long. The probe is sent every
``probe_every`` seconds while jobs run (a quarter of the timeout), so a live llama-server
answers several times within the timeout.

What it does not catch: a main loop that hangs while the HTTP threads still answer (a GPU
that never returns, a deadlock in decoding). The router's ``--job-timeout``, when set,
bounds how long a client waits on that.
"""

from __future__ import annotations


def hung(now: float, last_answer: float, busy_since: float | None, timeout: float) -> bool:
    """Whether llama-server, last heard at ``last_answer``, is hung; ``busy_since``: when
    jobs began to hold it (None: no job does, and the idle health check applies)."""
    if timeout <= 0 or busy_since is None:
        return False
    return now >= deadline(last_answer, busy_since, timeout)


def deadline(last_answer: float, busy_since: float, timeout: float) -> float:
    """When llama-server will be taken for hung unless it answers before."""
    return max(last_answer, busy_since) + timeout


def probe_every(timeout: float, idle_period: float) -> float:
    """Seconds between ``/health`` probes while jobs run: a quarter of the timeout (a live
    llama-server answers about four times within it), never slower than the idle check."""
    return min(idle_period, timeout / 4)
