"""Key checks shared by every Shoal server: constant-time, never logged."""

from __future__ import annotations

import hmac
import ipaddress

from pydantic import SecretStr
from starlette.datastructures import Headers


def is_loopback(host: str) -> bool:
    if host in {"localhost", "localhost.localdomain"}:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer(headers: Headers) -> str | None:
    """The key a request presents: ``Authorization: Bearer K`` or ``X-Api-Key: K``."""
    value = headers.get("authorization")
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return headers.get("x-api-key")


def matches(presented: str | None, keys: tuple[SecretStr, ...]) -> bool:
    if presented is None:
        return False
    candidate = presented.encode()
    found = False
    for key in keys:  # compare against every key so timing says nothing about which matched
        found |= hmac.compare_digest(candidate, key.get_secret_value().encode())
    return found
