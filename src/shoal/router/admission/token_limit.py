"""The token limit every generating request keeps, in whichever field its API names it (pure):
a positive integer, at most this router's ``--max-tokens-limit``."""

from __future__ import annotations

from shoal.router.errors import BadRequest


def check_token_count(field: str, value: object, limit: int | None) -> None:
    """A 400 unless ``value`` (the body's ``field``, given) is a positive integer at most
    ``limit`` (None: no limit)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"'{field}' must be a positive integer.", param=field)
    if limit is not None and value > limit:
        raise BadRequest(
            f"'{field}' is {value}, more than this router allows ({limit}, its "
            f"--max-tokens-limit). Ask for at most {limit} tokens.",
            param=field,
        )
