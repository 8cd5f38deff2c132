"""Key checks for clients (API keys) and workers (GPU keys). Constant-time, never logged."""

from __future__ import annotations

from pydantic import SecretStr
from starlette.datastructures import Headers

from shoal.router.errors import Unauthorized
from shoal.security import bearer, matches


class KeyCheck:
    def __init__(self, api_keys: tuple[SecretStr, ...], gpu_keys: tuple[SecretStr, ...]) -> None:
        self.api_keys = api_keys
        self.gpu_keys = gpu_keys

    def client(self, headers: Headers) -> None:
        """Raise 401 unless the request carries a valid API key (or none are configured)."""
        if not self.api_keys:
            return
        presented = bearer(headers)
        if presented is None:
            raise Unauthorized("No API key given. Send it as 'Authorization: Bearer YOUR_KEY'.")
        if not matches(presented, self.api_keys):
            raise Unauthorized("Incorrect API key provided. Check the key you were given.")

    def worker(self, headers: Headers) -> bool:
        if not self.gpu_keys:
            return True
        return matches(bearer(headers), self.gpu_keys)
