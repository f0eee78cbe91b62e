"""The coordinator's own port over TLS, and mutual TLS (`coordinator --tls-*`).

Every CoordinatorService call carries the fleet's token; from another pod a plaintext port
handed it to the network. Here: the port answers TLS only (a plaintext client gets nothing),
the server is verified by its CA, mutual TLS refuses a client without a certificate of the
configured CA, and the CLI flags reach the port, with bad flags a clear exit 2 that never
prints a file's contents.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from rollout_checkpoint.client.coordinator.service import SERVICE_NAME, Coordinator
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.server.core.clock import SystemClock
from rollout_checkpoint.server.core.rpc.tls import TlsFilesError, server_credentials
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .conftest import TOKEN, start_harness, stop_harness
from .processes import kill_group, started
from .tls_files import Authority, self_signed

CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
ENV = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="NONE")
METADATA = (("authorization", f"Bearer {TOKEN}"),)


@contextlib.asynccontextmanager
async def coordinator_with(
    tmp_path: Path, credentials: grpc.ServerCredentials
) -> AsyncIterator[str]:
    """A coordinator of a one-member fleet (a real sidecar, plaintext on loopback) serving
    its own port with `credentials`; yields the coordinator's address."""
    harness = await start_harness(clock=SystemClock())  # type: ignore[arg-type]
    spec = FleetSpec(members=(MemberSpec("double", harness.grpc_address),), token=TOKEN)
    coordinator = Coordinator(spec, "127.0.0.1:0", credentials=credentials)
    await coordinator.start()
    try:
        yield f"localhost:{coordinator.port}"
    finally:
        await coordinator.stop()
        await stop_harness(harness)


async def list_members(address: str, credentials: grpc.ChannelCredentials | None) -> list[str]:
    """ListParticipants over `credentials` (None: plaintext); raises the call's error."""
    channel = (
        aio.secure_channel(address, credentials)
        if credentials is not None
        else aio.insecure_channel(address)
    )
    async with channel:
        reply = await cpb_grpc.CoordinatorServiceStub(channel).ListParticipants(
            cpb.ListParticipantsRequest(), metadata=METADATA, timeout=10
        )
    return [member.name for member in reply.members]


async def test_tls_port_serves_verified_clients_and_refuses_plaintext(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    async with coordinator_with(tmp_path, server_credentials(cert, key, None)) as address:
        trusted = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        assert await list_members(address, trusted) == ["double"]
        with pytest.raises(aio.AioRpcError) as plaintext:
            await list_members(address, None)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        # A client that trusts another CA refuses the server: it is verified, not just TLS.
        stranger = Authority.make(tmp_path, "stranger")
        untrusting = grpc.ssl_channel_credentials(root_certificates=stranger.cert.read_bytes())
        with pytest.raises(aio.AioRpcError) as unverified:
            await list_members(address, untrusting)
        assert unverified.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_needs_a_client_certificate_of_the_configured_ca(
    tmp_path: Path,
) -> None:
    ca = Authority.make(tmp_path, "fleet")
    server_key, server_cert = ca.issue("coordinator", usage="serverAuth")
    client_key, client_cert = ca.issue("controller", usage="clientAuth")
    other = Authority.make(tmp_path, "other")
    other_key, other_cert = other.issue("intruder", usage="clientAuth")
    credentials = server_credentials(server_cert, server_key, ca.cert)
    root = ca.cert.read_bytes()
    async with coordinator_with(tmp_path, credentials) as address:
        with_client_cert = grpc.ssl_channel_credentials(
            root, client_key.read_bytes(), client_cert.read_bytes()
        )
        assert await list_members(address, with_client_cert) == ["double"]
        for refused in (
            grpc.ssl_channel_credentials(root),  # no client certificate
            grpc.ssl_channel_credentials(root, other_key.read_bytes(), other_cert.read_bytes()),
        ):
            with pytest.raises(aio.AioRpcError) as caught:
                await list_members(address, refused)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_files_are_checked_before_serving(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    secret = tmp_path / "not-pem.txt"
    secret.write_text("hunter2-do-not-print\n")
    cases = [
        ((cert, None, None), "go together"),
        ((None, key, None), "go together"),
        ((None, None, cert), "needs a server certificate"),
        ((tmp_path / "missing.pem", key, None), "missing.pem"),
        ((secret, key, None), "not a PEM file"),
    ]
    for (cert_file, key_file, client_ca), expected in cases:
        with pytest.raises(TlsFilesError) as caught:
            server_credentials(cert_file, key_file, client_ca)
        assert expected in str(caught.value) and "hunter2" not in str(caught.value)
    assert server_credentials(None, None, None) is None


def test_the_cli_serves_tls_and_health_probes_it(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text('[[participants]]\nname = "a"\naddress = "127.0.0.1:9"\n')
    command = [*CLI, "coordinator", "--fleet", str(fleet_file), "--grpc-address", "127.0.0.1:0"]
    process, announced = started(
        [*command, "--tls-cert-file", str(cert), "--tls-key-file", str(key)], env=ENV
    )
    try:
        port = announced["grpc"].rsplit(":", 1)[1]
        health = [*CLI, "health", "--address", f"localhost:{port}", "--service", SERVICE_NAME]
        over_tls = subprocess.run(
            [*health, "--tls-ca-file", str(cert)], env=ENV, capture_output=True, text=True
        )
        assert over_tls.returncode == 0, over_tls.stderr
        plaintext = subprocess.run(health, env=ENV, capture_output=True, text=True)
        assert plaintext.returncode == 5, plaintext.stderr  # unreachable: no TLS, no answer
    finally:
        kill_group(process)
    secret = tmp_path / "not-pem.txt"
    secret.write_text("hunter2-do-not-print\n")
    for flags, expected in (
        (["--tls-key-file", str(key)], "go together"),
        (["--tls-cert-file", str(secret), "--tls-key-file", str(key)], "not a PEM file"),
    ):
        refused = subprocess.run(
            [*command, *flags], env=ENV, capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2, refused.stderr
        assert expected in refused.stderr and "hunter2" not in refused.stderr + refused.stdout
