"""CPU threads and OpenMP spin for the llama.cpp processes a worker starts.

llama.cpp's CPU backend parallelises with OpenMP (libgomp), whose threads *spin* for a while
at every barrier and after every parallel region before they sleep (``GOMP_SPINCOUNT``,
300,000 by default). Every thread of a graph waits at each barrier for the slowest one, so a
process whose threads outnumber the cores left to it computes at the pace of its descheduled
threads, while the waiting ones spin on the cores the others need.

**Several llama-servers on one machine** (more than one worker per machine, or a worker beside
a user's own llama-server) each pick every core by default. Three workers on 2 cores took
58.4 s for six 60-token chats instead of 2.4 s (issue 24); ``--threads 1`` and a short spin on
the extra worker brought it back to 2.8 s. So ``server_threads`` gives a new llama-server the
cores the others leave free (at least one), a user's ``--threads`` always wins, and
``oversubscription`` says when the threads of all of them outnumber the cores.

**The shards of a split model** compute one after another: the head's ``llama-server``
computes a little, then each ``ggml-rpc-server`` stage computes its layers while the others
wait for their next turn. On a machine that runs more than one shard's process, the stage that
has just finished keeps spinning on the cores the next stage needs. Measured on 2 cores with
the default model (``benchmarks/rpc_split.py``-style runs, 128 tokens, medians of 5
interleaved rounds): one llama-server 86.4 tok/s; split over two stages with ``-t 1`` (what
ggml-rpc-server picks on 2 cores: half the hardware threads) 48.6; with ``-t 2`` 54.4; with
``-t 2`` and ``OMP_WAIT_POLICY=PASSIVE`` 29.6 (every barrier sleeps); with ``-t 2`` and
``GOMP_SPINCOUNT`` 5,000 / 20,000 / 100,000: 75.9 / 74.7 / 72.1. One llama-server alone with
20,000: 84.6 (no real cost when nothing else runs). So stages use every core (as llama-server
does; they take turns, they do not compute at once).

Every llama.cpp process a worker starts gets the short spin (``spin_env``), unless the user
set the OpenMP wait variables themselves: an idle server's threads then sleep within
microseconds instead of spinning on the cores another one needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.hardware.profile import CpuInfo

SPINCOUNT = 20_000
"""libgomp spin iterations before a waiting thread sleeps, for every llama.cpp process."""
_OMP_WAIT_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


@dataclass(frozen=True)
class ServerThreads:
    """A new llama-server's threads, and the cores it shares with the servers already here."""

    threads: int
    """``--threads``: while generating."""
    batch_threads: int
    """``--threads-batch``: while reading prompts (the same: both compute at once with the
    others' work, and a prompt read with more threads than free cores is as slow)."""
    cores: int
    """Cores this machine lets us compute on (``hardware.cpu_quota.usable_cores``)."""
    others: tuple[int, ...]
    """Threads of each llama.cpp server already running here."""
    configured: bool
    """The user's ``--threads``."""

    @property
    def total(self) -> int:
        """Threads of every server here, this one included."""
        return max(self.threads, self.batch_threads) + sum(self.others)

    @property
    def oversubscribed(self) -> bool:
        return self.total > self.cores


def server_threads(cores: int, others: Sequence[int], configured: int | None) -> ServerThreads:
    """``--threads``/``--threads-batch`` for a new llama-server: the user's ``--threads``
    (``configured``) if given, else the ``cores`` the threads of the servers already running
    here (``others``) leave free, and at least one."""
    threads = configured or max(1, cores - sum(others))
    return ServerThreads(threads, threads, cores, tuple(others), configured is not None)


def oversubscription(plan: ServerThreads) -> str | None:
    """What to tell the user when the servers' threads outnumber the cores, else None."""
    if not plan.oversubscribed:
        return None
    servers = len(plan.others) + 1
    mine = f"{plan.threads}{' (--threads)' if plan.configured else ''}"
    each = max(1, plan.cores // servers)
    return (
        f"{servers} llama.cpp server(s) on {plan.cores} usable cores compute with "
        f"{plan.total} threads (this llama-server {mine}, the others here "
        f"{sum(plan.others)}): each waits for its threads that the others keep off the "
        f"cores, and a request can take many times longer. Give the workers --threads that "
        f"add up to {plan.cores} at most (--threads {each} for each of {servers}), or run one "
        "worker per machine."
    )


def stage_threads(configured: int | None, cpu: CpuInfo) -> int:
    """``ggml-rpc-server -t``: the worker's ``--threads``, else one per physical core."""
    if configured:
        return configured
    return max(1, cpu.physical_cores or cpu.logical_cores)


def spin_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to every llama.cpp process's environment: a short OpenMP spin, unless
    the user chose."""
    if any(name in environ for name in _OMP_WAIT_VARS):
        return {}
    return {"GOMP_SPINCOUNT": str(SPINCOUNT)}
