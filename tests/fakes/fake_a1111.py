"""A FAKE Automatic1111/Forge server: a real HTTP server on 127.0.0.1 speaking its ``/sdapi/v1``.

It answers the calls Shoal's adapter makes: ``GET /sdapi/v1/sd-models``, ``GET``/``POST
/sdapi/v1/options`` (``sd_model_checkpoint`` switches the model), ``POST /sdapi/v1/txt2img``
and ``/sdapi/v1/img2img`` (``images``, ``parameters``, ``info`` as A1111 answers; 422 with a
``detail`` for a bad body), ``GET /sdapi/v1/progress`` (the running job's ``sampling_step`` of
``sampling_steps``; idle, ``job_count`` 0 and the last job's counts, as A1111 leaves them).
A generation takes ``step_delay`` seconds per step (0: instant). Its "images" are small PNGs
whose colour is a function of seed, prompt and checkpoint (and of the input image for img2img),
so tests can tell them apart. Every request is logged in ``requests``.

In tests: ``with FakeA1111.start() as server: server.url``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from PIL import Image

CHECKPOINTS = ("v1-5-pruned.safetensors [abc123]", "dreamshaper_8.safetensors [def456]")


def _picture(*parts: object, width: int, height: int) -> str:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    img = Image.new("RGB", (width, height), tuple(digest[:3]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class FakeA1111:
    server: ThreadingHTTPServer
    checkpoint: str = CHECKPOINTS[0]
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    step_delay: float = 0.0
    progress: dict[str, int] = field(
        default_factory=lambda: {"job_count": 0, "sampling_step": 0, "sampling_steps": 0}
    )
    """A1111's ``state`` fields for /sdapi/v1/progress."""

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    @classmethod
    @contextmanager
    def start(cls) -> Iterator[FakeA1111]:
        fake = cls(ThreadingHTTPServer(("127.0.0.1", 0), _Handler))
        fake.server.fake = fake  # type: ignore[attr-defined]  # the handler finds its fake here
        thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield fake
        finally:
            fake.server.shutdown()
            fake.server.server_close()
            thread.join()

    def generate(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if not isinstance(body.get("prompt"), str):
            return 422, {"detail": [{"loc": ["body", "prompt"], "msg": "field required"}]}
        seed, n = int(body.get("seed", -1)), int(body.get("batch_size", 1))
        width, height = int(body.get("width", 512)), int(body.get("height", 512))
        init = (body.get("init_images") or [None])[0]
        self._sample(int(body.get("steps", 20)))
        images = [
            _picture(self.checkpoint, body["prompt"], seed + i, init, width=width, height=height)
            for i in range(n)
        ]
        info = {"all_seeds": [seed + i for i in range(n)], "sd_model_name": self.checkpoint}
        return 200, {"images": images, "parameters": body, "info": json.dumps(info)}

    def _sample(self, steps: int) -> None:
        """Take ``step_delay`` per step, showing each in ``progress``, as the sampler would."""
        self.progress.update(job_count=1, sampling_step=0, sampling_steps=steps)
        for step in range(1, steps + 1):
            time.sleep(self.step_delay)  # the "work" of one denoising step
            self.progress["sampling_step"] = step
        self.progress["job_count"] = 0

    def progress_answer(self) -> dict[str, Any]:
        state = dict(self.progress)
        fraction = state["sampling_step"] / state["sampling_steps"] if state["job_count"] else 0
        return {"progress": fraction, "eta_relative": 0.0, "state": state, "current_image": None}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def fake(self) -> FakeA1111:
        fake: FakeA1111 = self.server.fake  # type: ignore[attr-defined]
        return fake

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.fake.requests.append(("GET", self.path, None))
        if self.path == "/sdapi/v1/sd-models":
            models = [
                {"title": c, "model_name": c.split(".")[0], "hash": None} for c in CHECKPOINTS
            ]
            self._send(200, models)
        elif self.path == "/sdapi/v1/options":
            self._send(200, {"sd_model_checkpoint": self.fake.checkpoint})
        elif urlsplit(self.path).path == "/sdapi/v1/progress":
            self._send(200, self.fake.progress_answer())
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.fake.requests.append(("POST", self.path, body))
        if self.path == "/sdapi/v1/options":
            self.fake.checkpoint = body.get("sd_model_checkpoint", self.fake.checkpoint)
            self._send(200, None)
        elif self.path in ("/sdapi/v1/txt2img", "/sdapi/v1/img2img"):
            self._send(*self.fake.generate(self.path, body))
        else:
            self._send(404, {"detail": "Not Found"})
