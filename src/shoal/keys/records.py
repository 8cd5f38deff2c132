"""What a key is and what it used, as frozen values: no database, no secrets."""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime


class Scope(enum.StrEnum):
    """What a key may do: call the API, join as a GPU worker, or run the control plane."""

    INFERENCE = "inference"
    WORKER = "worker"
    ADMIN = "admin"


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; None means no limit of that kind. Enforced by the router, not here."""

    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    max_streams: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_min", "tokens_per_min", "max_streams"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"{name} must be at least 1 (or unset for no limit), not {value}; "
                    "disable the key instead of setting a zero limit."
                )

    @property
    def limits_calls(self) -> bool:
        """A limit on requests or tokens (not only on concurrent streams)."""
        return self.requests_per_min is not None or self.tokens_per_min is not None

    def describe(self) -> str:
        """``60rpm,100000tpm,4 streams`` (``1 stream``), or ``-`` when unlimited."""
        parts = []
        if self.requests_per_min is not None:
            parts.append(f"{self.requests_per_min}rpm")
        if self.tokens_per_min is not None:
            parts.append(f"{self.tokens_per_min}tpm")
        if self.max_streams is not None:
            parts.append(f"{self.max_streams} stream{'' if self.max_streams == 1 else 's'}")
        return ",".join(parts) or "-"


class Priority(enum.StrEnum):
    """The class a key's requests queue in: *interactive* ones go before *batch* ones (which
    wait at most ``fair_queue.BATCH_AGING_S`` behind them); async jobs are always batch."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


MAX_WEIGHT = 1000.0
"""The largest weight a key may have: 1000 times a default key's share is already all of it."""


@dataclass(frozen=True)
class Queueing:
    """How a key's requests wait for a worker (``router/dispatch/fair_queue.py``): its share of
    the workers against other keys' (``weight``), its class, and how many of its requests may
    wait at once on a router (``max_queued``; None: as many as the queue holds)."""

    weight: float = 1.0
    priority: Priority = Priority.INTERACTIVE
    max_queued: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and 0 < self.weight <= MAX_WEIGHT):
            raise ValueError(
                f"a weight must be above 0 and at most {MAX_WEIGHT:g} (1 is a default key's "
                f"share; 2 gets twice that), not {self.weight:g}"
            )
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(
                "max queued must be 0 or more (0: never wait for a worker), or unset for no limit"
            )

    def describe(self) -> tuple[str, str, str]:
        """The weight, class and queue cap as ``keys list`` shows them (``-``: no cap)."""
        cap = "-" if self.max_queued is None else str(self.max_queued)
        return f"{self.weight:g}", self.priority.value, cap


@dataclass(frozen=True)
class KeyRecord:
    """A key as stored, without its secret or hash. ``prefix`` is what a person sees."""

    id: str
    name: str | None
    scope: Scope
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    limits: KeyLimits
    queueing: Queueing = field(default_factory=Queueing)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def works_for(self, scopes: Collection[Scope]) -> bool:
        """Whether the key may be used where one of ``scopes`` is needed."""
        return not self.revoked and self.scope in scopes

    def label(self) -> str:
        """How logs name a key: id, display prefix and name; never the secret."""
        name = f" ({self.name})" if self.name else ""
        return f"{self.id} {self.prefix}...{name}"

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "scope": self.scope.value,
            "prefix": self.prefix,
            "created_at": self.created_at.isoformat(),
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "requests_per_min": self.limits.requests_per_min,
            "tokens_per_min": self.limits.tokens_per_min,
            "max_streams": self.limits.max_streams,
            "weight": self.queueing.weight,
            "priority": self.queueing.priority.value,
            "max_queued": self.queueing.max_queued,
        }


@dataclass(frozen=True)
class UsageRow:
    """Totals for one key and model over the hours from ``first_hour`` to ``last_hour``."""

    key_id: str
    key_name: str | None
    model: str
    requests: int
    tokens_in: int
    tokens_out: int
    first_hour: datetime
    last_hour: datetime

    def to_json(self) -> dict[str, object]:
        return {
            "key_id": self.key_id,
            "key_name": self.key_name,
            "model": self.model,
            "requests": self.requests,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "first_hour": self.first_hour.isoformat(),
            "last_hour": self.last_hour.isoformat(),
        }


_RATE_PART = re.compile(r"^\s*(\d+)\s*(rpm|tpm)\s*$", re.IGNORECASE)

RATE_HELP = (
    "rate limits as NUMBER+UNIT, comma-separated: rpm = requests per minute, "
    "tpm = tokens (in + out) per minute; e.g. 60rpm or 60rpm,100000tpm"
)


def parse_rate(spec: str) -> tuple[int | None, int | None]:
    """``60rpm,100000tpm`` -> (60, 100000). Raises ValueError with the accepted form."""
    rpm: int | None = None
    tpm: int | None = None
    parts = [p for p in spec.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"empty rate {spec!r}; {RATE_HELP}")
    for part in parts:
        match = _RATE_PART.match(part)
        if match is None:
            raise ValueError(f"cannot read {part.strip()!r}; {RATE_HELP}")
        number, unit = int(match.group(1)), match.group(2).lower()
        if number < 1:
            raise ValueError(f"{part.strip()!r}: a rate must be at least 1")
        if (rpm if unit == "rpm" else tpm) is not None:
            raise ValueError(f"{unit} given twice in {spec!r}")
        if unit == "rpm":
            rpm = number
        else:
            tpm = number
    return rpm, tpm
