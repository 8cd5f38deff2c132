"""The router's web dashboard: one HTML page and its static assets, served from this package.

``GET /`` is the page and ``GET /dashboard/{asset}`` its scripts, styles and icon. Nothing is
fetched from a CDN: the page's Content-Security-Policy allows only this origin. Loading the
page needs no key; every data call the page makes carries the admin key the user signs in
with, and the API routes check it as usual.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse, Response
from starlette.staticfiles import PathLike, StaticFiles
from starlette.types import Scope

STATIC_DIR = Path(__file__).parent / "static"
INDEX = STATIC_DIR / "index.html"
ASSET_PREFIX = "/dashboard"

# File names carry no content hash, so browsers revalidate (ETag / Last-Modified, 304) on
# every load: an upgraded router never runs against a stale script.
CACHE_CONTROL = "no-cache"

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class DashboardFilesMissing(RuntimeError):
    """The package was installed without its ``static`` folder."""


class _Assets(StaticFiles):
    """StaticFiles with fixed content types, revalidation and the security headers."""

    def file_response(
        self,
        full_path: PathLike,
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        media_type = MEDIA_TYPES.get(Path(full_path).suffix)
        if media_type is not None and response.status_code == 200:
            response.headers["Content-Type"] = media_type
        response.headers["Cache-Control"] = CACHE_CONTROL
        response.headers.update(SECURITY_HEADERS)
        return response


def install(app: FastAPI) -> None:
    """Serve the dashboard at ``/`` and its assets under ``/dashboard/`` on ``app``."""
    if not INDEX.is_file():
        raise DashboardFilesMissing(
            f"the dashboard's files are missing ({INDEX} not found); reinstall shoal "
            "with its package data (static/*)"
        )

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def dashboard_page() -> Response:
        return FileResponse(
            INDEX,
            media_type=MEDIA_TYPES[".html"],
            headers={"Cache-Control": CACHE_CONTROL, **SECURITY_HEADERS},
        )

    app.mount(ASSET_PREFIX, _Assets(directory=STATIC_DIR), name="dashboard")
