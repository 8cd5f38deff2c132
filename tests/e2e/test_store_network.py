"""A model store safe on a network, through real processes: `shoal data` over TLS with the
router's key database, `shoal data upload` (resumed after a broken connection, sha256
checked), the seed's multipart form, plain HTTP refused as the router refuses it, and workers
that fetch over TLS or read the store's folder at a mount path of their own."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import ssl
from pathlib import Path

import openai
import pytest

import http_calls
from certs import Certs, make_certs
from cluster import API_KEY, STORE_REGISTRY, Cluster, upload_cli, wait_until

pytestmark = pytest.mark.e2e

UPLOAD = "/api/v1/storage/upload"
REGISTRY = STORE_REGISTRY
PARTIAL_BYTES = 8 << 20
"""What the broken upload sends before its connection goes."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _broken_upload(url: str, ca: Path, key: str, data: bytes, sha: str) -> None:
    """Start a resumable upload of ``data`` and drop the connection after PARTIAL_BYTES."""
    host, port = url.removeprefix("https://").split(":")
    context = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection((host, int(port))) as raw,
        context.wrap_socket(raw, server_hostname=host) as conn,
    ):
        conn.sendall(
            (
                f"POST {UPLOAD}?id=smol&sha256={sha}&offset=0 HTTP/1.1\r\n"
                f"Host: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Length: {len(data)}\r\n\r\n"
            ).encode()
            + data[:PARTIAL_BYTES]
        )


def test_a_store_over_tls_with_the_routers_key_database(
    cluster: Cluster, certs: Certs, model_path: Path, tmp_path: Path
) -> None:
    admin, worker = cluster.key("admin"), cluster.key("worker")
    store, url = cluster.tls_store(certs, tmp_path / "store")
    trusting = ssl.create_default_context(cafile=certs.ca)
    data = model_path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()

    anonymous = http_calls.post(
        f"{url}{UPLOAD}?id=smol&sha256={sha}", content=b"GGUF", verify=trusting
    )
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    as_worker = http_calls.post(
        f"{url}{UPLOAD}?id=smol&sha256={sha}",
        content=b"GGUF",
        headers={"Authorization": f"Bearer {worker}"},
        verify=trusting,
    )
    assert as_worker.status_code == 403

    plain = http_calls.get(url.replace("https://", "http://") + REGISTRY)
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "tls_required"

    _broken_upload(url, certs.ca, admin, data, sha)
    held = wait_until(
        lambda: http_calls.get(
            f"{url}{UPLOAD}/{sha}", headers={"Authorization": f"Bearer {admin}"}, verify=trusting
        ).json()["offset"],
        30,
        "the store to keep the broken upload's bytes",
    )
    assert 0 < held <= PARTIAL_BYTES
    done = upload_cli(url, model_path, admin, certs.ca, "--id", "smol")
    assert done.returncode == 0, done.stderr
    assert f"stored smol: {len(data)} bytes, sha256 {sha} (verified, resumed at byte" in done.stdout
    assert file_bytes(tmp_path / "store" / "smol.gguf") == sha

    form = http_calls.post(
        f"{url}{UPLOAD}",
        files={"file": ("Smol-Form.gguf", data)},
        headers={"Authorization": f"Bearer {admin}"},
        verify=trusting,
    )
    assert form.status_code == 201 and form.json()["id"] == "smol-form"

    registry = http_calls.get(
        url + REGISTRY, headers={"Authorization": f"Bearer {worker}"}, verify=trusting
    ).json()
    assert {m["id"]: m["sha256"] for m in registry["data"]} == {"smol": sha, "smol-form": sha}
    assert "on https://127.0.0.1" in store.log()


def file_bytes(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_workers_fetch_over_tls_or_read_their_mount(
    cluster: Cluster, certs: Certs, model_path: Path, tmp_path: Path
) -> None:
    worker_key = cluster.key("worker")
    storage = tmp_path / "srv" / "models"
    storage.mkdir(parents=True)
    try:
        os.link(model_path, storage / "smol.gguf")
    except OSError:  # another file system: a copy serves as well
        shutil.copyfile(model_path, storage / "smol.gguf")
    _, url = cluster.tls_store(certs, storage, "--admin-key", "sk-store-admin")
    mount = tmp_path / "mnt" / "models"  # the same folder at another path, as NFS would
    mount.parent.mkdir()
    mount.symlink_to(storage, target_is_directory=True)
    router = cluster.router()
    common = (
        *("--model", "smol", "--model-store", url, "--tls-ca", str(certs.ca)),
        *("--router-url", f"ws://127.0.0.1:{router.port}"),
        *("--llama-server-path", str(cluster.llama_server)),
    )
    fetching = cluster.worker(router, *common, name="fetching", gpu_key=worker_key, model=False)
    mounted = cluster.worker(
        router,
        *common,
        *("--model-store-mount", str(mount), "--cache-dir", str(tmp_path / "cache-b")),
        name="mounted",
        gpu_key=worker_key,
        model=False,
    )
    router.wait_workers(2)
    fetched = tmp_path / "cache" / "models" / "store" / "smol.gguf"
    assert fetched.is_file() and file_bytes(fetched) == file_bytes(model_path)
    assert "from the mounted store folder" in mounted.log()
    assert not (tmp_path / "cache-b" / "models" / "store").exists()
    assert "from the mounted store folder" not in fetching.log()
    with openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        for _ in range(2):
            r = client.chat.completions.create(
                model="smol", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
            assert r.model == "smol" and r.choices[0].message.content
