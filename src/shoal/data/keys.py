"""Who may read (list, download) and who may write (upload). Constant-time, never logged.

The key rules (``bearer``, ``matches``) are every Shoal server's, from ``shoal.security``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import SecretStr
from starlette.datastructures import Headers

from shoal.data.errors import Unauthorized, UploadsDisabled
from shoal.security import bearer, matches


class StoreAccess(Protocol):
    """Who may read and who may write; raises the store's errors when refused."""

    async def check_read(self, headers: Headers) -> None: ...

    async def check_admin(self, headers: Headers) -> None: ...


@dataclass(frozen=True)
class StoreKeys:
    """``read``: API keys for listing and downloading (none: open). ``admin``: uploads."""

    read: tuple[SecretStr, ...] = ()
    admin: tuple[SecretStr, ...] = ()

    async def check_read(self, headers: Headers) -> None:
        """Raise 401 unless reads are open or the request carries an API or admin key."""
        if not self.read:
            return
        presented = bearer(headers)
        if presented is None:
            raise Unauthorized(
                "No API key given. This model store needs one: send it as "
                "'Authorization: Bearer YOUR_KEY'."
            )
        if not (matches(presented, self.read) | matches(presented, self.admin)):
            raise Unauthorized("Incorrect API key provided. Check the store's --api-key.")

    async def check_admin(self, headers: Headers) -> None:
        """Raise 403 when uploads are disabled, 401 without a valid admin key."""
        if not self.admin:
            raise UploadsDisabled(
                "Uploads are disabled: this model store has no admin key. Start it with "
                "--admin-key/SHOAL_ADMIN_KEY, or copy the .gguf file into its storage folder."
            )
        presented = bearer(headers)
        if presented is None:
            raise Unauthorized(
                "No admin key given. Uploads need one: send it as 'Authorization: Bearer KEY'."
            )
        if not matches(presented, self.admin):
            raise Unauthorized(
                "Incorrect admin key provided. Uploads need the store's --admin-key."
            )
