"""A text-only install stays light: importing the worker and router never imports the image
libraries (they load only when a worker loads an image model)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "diffusers", "transformers", "accelerate", "PIL")


def test_worker_and_router_import_no_image_library() -> None:
    code = (
        "import sys, shoal.worker.main, shoal.router.app, shoal.cli.main, shoal.up.main; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == ""
