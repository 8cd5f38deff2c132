"""Log set-up for every Shoal process: one line per event, IDs in the message."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT, stream=sys.stderr, force=True)
    for noisy in ("websockets", "aiohttp.access", "uvicorn.error", "httpx", "httpx2", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
