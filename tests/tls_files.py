"""Certificates for TLS tests, made with the `openssl` CLI (as docs/kubernetes.md's steps do).

`self_signed` is a server certificate that is its own CA; `Authority` signs server and client
certificates, for mutual TLS. All for `localhost` / 127.0.0.1 and one day."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


def openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """(key, cert) of a self-signed certificate for localhost and 127.0.0.1."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    openssl(
        *("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"),
        *("-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        *("-keyout", key, "-out", cert),
        cwd=directory,
    )
    return key, cert


@dataclass(frozen=True)
class Authority:
    """A CA made in `directory`; `issue` signs a key pair for a server or a client."""

    directory: Path
    name: str

    @property
    def cert(self) -> Path:
        return self.directory / f"{self.name}-ca.crt"

    @classmethod
    def make(cls, directory: Path, name: str = "test") -> Authority:
        authority = cls(directory, name)
        openssl(
            *("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", f"/CN={name}-ca", "-keyout", f"{name}-ca.key", "-out", authority.cert),
            cwd=directory,
        )
        return authority

    def issue(self, stem: str, *, usage: str) -> tuple[Path, Path]:
        """(key, cert) signed by this CA; `usage` is `serverAuth` (for localhost and
        127.0.0.1) or `clientAuth`."""
        key, csr, cert = (self.directory / f"{stem}.{ext}" for ext in ("key", "csr", "crt"))
        extensions = self.directory / f"{stem}.ext"
        names = "subjectAltName = IP:127.0.0.1, DNS:localhost\n" if usage == "serverAuth" else ""
        extensions.write_text(f"{names}extendedKeyUsage = {usage}\n")
        openssl(
            *("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={stem}"),
            *("-keyout", key, "-out", csr),
            cwd=self.directory,
        )
        openssl(
            *("x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", f"{self.name}-ca.key"),
            *("-CAcreateserial", "-days", "1", "-extfile", extensions, "-out", cert),
            cwd=self.directory,
        )
        return key, cert
