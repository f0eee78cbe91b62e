"""Server TLS credentials for a gRPC port, shared by the sidecar and the coordinator.

Both ports carry the bearer token in their metadata: off loopback, plaintext would hand it to
anyone on the path. The files are read once, when the port is added, so a renewed
certificate takes a restart (as Kubernetes Secrets mounted as files expect)."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc


class TlsFilesError(ValueError):
    """A TLS file that cannot be read or a key without its certificate; the message names the
    file and the problem, never its contents."""


def server_credentials(
    cert_file: str | Path | None, key_file: str | Path | None, client_ca_file: str | Path | None
) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files, or None (plaintext) when no certificate is given.

    With `client_ca_file` every client must present a certificate signed by that CA (mutual
    TLS). The certificate and its key go together: one without the other would silently
    serve plaintext where TLS was meant."""
    if cert_file is None and key_file is None:
        if client_ca_file is not None:
            raise TlsFilesError("a client CA needs a server certificate and key as well")
        return None
    if cert_file is None or key_file is None:
        raise TlsFilesError("the TLS certificate and its private key go together")
    cert = _read(cert_file, "TLS certificate")
    key = _read(key_file, "TLS private key")
    client_ca = _read(client_ca_file, "client CA") if client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def server_ssl_context(
    cert_file: str | Path | None, key_file: str | Path | None, client_ca_file: str | Path | None
) -> ssl.SSLContext | None:
    """The same files as `server_credentials`, with the same rules, for an HTTP port beside
    the gRPC one: a coordinator whose gRPC port is TLS must not take the same token in
    plaintext on its HTTP port."""
    if server_credentials(cert_file, key_file, client_ca_file) is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(cert_file), str(key_file))
        if client_ca_file is not None:
            context.load_verify_locations(str(client_ca_file))
            context.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as error:
        raise TlsFilesError(f"TLS files {cert_file}, {key_file}: {error.reason}") from None
    return context


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise TlsFilesError(f"{what} {path}: {error.strerror or error}") from None
    if b"-----BEGIN " not in data:
        raise TlsFilesError(f"{what} {path}: not a PEM file")
    return data
