"""``shoal keys`` (create, list, update, revoke) and ``shoal usage``: the key database by hand.

Every command opens the database named by --database-url / SHOAL_DATABASE_URL (default: a
SQLite file in Shoal's data folder), brings its schema up to date, and closes it again.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import Field

from shoal.cli import logs
from shoal.cli.errors import UserError, settings_for
from shoal.keys.errors import KeyStoreError
from shoal.keys.records import (
    MAX_WEIGHT,
    RATE_HELP,
    KeyLimits,
    KeyRecord,
    Priority,
    Queueing,
    Scope,
    UsageRow,
    parse_rate,
)
from shoal.settings import CommonSettings, add_settings_flags

if TYPE_CHECKING:
    from shoal.keys.store import KeyStore

Handler = Callable[[argparse.Namespace], int]
Parser = argparse.ArgumentParser


class KeysSettings(CommonSettings):
    database_url: str | None = Field(
        None,
        description="Where API keys and usage live: a SQLAlchemy URL (postgresql://..., "
        "sqlite:///path). Default: a SQLite file in Shoal's data folder.",
    )


SINCE_HELP = (
    "only usage from this long ago on: 90m, 24h, 7d, or a date/time such as 2025-01-31 or "
    "2025-01-31T12:00 (UTC). Usage is kept per hour, so this counts from the start of the "
    "hour WHEN falls in (5m at 12:03 counts from 12:00). Default: all of it"
)
KEY_HELP = "the key's id (key_...), display prefix (or its start) or name"
WEIGHT_HELP = (
    f"the key's share of the workers when keys wait for them: 1 is a default key's share, 3 "
    f"gets three times that (a number above 0, at most {MAX_WEIGHT:g})"
)
PRIORITY_HELP = (
    "interactive (default) or batch: batch requests wait behind interactive ones "
    "(for at most 30 s); async jobs (/v1/jobs) are batch whatever the key's class"
)
MAX_QUEUED_HELP = (
    "how many of the key's requests may wait for a worker at once on a router (one with its "
    "own queue: not with --redis-url); more get 429. 0: never wait; none: no limit (default)"
)
SETTINGS_FLAGS = ("--rate", "--max-streams", "--weight", "--priority", "--max-queued")


def add_commands(sub: argparse._SubParsersAction[Parser]) -> None:
    """Add ``keys`` and ``usage`` to the top-level subcommands."""
    text = "Create, list, change and revoke API keys (inference, worker and admin scopes)."
    keys = sub.add_parser("keys", help=text, description=text)
    keys.set_defaults(handler=_choose_action)
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)

    def add(name: str, text: str, handler: Handler) -> Parser:
        p = keys_sub.add_parser(name, help=text, description=text)
        p.set_defaults(handler=handler)
        add_settings_flags(p, KeysSettings)
        return p

    p = add(
        "create",
        "Create a key and print its secret, once. Scopes: inference (API callers), worker "
        "(GPU machines joining), admin (control plane and dashboard).",
        keys_create,
    )
    p.add_argument("--scope", required=True, choices=[s.value for s in Scope])
    p.add_argument("--name", help="a label for people, e.g. who or what uses the key")
    _add_settings_flags(p, "default: no limit; not for worker keys")
    p.add_argument("--json", action="store_true", help="print JSON (with the secret)")
    p = add("list", "List keys (the secrets are not stored, so not shown).", keys_list)
    p.add_argument("--all", action="store_true", help="include revoked keys")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = add(
        "update",
        "Change a key's limits, weight, class or queue cap; every router uses the new values "
        "at once. What is not given stays as it was.",
        keys_update,
    )
    p.add_argument("key", metavar="ID|PREFIX|NAME", help=KEY_HELP)
    _add_settings_flags(p, "none: no limit; replaces both rates")
    p.add_argument("--json", action="store_true", help="print the key as JSON")
    p = add(
        "revoke",
        "Revoke a key; every router refuses it at once.",
        keys_revoke,
    )
    p.add_argument("key", metavar="ID|PREFIX|NAME", help=KEY_HELP)

    text = (
        "Requests and tokens per key and model. Routers write usage every few seconds, so "
        "the last seconds may not show yet."
    )
    p = sub.add_parser("usage", help=text, description=text)
    p.set_defaults(handler=usage_show)
    add_settings_flags(p, KeysSettings)
    p.add_argument("--since", metavar="WHEN", help=SINCE_HELP)
    p.add_argument("--key", metavar="ID|PREFIX|NAME", help="only this key: " + KEY_HELP)
    p.add_argument("--model", help="only this model")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_settings_flags(p: Parser, rate_note: str) -> None:
    """The flags ``keys create`` and ``keys update`` share: a key's limits and queueing."""
    p.add_argument("--rate", metavar="SPEC", help=f"{RATE_HELP} ({rate_note})")
    p.add_argument(
        "--max-streams",
        metavar="N|none",
        help="streamed requests the key may run at once (none: no limit; not for worker keys)",
    )
    p.add_argument("--weight", metavar="N", help=WEIGHT_HELP)
    p.add_argument("--priority", choices=[c.value for c in Priority], help=PRIORITY_HELP)
    p.add_argument("--max-queued", metavar="N|none", help=MAX_QUEUED_HELP)


