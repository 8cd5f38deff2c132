"""Small helpers shared by the route modules."""

from __future__ import annotations

import orjson
from starlette.responses import Response


def json_response(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")
