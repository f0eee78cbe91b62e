"""Installing checkpointing: off by default, settings validation, reflection, TLS, workers."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc import aio
from pydantic import ValidationError
from starlette.applications import Starlette

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.runtime.install import install_checkpointing, serve
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .conftest import TOKEN, start_harness, stop_harness
from .double import DoubleParticipant
from .tls_files import self_signed


def test_off_by_default_installs_nothing() -> None:
    app = Starlette()
    lifespan = app.router.lifespan_context
    middleware = list(app.user_middleware)
    assert install_checkpointing(app, DoubleParticipant(), CheckpointSettings()) is None
    assert install_checkpointing(app, DoubleParticipant(), None) is None
    assert app.router.lifespan_context is lifespan
    assert list(app.user_middleware) == middleware
    assert not hasattr(app.state, "checkpoint")


def test_settings_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="token is required"):
        CheckpointSettings(enabled=True)
    with pytest.raises(ValidationError):
        CheckpointSettings(enabled=True, token="t", lease_grace_second=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="HOST:PORT"):
        CheckpointSettings(enabled=True, token="t", grpc_address="nowhere")
    with pytest.raises(ValidationError, match="go together"):
        CheckpointSettings(enabled=True, token="t", tls_cert_file="/x")
    with pytest.raises(ValidationError, match="absolute"):
        CheckpointSettings(enabled=True, token="t", allowed_checkpoint_roots=("rel",))
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_ENABLED", "true")
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", "from-env")
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_LEASE_GRACE_SECONDS", "42")
    settings = CheckpointSettings()
    assert settings.enabled and settings.lease_grace_seconds == 42
    assert settings.token.get_secret_value() == "from-env"
    assert "from-env" not in repr(settings)


def test_several_workers_fail_at_startup() -> None:
    with pytest.raises(SystemExit, match="exactly one worker"):
        serve(Starlette(), "127.0.0.1", 0, workers=2)


async def test_reflection_on_by_configuration() -> None:
    h = await start_harness(reflection=True)
    try:
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        async with aio.insecure_channel(h.grpc_address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            replies = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=30)]
        names = {s.name for s in replies[0].list_services_response.service}
        assert "rollout_checkpoint.v1.ParticipantService" in names
    finally:
        await stop_harness(h)


async def test_tls(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    h = await start_harness(tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with ParticipantClient(h.grpc_address, TOKEN, credentials=credentials) as client:
            assert (await client.get_participant()).instance == "double"
        async with ParticipantClient(h.grpc_address, TOKEN) as plaintext:
            from rollout_checkpoint.client.errors import ControlError

            with pytest.raises(ControlError) as caught:
                await plaintext.get_participant()
            assert caught.value.reason is None  # the transport failed; the server decided nothing
    finally:
        await stop_harness(h)
