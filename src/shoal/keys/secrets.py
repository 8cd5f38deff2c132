"""Making, hashing and comparing key secrets.

A secret is a scope marker and 32 random bytes, URL-safe base64: ``sk-shoal-<43 chars>``
for ``inference`` keys (``sk-`` like the OpenAI keys clients expect), ``gk-shoal-`` for
``worker`` (GPU) keys and ``ak-shoal-`` for ``admin`` keys, so a person (or a secret
scanner) can tell what a leaked string is. The scope that counts is the one stored with the
key, never the one its text claims.

Only a SHA-256 hash of the secret is stored. A slow password hash (bcrypt, argon2) exists to
make guessing low-entropy passwords expensive; these secrets carry 256 random bits, so there
is nothing to guess, and a fast hash lets the router check a key on every request in
microseconds. A server-side pepper (HMAC) would add nothing against a stolen database for
the same reason, and would be one more secret to distribute to every router.

The hash is the lookup key (a dict in memory, a unique index in the database); looking up an
attacker's hash says nothing useful about stored hashes, since nobody can choose an input
with a given SHA-256 prefix. The final check is still a constant-time comparison.

The display prefix (scope marker + first 8 random characters, 48 of the 256 bits) is stored
in clear to name a key in lists and logs; the remaining 208 bits stay secret.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from shoal.keys.records import Scope

RANDOM_BYTES = 32
PREFIX_CHARS = 8
RANDOM_CHARS = 43  # len(secrets.token_urlsafe(32)): base64 of 32 bytes, unpadded

MARKERS: dict[Scope, str] = {
    Scope.INFERENCE: "sk-shoal-",
    Scope.WORKER: "gk-shoal-",
    Scope.ADMIN: "ak-shoal-",
}


def generate_secret(scope: Scope) -> str:
    """A new secret for ``scope``: its marker and 32 random bytes (URL-safe base64)."""
    return MARKERS[scope] + secrets.token_urlsafe(RANDOM_BYTES)


def hash_secret(secret: str) -> str:
    """The stored form: SHA-256 of the UTF-8 secret, as 64 hex characters."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def display_prefix(secret: str) -> str:
    """``sk-shoal-AbCdEfGh``: enough to recognise a key, far too little to use it."""
    for marker in MARKERS.values():
        if secret.startswith(marker):
            return secret[: len(marker) + PREFIX_CHARS]
    return secret[:PREFIX_CHARS]


def digests_equal(a: str, b: str) -> bool:
    """Constant-time equality of two hex digests."""
    return hmac.compare_digest(a.encode("ascii"), b.encode("ascii"))


def looks_like_secret(text: str) -> bool:
    """True for a whole secret (marker and all 43 random characters), not a prefix."""
    return any(
        text.startswith(marker) and len(text) == len(marker) + RANDOM_CHARS
        for marker in MARKERS.values()
    )