def _choose_action(args: argparse.Namespace) -> int:
    raise UserError("choose an action: shoal keys create|list|update|revoke (see --help)")


@contextmanager
def _store(args: argparse.Namespace) -> Iterator[KeyStore]:
    from shoal.keys.store import open_store  # SQLAlchemy & co.: only for the keys commands

    settings = settings_for(KeysSettings, args)
    logs.setup(settings.log_level)
    try:
        store = open_store(settings.database_url)
    except KeyStoreError as exc:
        raise UserError(str(exc)) from None
    try:
        yield store
    except KeyStoreError as exc:
        raise UserError(str(exc)) from None
    finally:
        store.close()


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%MZ") if moment else "-"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    )


# ------------------------------------------------------------------ keys


def _count(flag: str, text: str, least: int) -> int | None:
    """``N`` (at least ``least``) or ``none`` (no limit), as a user typed it after ``flag``."""
    if text.strip().lower() == "none":
        return None
    try:
        number: int | None = int(text)
    except ValueError:
        number = None
    if number is None or number < least:
        raise UserError(f"{flag} must be a whole number of at least {least}, or none for no limit")
    return number


def _weight(text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise UserError(f"--weight: {text!r} is not a number; it is {WEIGHT_HELP}") from None
    try:
        return Queueing(weight=weight).weight
    except ValueError as exc:
        raise UserError(f"--weight: {exc}") from None


def _changes(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The limits and queueing fields the flags given set (others are left out), checked."""
    limits: dict[str, Any] = {}
    queueing: dict[str, Any] = {}
    if args.rate is not None and args.rate.strip().lower() == "none":
        limits.update(requests_per_min=None, tokens_per_min=None)
    elif args.rate is not None:
        try:
            limits["requests_per_min"], limits["tokens_per_min"] = parse_rate(args.rate)
        except ValueError as exc:
            raise UserError(f"--rate: {exc}") from None
    if args.max_streams is not None:
        limits["max_streams"] = _count("--max-streams", args.max_streams, least=1)
    if args.weight is not None:
        queueing["weight"] = _weight(args.weight)
    if args.priority is not None:
        queueing["priority"] = Priority(args.priority)
    if args.max_queued is not None:
        queueing["max_queued"] = _count("--max-queued", args.max_queued, least=0)
    return limits, queueing


def _not_for_workers() -> UserError:
    return UserError(
        "--rate, --max-streams, --weight, --priority and --max-queued shape the requests a key "
        "sends to the API; a worker key only lets a GPU machine join, so they would limit "
        "nothing. Leave them out (or use an inference key)."
    )


def keys_create(args: argparse.Namespace) -> int:
    limit_changes, queue_changes = _changes(args)
    if Scope(args.scope) is Scope.WORKER and (limit_changes or queue_changes):
        raise _not_for_workers()
    limits = replace(KeyLimits(), **limit_changes)
    queueing = replace(Queueing(), **queue_changes)
    with _store(args) as store:
        key, secret = store.create(Scope(args.scope), args.name, limits, queueing)
    if args.json:
        print(json.dumps({**key.to_json(), "secret": secret}, indent=2))
        return 0
    name = f" {key.name!r}" if key.name else ""
    print(
        f"Created {key.scope} key {key.id}{name} ({key.prefix}...), limits: {key.limits.describe()}"
    )
    if key.queueing != Queueing():
        print(f"Queueing: {_queueing(key.queueing)}")
    print("Its secret is below. It is not stored and will not be shown again: keep it now.")
    print(secret)
    return 0


def _queueing(queueing: Queueing) -> str:
    weight, priority, cap = queueing.describe()
    waiting = "no limit" if queueing.max_queued is None else cap
    return f"weight {weight}, {priority}, requests waiting at once: {waiting}"


def keys_update(args: argparse.Namespace) -> int:
    limit_changes, queue_changes = _changes(args)
    if not (limit_changes or queue_changes):
        raise UserError(f"nothing to change: give one or more of {', '.join(SETTINGS_FLAGS)}")

    def change(key: KeyRecord) -> KeyRecord:
        if key.scope is Scope.WORKER:
            raise _not_for_workers()
        return replace(
            key,
            limits=replace(key.limits, **limit_changes),
            queueing=replace(key.queueing, **queue_changes),
        )

    with _store(args) as store:
        before, key = store.update(args.key, change)
    if args.json:
        print(json.dumps(key.to_json(), indent=2))
        return 0
    name = f" {key.name!r}" if key.name else ""
    if before == key:
        print(f"{key.id}{name} ({key.prefix}...) already had these settings: nothing changed.")
        return 0
    print(f"Updated {key.scope} key {key.id}{name} ({key.prefix}...), from now on:")
    if before.limits != key.limits:
        print(f"  limits: {before.limits.describe()} -> {key.limits.describe()}")
    if before.queueing != key.queueing:
        print(f"  queueing: {_queueing(before.queueing)} -> {_queueing(key.queueing)}")
    return 0


def keys_list(args: argparse.Namespace) -> int:
    with _store(args) as store:
        found = store.list(include_revoked=args.all)
    if args.json:
        print(json.dumps([k.to_json() for k in found], indent=2))
        return 0
    if not found:
        print("No keys. Create one with: shoal keys create --scope inference --name NAME")
        return 0
    headers = [
        *("ID", "SCOPE", "NAME", "PREFIX", "CREATED"),
        *("WEIGHT", "PRIORITY", "MAX-QUEUED", "LIMITS"),
    ]
    if args.all:
        headers.append("REVOKED")
    print(_table(headers, [_key_row(k, args.all) for k in found]))
    return 0


def _key_row(key: KeyRecord, with_revoked: bool) -> list[str]:
    row = [
        key.id,
        key.scope.value,
        key.name or "-",
        key.prefix + "...",
        _when(key.created_at),
        *key.queueing.describe(),
        key.limits.describe(),
    ]
    return [*row, _when(key.revoked_at)] if with_revoked else row


def keys_revoke(args: argparse.Namespace) -> int:
    with _store(args) as store:
        before = store.find(args.key)
        key = store.revoke(before.id)
    if before.revoked:
        print(f"{key.id} ({key.prefix}...) was already revoked at {_when(key.revoked_at)}.")
    else:
        print(f"Revoked {key.scope} key {key.id} ({key.prefix}...): refused from now on.")
    return 0


# ------------------------------------------------------------------ usage


def parse_since(text: str) -> datetime:
    from shoal.keys.usage import usage_since

    try:
        return usage_since(text)
    except ValueError:
        raise UserError(f"--since {text!r}: {SINCE_HELP}") from None


def usage_show(args: argparse.Namespace) -> int:
    from shoal.keys.usage import hour_start

    since = parse_since(args.since) if args.since else None
    with _store(args) as store:
        key_id = store.find(args.key).id if args.key else None
        rows = store.usage(since=since, key=key_id, model=args.model)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
        return 0
    scope = ""
    if since is not None:  # what is counted: whole hours (the JSON rows say so per row)
        scope = f" since {_when(hour_start(since))}"
        if hour_start(since) != since:
            scope += f" (usage is kept per hour: from the start of the hour {args.since} is in)"
    if not rows:
        print(f"No usage recorded{scope}.")
        return 0
    print(f"Usage{scope}:")
    print(
        _table(["KEY", "NAME", "MODEL", "REQUESTS", "TOKENS IN", "TOKENS OUT"], _usage_rows(rows))
    )
    return 0


def _usage_rows(rows: Sequence[UsageRow]) -> list[list[str]]:
    out = [
        [r.key_id, r.key_name or "-", r.model, str(r.requests), str(r.tokens_in), str(r.tokens_out)]
        for r in rows
    ]
    if len(rows) > 1:
        total = [sum(getattr(r, f) for r in rows) for f in ("requests", "tokens_in", "tokens_out")]
        out.append(["TOTAL", "", "", *(str(t) for t in total)])
    return out
