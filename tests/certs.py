"""Throwaway TLS material for tests, made with the ``openssl`` command line at test time.

A private CA and a server certificate it signed for 127.0.0.1 (and localhost), a second CA
that signed nothing here (to show verification failing), and a key that belongs to no
certificate (to show a mismatch). EC P-256 keys: generated in milliseconds.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Certs:
    ca: Path
    """The CA certificate that signed ``cert`` (what clients pass as --tls-ca / verify=)."""
    cert: Path
    key: Path
    other_ca: Path
    """A CA certificate that did not sign ``cert``."""
    other_key: Path
    """A private key that does not belong to ``cert``."""


def _openssl(folder: Path, *args: str) -> None:
    openssl = shutil.which("openssl")
    assert openssl, "the openssl command line is needed to make test certificates"
    subprocess.run(
        [openssl, *args], cwd=folder, check=True, capture_output=True, timeout=OPENSSL_TIMEOUT_S
    )


def _self_signed_ca(folder: Path, name: str) -> None:
    _openssl(
        folder,
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2"),
        *("-subj", f"/CN=Shoal test {name}"),
        *("-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )


def make_certs(folder: Path) -> Certs:
    """Write a CA, a server certificate for 127.0.0.1 signed by it, and the odd ones out."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("ca", "other-ca"):
        _self_signed_ca(folder, name)
    _openssl(
        folder,
        *("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"),
    )
    (folder / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        folder,
        *("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key"),
        *("-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext"),
    )
    _openssl(
        folder,
        *("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-out", "other.key"),
    )
    return Certs(
        ca=folder / "ca.pem",
        cert=folder / "server.pem",
        key=folder / "server.key",
        other_ca=folder / "other-ca.pem",
        other_key=folder / "other.key",
    )


def encrypt_key(key: Path, dest: Path, passphrase: str) -> Path:
    """``key`` protected by ``passphrase`` (as a careful admin might hand it over)."""
    _openssl(
        dest.parent,
        *("pkey", "-in", str(key), "-out", str(dest), "-aes256"),
        *("-passout", f"pass:{passphrase}"),
    )
    return dest
