"""The pure parts of the deployments package import no I/O: no other router module, no
Redis, database, web or network client. Checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

PURE = ("placement", "placement_search", "launch", "deployment", "profile")
IO_PACKAGES = ("redis", "sqlalchemy", "fastapi", "starlette", "aiohttp", "httpx", "websockets")


def test_the_pure_parts_load_no_router_state_and_no_io_clients() -> None:
    code = (
        "import json, sys\n"
        + "".join(f"import shoal.router.deployments.{name}\n" for name in PURE)
        + "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(json.loads(out.stdout))
    ours = {"shoal.router", "shoal.router.deployments"}
    ours |= {f"shoal.router.deployments.{name}" for name in PURE}
    router = {m for m in loaded if m.startswith("shoal.router")}
    assert router == ours
    assert not {m for m in loaded if m.split(".")[0] in IO_PACKAGES}
