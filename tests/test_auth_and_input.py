"""Auth on every control RPC, and malformed or out-of-range requests: typed refusals only."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.rpc.wire import timestamp as stamp
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import participant_service_pb2_grpc as pb_grpc
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, Harness, drain, refused

SERVICE = "/rollout_checkpoint.v1.ParticipantService/"
UNARY = [
    "GetParticipant",
    "GetStatus",
    "ListEpisodes",
    "Renew",
    "Commit",
    "Restore",
    "Resume",
    "Retire",
    "Forget",
    "SetWeightVersion",
]
ALL_RPCS = [*UNARY, "Prepare"]


def requests(deadline: float) -> dict[str, object]:
    d = stamp(deadline)
    return {
        "GetParticipant": pb.GetParticipantRequest(),
        "GetStatus": pb.GetStatusRequest(),
        "ListEpisodes": pb.ListEpisodesRequest(),
        "Prepare": pb.PrepareRequest(checkpoint_id="c1", deadline=d),
        "Renew": pb.RenewRequest(checkpoint_id="c1", deadline=d),
        "Commit": pb.CommitRequest(checkpoint_id="c1", deadline=d, checkpoint_dir="/tmp/x"),
        "Restore": pb.RestoreRequest(
            checkpoint_id="c1", deadline=d, checkpoint_dir="/tmp/x", scope=types_pb2.EpisodeScope()
        ),
        "Resume": pb.ResumeRequest(checkpoint_id="c1", deadline=d),
        "Retire": pb.RetireRequest(
            checkpoint_id="c1", deadline=d, episodes=[types_pb2.EpisodeId(rollout_id="r")]
        ),
        "Forget": pb.ForgetRequest(checkpoint_id="c1", deadline=d, rollout_ids=["r"]),
        "SetWeightVersion": pb.SetWeightVersionRequest(deadline=d, weight_version=1),
    }


async def call(
    channel: aio.Channel, rpc: str, request: object, metadata: tuple[tuple[str, str], ...] = ()
) -> None:
    stub = pb_grpc.ParticipantServiceStub(channel)  # type: ignore[no-untyped-call]
    try:
        if rpc == "Prepare":
            async for _ in stub.Prepare(request, metadata=metadata, timeout=10):
                pass
        else:
            await getattr(stub, rpc)(request, metadata=metadata, timeout=10)
    except aio.AioRpcError as error:
        raise ControlError.from_rpc_error(error) from None


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Bearer wrong"),),
        (("authorization", TOKEN),),
        (("authorization", f"Basic {TOKEN}"),),
    ],
)
async def test_every_control_rpc_needs_the_token(
    harness: Harness, metadata: tuple[tuple[str, str], ...], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with aio.insecure_channel(harness.grpc_address) as channel:
        for rpc, request in requests(harness.deadline()).items():
            error = await refused(
                call(channel, rpc, request, metadata), "TOKEN_INVALID", "UNAUTHENTICATED"
            )
            assert TOKEN not in error.message and TOKEN not in str(error.metadata)
    # Nothing happened: the refused Prepare did not close admission.
    status = await harness.client.get_status()
    assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open
    assert TOKEN not in caplog.text


async def test_health_answers_without_a_token(harness: Harness) -> None:
    async with aio.insecure_channel(harness.grpc_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in (
            "",
            "rollout_checkpoint.v1.ParticipantService",
            "participant-liveness",
            "participant-readiness",
        ):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_reflection_is_off_by_default(harness: Harness) -> None:
    async with aio.insecure_channel(harness.grpc_address) as channel:
        method = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        )
        with pytest.raises(aio.AioRpcError) as caught:
            async for _ in method(iter([b""]), timeout=30):
                pass
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("rpc", ALL_RPCS)
@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x02\x08"])
async def test_bytes_that_do_not_parse_are_invalid_request(
    harness: Harness, rpc: str, garbage: bytes
) -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    async with aio.insecure_channel(harness.grpc_address) as channel:
        if rpc == "Prepare":
            method = channel.unary_stream(SERVICE + rpc)
            with pytest.raises(aio.AioRpcError) as caught:
                async for _ in method(garbage, metadata=metadata, timeout=10):
                    pass
        else:
            method = channel.unary_unary(SERVICE + rpc)
            with pytest.raises(aio.AioRpcError) as caught:
                await method(garbage, metadata=metadata, timeout=10)
    error = ControlError.from_rpc_error(caught.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INVALID_REQUEST"
    # The server keeps serving.
    assert (await harness.client.get_status()).state == types_pb2.PARTICIPANT_STATE_IDLE


@pytest.mark.parametrize("checkpoint_id", ["", "x" * 129, ".hidden", "-flag", "a/b", "a b", "é"])
async def test_invalid_checkpoint_ids(harness: Harness, checkpoint_id: str) -> None:
    error = await refused(
        drain(harness.client.prepare(checkpoint_id, harness.deadline())),
        "INVALID_REQUEST",
        "INVALID_ARGUMENT",
    )
    assert error.metadata["field"] == "checkpoint_id"
    assert (await harness.client.get_status()).admission_open


async def test_a_checkpoint_id_of_128_characters_is_fine(harness: Harness) -> None:
    final = (await drain(harness.client.prepare("x" * 128, harness.deadline())))[-1]
    assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED


async def test_deadline_bounds(harness: Harness) -> None:
    h = harness
    await refused(
        drain(h.client.prepare("c1", h.clock.now() - 1)),
        "CHECKPOINT_DEADLINE_EXCEEDED",
        "DEADLINE_EXCEEDED",
    )
    error = await refused(
        drain(h.client.prepare("c1", h.clock.now() + 86400 + 10)), "INVALID_REQUEST"
    )
    assert error.metadata["field"] == "deadline"
    async with aio.insecure_channel(h.grpc_address) as channel:
        for rpc in ("Prepare", "Renew", "Commit", "Resume", "Retire", "Forget"):
            request = requests(h.deadline())[rpc]
            request.ClearField("deadline")  # type: ignore[attr-defined]
            err = await refused(
                call(channel, rpc, request, (("authorization", f"Bearer {TOKEN}"),)),
                "INVALID_REQUEST",
            )
            assert err.metadata["field"] == "deadline", rpc
    assert (await h.client.get_status()).admission_open


async def test_out_of_range_episodes(harness: Harness) -> None:
    h = harness
    err = await refused(h.client.retire("x", h.deadline(), []), "INVALID_REQUEST")
    assert err.metadata["field"] == "episodes"
    async with aio.insecure_channel(h.grpc_address) as channel:
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        for episode, field in [
            (types_pb2.EpisodeId(rollout_id="r", attempt=2**31 - 1), "episodes[0].attempt"),
            (types_pb2.EpisodeId(rollout_id="r", attempt=2**32 - 1), "episodes[0].attempt"),
            (types_pb2.EpisodeId(rollout_id="r-a1", attempt=0), "episodes[0].rollout_id"),
            (types_pb2.EpisodeId(rollout_id="", attempt=0), "episodes[0].rollout_id"),
            (types_pb2.EpisodeId(rollout_id="../x", attempt=0), "episodes[0].rollout_id"),
        ]:
            request = pb.RetireRequest(
                checkpoint_id="x", deadline=stamp(h.deadline()), episodes=[episode]
            )
            err = await refused(call(channel, "Retire", request, metadata), "INVALID_REQUEST")
            assert err.metadata["field"] == field
        restore = pb.RestoreRequest(
            checkpoint_id="x", deadline=stamp(h.deadline()), checkpoint_dir="/tmp/x"
        )
        err = await refused(call(channel, "Restore", restore, metadata), "INVALID_REQUEST")
        assert err.metadata["field"] == "scope"
    assert (await h.client.get_status()).retired_rollouts == 0


async def test_a_huge_scope_is_fine(harness: Harness, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rollout_checkpoint.server.core.episodes import EpisodeId

    h = harness
    await drain(h.client.prepare("c1", h.deadline()))
    scope = [EpisodeId(f"r{i}") for i in range(100_000)]
    reply = await h.client.commit("c1", h.deadline(), str(tmp_path / "ckpt"), scope)
    assert reply.manifest.record_count == 0


async def test_describe_and_list(harness: Harness) -> None:
    h = harness
    info = await h.client.get_participant()
    assert info.kind == types_pb2.PARTICIPANT_KIND_RESOURCES and info.instance == "double"
    assert info.api_version == "rollout_checkpoint.v1" and info.schema_version == 1
    assert len(info.boot_id) == 32 and dict(info.facts) == {"mode": "exported", "verify": "wait"}
    for i in range(5):
        await h.http.post(f"/ng-rollout/r{i}/seed", json={"state": {}})
    first = await h.client.list_episodes(page_size=2)
    assert [e.capture_key for e in first.episodes] == ["r0", "r1"] and first.next_page_token
    second = await h.client.list_episodes(page_size=2, page_token=first.next_page_token)
    assert [e.capture_key for e in second.episodes] == ["r2", "r3"]
    assert [e.capture_key for e in await h.client.all_episodes(page_size=2)] == [
        f"r{i}" for i in range(5)
    ]
    await refused(h.client.list_episodes(page_token="!!not-a-token"), "INVALID_REQUEST")
    await refused(h.client.list_episodes(page_size=-1), "INVALID_REQUEST")


async def test_a_client_with_a_wrong_token_raises_control_error(harness: Harness) -> None:
    async with ParticipantClient(harness.grpc_address, "nope") as client:
        error = await refused(client.get_status(), "TOKEN_INVALID")
        assert error.decided_by_server
