"""Identifier types shared by every side of the wire."""

from __future__ import annotations

import secrets
from typing import NewType

WorkerId = NewType("WorkerId", str)
JobId = NewType("JobId", str)
ModelName = NewType("ModelName", str)


def new_job_id() -> JobId:
    return JobId("job_" + secrets.token_hex(8))


def new_worker_id(name: str) -> WorkerId:
    return WorkerId(f"{name}-{secrets.token_hex(3)}")
