"""Every Redis key Shoal uses, built from one prefix (``--redis-prefix``, default ``shoal:``).

Several clusters or test runs share one Redis by using different prefixes. Names, with
``{p}`` the prefix:

==============================  ===========  ==================================================
key                             type         contents and lifetime
==============================  ===========  ==================================================
``{p}q:{model}:{endpoint}``     stream       Jobs running for one (model, endpoint): the
                                             leases. A claim adds an entry ``job=<id>`` and
                                             reads it at once for its consumer in group
                                             ``GROUP``, so every entry is pending (``XLEN`` =
                                             running). Deleted when its job ends or goes back
                                             to wait. No TTL (the group lives in it).
``{p}qr:{model}:{endpoint}``    zset         Jobs waiting to be claimed first: interactive ones
                                             and batch ones that aged, scored by start tag
                                             (``fair_queue``); member ``<seq>:<job id>:<key>``
                                             so equal tags go in arrival order. No TTL.
``{p}qb:{model}:{endpoint}``    zset         Batch jobs waiting (not aged yet), the same way.
``{p}qa:{model}:{endpoint}``    zset         The same batch members scored by when they
                                             queued (ms), to promote the aged ones to ``qr``.
``{p}qf:{model}:{endpoint}``    hash         The queue's fairness state: ``v`` (virtual time),
                                             ``seq``/``front`` counters, ``f:<key>`` each
                                             key's finish tag, ``n:<key>`` its jobs waiting.
``{p}qk:{model}:{endpoint}``    stream       Wake-ups: an entry per job that starts to wait;
                                             claimers block on it (``XREAD`` from the last id
                                             the claim script saw). ``MAXLEN 16``.
``{p}keys:waiting``             hash         Jobs waiting per API key over every queue: what
                                             ``max_queued`` bounds across routers.
``{p}queues``                   set          Names of the queue streams above, so a sweep finds
                                             every queue without ``SCAN``/``KEYS``. No TTL.
``{p}job:{id}``                 hash         The job: ``model endpoint stream body queue entry
                                             state owner attempt seq started created``; its
                                             queue's other keys ``ready batch aging fair wake``
                                             and ``kw`` (``keys:waiting``); its share
                                             ``tenant weight prio work mode``; while it waits
                                             ``tag member since``. TTL ``JOB_TTL_MS`` from
                                             enqueue, cut to ``FINISHED_TTL_MS`` when it ends.
``{p}job:{id}:out``             stream       The job's output events (field ``e``, compact
                                             JSON), ``MAXLEN ~ OUT_MAXLEN``. TTL ``OUT_TTL_MS``
                                             from the last event, ``FINISHED_TTL_MS`` once the
                                             job ends.
``{p}consumer:{name}:cancel``   list         Ids of jobs held by consumer ``name`` that were
                                             cancelled; the holder pops them with ``BLPOP``.
                                             TTL ``CANCELS_TTL_MS`` from the last push.
``{p}tail:{name}:{token}``      stream       Wake-ups for one ``OutputTail`` reader (a new job
                                             to read). ``MAXLEN ~ 100``; TTL ``OUT_TTL_MS``
                                             from the last wake-up; deleted when it stops.
``{p}rl:{{key}}:req|tok|streams``  zset/str  A key's rate limits (router/ratelimit_redis):
                                             request log, token GCRA, stream leases; each with
                                             a TTL of its window. ``{key}`` keeps a key's three
                                             names in one Redis Cluster slot.
``{p}ajob:{id}``                hash         An async job's record (``/v1/jobs``): TTL 24 h
                                             while live, ``--job-ttl`` once finished.
``{p}ajobs:cancelled``          channel      Pub/sub: async jobs cancelled on some router.
``{p}cache:{sha256}``           string       A cached answer (``--cache``); TTL ``--cache-ttl``.
``{p}worker:{id}``              hash         A connected worker as its router lists it: fields
                                             ``router`` and ``summary`` (JSON). TTL refreshed
                                             by its router; deleted when it disconnects.
``{p}workers``                  set          Ids of the worker hashes above (readers drop ids
                                             whose hash expired).
``{p}deploy:{name}``            string       Which router runs a deployment (a split model):
                                             its lease, naming the router
                                             (router/deployments/leases). TTL 10 s, renewed
                                             by its holder.
``{p}deploy-view:{name}``       string       The holder's view of that deployment (its status
                                             JSON), with the lease's TTL.
==============================  ===========  ==================================================

Every waiting count (``qr``/``qb`` cardinalities, ``n:<key>``, ``keys:waiting``) changes in the
same script as the job's state, so a job claimed, withdrawn, cancelled or put back by any
router (or by the sweep that recovers a dead one) never leaves a count behind.

Job leases live in the stream's pending entries list: a holder renews a job by
``XCLAIM``-ing it to itself (``JUSTID``, which resets its idle time), and a job idle past the
lease is taken over with ``XAUTOCLAIM``. There are no separate job lease keys.

The Lua scripts (``scripts``) build job keys from ids they read out of Redis, with
``job_key_prefix`` and ``OUT_SUFFIX`` from here, so the names above stay defined only in this
module. This layout needs a single Redis (or a primary with replicas): the scripts touch keys
of several jobs at once, which Redis Cluster does not allow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import Endpoint

GROUP = "shoal"
"""The consumer group every router and pull worker reads the queue streams with."""

OUT_SUFFIX = ":out"
CANCEL_SUFFIX = ":cancel"

JOB_TTL_MS = 24 * 3600 * 1000  # a job not finished within a day is dropped
FINISHED_TTL_MS = 10 * 60 * 1000  # a finished job's output stays readable this long
OUT_TTL_MS = 3600 * 1000  # output of a job silent this long is dropped
OUT_MAXLEN = 100_000  # events kept per job output stream (approximate trim)
CANCELS_TTL_MS = 3600 * 1000  # cancellations for a consumer that never reads them

_SAFE_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """Every key of one (model, endpoint) queue, in the order the scripts take them."""

    stream: str
    ready: str
    batch: str
    aging: str
    fair: str
    wake: str

    def all(self) -> list[str]:
        return [self.stream, self.ready, self.batch, self.aging, self.fair, self.wake]


QUEUE_KINDS = ("q:", "qr:", "qb:", "qa:", "qf:", "qk:")
"""The key kinds of a queue, as ``QueueKeys`` lists them (``{p}<kind>{model}:{endpoint}``)."""


class RedisKeys:
    """Key names for one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def queue(self, model: ModelName, endpoint: Endpoint) -> str:
        # The endpoint is the last part and never contains ':', so model names with ':' are
        # still unambiguous.
        return f"{self.prefix}q:{model}:{Endpoint(endpoint).value}"

    def queue_keys(self, model: ModelName, endpoint: Endpoint) -> QueueKeys:
        suffix = f"{model}:{Endpoint(endpoint).value}"
        return QueueKeys(*(f"{self.prefix}{kind}{suffix}" for kind in QUEUE_KINDS))

    def queue_kind_prefixes(self) -> list[str]:
        """``{p}q:``, ``{p}qr:``...: a script finds a queue's other keys from its stream's."""
        return [f"{self.prefix}{kind}" for kind in QUEUE_KINDS]

    @property
    def queues(self) -> str:
        return f"{self.prefix}queues"

    @property
    def key_waiting(self) -> str:
        return f"{self.prefix}keys:waiting"

    def parse_queue(self, key: str) -> tuple[ModelName, Endpoint] | None:
        """The (model, endpoint) of a ``queue`` key name; None if it is not one."""
        head = f"{self.prefix}q:"
        model, _, endpoint = key.removeprefix(head).rpartition(":")
        if not key.startswith(head) or not model:
            return None
        try:
            return ModelName(model), Endpoint(endpoint)
        except ValueError:
            return None

    @property
    def job_key_prefix(self) -> str:
        return f"{self.prefix}job:"

    def job(self, job_id: JobId) -> str:
        return f"{self.job_key_prefix}{job_id}"

    def out(self, job_id: JobId) -> str:
        return f"{self.job_key_prefix}{job_id}{OUT_SUFFIX}"

    @property
    def consumer_key_prefix(self) -> str:
        return f"{self.prefix}consumer:"

    def cancels(self, consumer: str) -> str:
        return f"{self.consumer_key_prefix}{consumer}{CANCEL_SUFFIX}"

    def tail_wake(self, name: str, token: str) -> str:
        return f"{self.prefix}tail:{name}:{token}"

    @property
    def pattern(self) -> str:
        """``SCAN MATCH`` pattern for every key under this prefix (tests and tools only)."""
        return _glob_escape(self.prefix) + "*"


def check_name(kind: str, value: str) -> str:
    """Job ids and consumer names become parts of key names: keep them plain."""
    if not _SAFE_ID.fullmatch(value):
        raise ValueError(
            f"{kind} {value!r} cannot be used in a Redis key: use 1-128 letters, digits, "
            "'_', '.' or '-'"
        )
    return value


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


# ------------------------------------------------------------------ the router's other state


def rate_limit_keys(prefix: str, key_id: str) -> tuple[str, str, str]:
    """One API key's rate-limit keys: its request log, token GCRA and stream leases."""
    base = f"{prefix}rl:{{{key_id}}}"
    return f"{base}:req", f"{base}:tok", f"{base}:streams"


def async_job_key(prefix: str, job_id: str) -> str:
    """The hash holding one async job's record (``/v1/jobs``)."""
    return f"{prefix}ajob:{job_id}"


def async_job_cancel_channel(prefix: str) -> str:
    """The pub/sub channel every router listens on for cancelled async jobs."""
    return f"{prefix}ajobs:cancelled"


def stored_response_key(prefix: str, response_id: str) -> str:
    """A stored response of the Responses API (``store: true``), with its conversation."""
    return f"{prefix}resp:{response_id}"


def cache_entry_key(prefix: str, key: str) -> str:
    """One cached answer of the result cache."""
    return f"{prefix}cache:{key}"


def worker_key(prefix: str, worker_id: str) -> str:
    """One connected worker's summary, written by the router it is connected to."""
    return f"{prefix}worker:{worker_id}"


def worker_index_key(prefix: str) -> str:
    """The set of worker ids that have a ``worker_key`` hash (some may have expired)."""
    return f"{prefix}workers"


def deployment_lease_key(prefix: str, name: str) -> str:
    """Which router runs one deployment: the lease, holding that router's name."""
    return f"{prefix}deploy:{name}"


def deployment_view_key(prefix: str, name: str) -> str:
    """The deployment's status as its lease holder last published it.

    Not under ``deploy:``: deployment names may contain ``:``, and a view key there would be
    the lease key of another name (``a`` + ``:view`` is ``a:view``)."""
    return f"{prefix}deploy-view:{name}"
